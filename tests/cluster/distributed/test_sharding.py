"""The split of a model over a tensor-parallel group (cluster/distributed/sharding.py): which heads, rows
and vocabulary each rank holds, KV heads replicated when there are fewer than ranks, and the one check
that refuses a size the model cannot be split by (with the numbers in the message)."""

import pytest

from cluster.distributed.sharding import TPShard, check_tensor_parallel, kv_heads_of_rank
from cluster.errors import ModelLoadError
from cluster.model.config import ModelArchConfig


def _arch(heads=32, kv=8, inter=14336, vocab=128256, head_dim=128):
    return ModelArchConfig("llama", vocab, heads * head_dim, inter, 2, heads, kv, head_dim, 1e-5, 4096, 5e5)


def test_heads_rows_and_vocabulary_split_evenly():
    a = _arch()
    shards = [TPShard.of(a, r, 4) for r in range(4)]
    assert [s.num_heads for s in shards] == [8] * 4 and [s.head_start for s in shards] == [0, 8, 16, 24]
    assert [list(s.kv_heads) for s in shards] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert shards[1].q_rows == (8 * 128, 8 * 128) and shards[1].kv_rows == (2 * 128, 2 * 128)
    assert shards[3].mlp_rows == (3 * 3584, 3584)
    assert [s.vocab_rows for s in shards] == [(0, 32064), (32064, 64128), (64128, 96192), (96192, 128256)]
    # Every rank's q heads read only its own KV heads (q head j reads KV head j // (H / K)).
    for s in shards:
        assert {j // 4 for j in range(s.head_start, s.head_start + s.num_heads)} == set(s.kv_heads)


def test_kv_heads_are_replicated_when_fewer_than_ranks():
    # 8 KV heads at TP 16: each head on two ranks; Mistral-like 1 KV head at TP 2: on both.
    assert [list(kv_heads_of_rank(8, 16, r)) for r in range(16)] == [[r // 2] for r in range(16)]
    assert [list(kv_heads_of_rank(1, 2, r)) for r in range(2)] == [[0], [0]]
    a = _arch(heads=16, kv=8, inter=1024, vocab=1000)
    for r in range(16):
        s = TPShard.of(a, r, 16)
        assert s.num_heads == 1 and list(s.kv_heads) == [r // 2]
        assert {s.head_start // 2} == set(s.kv_heads)  # GQA group of 2: q head j reads KV head j // 2


def test_uneven_vocabulary_pads_the_last_rank():
    a = _arch(heads=4, kv=2, inter=256, vocab=501, head_dim=32)
    shards = [TPShard.of(a, r, 4) for r in range(4)]
    assert {s.vocab_shard for s in shards} == {126}
    assert [s.vocab_rows for s in shards] == [(0, 126), (126, 252), (252, 378), (378, 501)]


@pytest.mark.parametrize("heads,kv,inter,size,needle", [
    (32, 8, 14336, 3, "does not divide the 32 attention heads"),
    (24, 6, 4096, 4, "does not divide the 6 KV heads"),
    (32, 3, 4096, 8, "multiple of 3"),
    (32, 8, 1000, 16, "MLP's 1000 rows"),
])
def test_sizes_the_model_cannot_be_split_by_are_refused_with_the_numbers(heads, kv, inter, size, needle):
    with pytest.raises(ModelLoadError, match=needle):
        check_tensor_parallel(heads, kv, inter, size)


def test_size_one_and_valid_sizes_pass():
    for size in (1, 2, 4, 8):
        check_tensor_parallel(32, 8, 14336, size)
    check_tensor_parallel(32, 8, 14336, 16)  # KV heads replicated twice
    with pytest.raises(ModelLoadError):
        check_tensor_parallel(32, 8, 14336, 0)
