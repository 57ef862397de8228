"""Packed paged prefill attention against the torch reference backend's prefill (one SDPA per sequence)."""

import pytest
import torch
from triton_interpreter import use_interpreter_without_cuda

use_interpreter_without_cuda()  # before triton is imported

from cluster.attention import AttentionMetadata  # noqa: E402
from cluster.attention.torch_ref import TorchAttentionBackend  # noqa: E402
from cluster.kernels.prefill_attention import BLOCK_M, plan_tiles, prefill_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAGE = 16


def _case(heads, kv_heads, head_dim, query_lens, cached, dtype, device, seed):
    """A paged cache holding every sequence's context (cached prefix + new tokens) in random blocks;
    everything else, the NULL block and the tails of last blocks included, is NaN."""
    g = torch.Generator().manual_seed(seed)
    ctx = [c + q for c, q in zip(cached, query_lens)]
    per_seq = [-(-c // PAGE) for c in ctx]
    num_blocks = sum(per_seq) + 3
    kv = torch.full((2, num_blocks, PAGE, kv_heads, head_dim), float("nan"))
    width = max(per_seq) + 1
    tables = torch.zeros(len(ctx), width, dtype=torch.int32)
    order = torch.randperm(num_blocks - 1, generator=g) + 1
    used, ks, vs = 0, [], []
    for i, (c, c0) in enumerate(zip(ctx, cached)):
        blocks = order[used : used + per_seq[i]]
        used += per_seq[i]
        tables[i, : len(blocks)] = blocks
        flat = torch.randn(2, c, kv_heads, head_dim, generator=g)
        for j, b in enumerate(blocks.tolist()):
            n = min(PAGE, c - j * PAGE)
            kv[:, b, :n] = flat[:, j * PAGE : j * PAGE + n]
        ks.append(flat[0, c0:])
        vs.append(flat[1, c0:])
    q = torch.randn(sum(query_lens), heads, head_dim, generator=g)
    meta = AttentionMetadata(torch.zeros(q.shape[0], dtype=torch.long), tables, torch.tensor(ctx, dtype=torch.int32),
                             True, tuple(query_lens), tuple(ctx))
    to = dict(device=device, dtype=dtype)
    return q.to(**to), torch.cat(ks).to(**to), torch.cat(vs).to(**to), kv.to(**to), meta


def _check(heads, kv_heads, head_dim, query_lens, cached, window, dtype, device, seed, tol):
    q, k, v, kv, meta = _case(heads, kv_heads, head_dim, query_lens, cached, dtype, device, seed)
    ref_meta = AttentionMetadata(meta.slot_mapping, meta.block_tables.to(device), meta.context_lens.to(device),
                                 True, meta.query_lens, meta.context_lens_host)
    want = TorchAttentionBackend(heads, kv_heads, head_dim, window)._prefill(
        q.float(), k.float(), v.float(), kv.float(), ref_meta)
    cu, tiles = plan_tiles(meta.query_lens, meta.context_lens_host, device)
    out = torch.full((q.shape[0] + BLOCK_M, heads, head_dim), float("nan"), dtype=dtype, device=device)
    got = prefill_attention(q, kv[0], kv[1], ref_meta.block_tables, ref_meta.context_lens, cu, tiles,
                            head_dim**-0.5, window, out=out)
    assert got.data_ptr() == out.data_ptr() and got.shape == q.shape and torch.isfinite(got).all()
    err = ((got.float() - want).norm() / want.norm()).item()
    assert err < tol, err


CPU_CASES = [  # heads, kv_heads, head_dim, query lens, cached lens, window
    (4, 2, 32, [1, 37, 150], [0, 0, 0], None),  # fresh prompts, one longer than a tile
    (6, 2, 16, [20, 5, 131], [33, 100, 7], None),  # later chunks after unaligned cached prefixes
    (4, 1, 32, [200, 9], [0, 60], 40),  # MQA, sliding window crossed
    (6, 6, 16, [130, 64], [70, 0], 50),  # MHA
    (12, 3, 16, [3, 129], [250, 0], 100),  # GQA 4 with a non-power-of-two head count
]


@pytest.mark.parametrize("heads,kv_heads,head_dim,query_lens,cached,window", CPU_CASES)
def test_matches_reference_float32(heads, kv_heads, head_dim, query_lens, cached, window):
    _check(heads, kv_heads, head_dim, query_lens, cached, window, torch.float32, DEVICE, seed=len(query_lens) + heads,
           tol=1e-5)


def test_matches_reference_half_precision():
    # float16 on CPU: Triton's interpreter multiplies bfloat16 dot operands as their raw bits.
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    _check(8, 2, 32, [77, 140], [0, 20], None, dtype, DEVICE, seed=3, tol=1e-2)


def test_plan_tiles_cover_every_query_once_longest_first():
    cu, tiles = plan_tiles([1, 128, 129, 300], [1, 1128, 129, 300], "cpu")
    assert cu.tolist() == [0, 1, 129, 258, 558]
    # Keys read: seq 1's tile 1128, seq 3's 300 and 256, seq 2's 129, then 128 (seq 2, seq 3), seq 0's 1.
    assert tiles.tolist() == [[1, 3, 3, 2, 2, 3, 0], [0, 256, 128, 128, 0, 0, 0]]


GPU_CASES = [
    (32, 8, 128, [4096], [0], None),  # Llama-3.1-8B shape, 1 x 4096
    (32, 8, 128, [2048, 2048], [0, 0], None),
    (32, 8, 64, [128] * 32, [0] * 32, None),  # Llama-3.2-1B shape, 32 x 128
    (28, 4, 128, [511, 1, 77], [0, 1000, 333], None),  # Qwen2-7B heads (GQA 7), chunks after prefixes
    (16, 16, 64, [300, 1025], [0, 0], None),  # MHA
    (32, 4, 128, [1000, 3001], [3000, 0], 1000),  # GQA 8, sliding window
]


@pytest.mark.gpu
@pytest.mark.parametrize("heads,kv_heads,head_dim,query_lens,cached,window", GPU_CASES)
def test_matches_reference_bf16_on_gpu(heads, kv_heads, head_dim, query_lens, cached, window):
    _check(heads, kv_heads, head_dim, query_lens, cached, window, torch.bfloat16, "cuda", seed=heads + len(query_lens),
           tol=1e-2)


@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.03, 0.4)])
@pytest.mark.parametrize("heads,kv_heads,head_dim,query_lens,cached,window", [CPU_CASES[1], CPU_CASES[2]])
def test_reads_an_fp8_cache_like_the_reference(heads, kv_heads, head_dim, query_lens, cached, window, scales):
    """An e4m3 cache (the new tokens' K/V too): the kernel folds the scales in, the reference dequantizes."""
    from cluster.kernels.reference import kv_quantize

    dtype = torch.float32
    q, k, v, kv, meta = _case(heads, kv_heads, head_dim, query_lens, cached, dtype, DEVICE, seed=7)
    kv8 = torch.stack([kv_quantize(kv[0], scales[0]), kv_quantize(kv[1], scales[1])])  # NaN stays NaN
    ref_meta = AttentionMetadata(meta.slot_mapping, meta.block_tables.to(DEVICE), meta.context_lens.to(DEVICE),
                                 True, meta.query_lens, meta.context_lens_host)
    want = TorchAttentionBackend(heads, kv_heads, head_dim, window)._prefill(q, k, v, kv8, ref_meta, *scales)
    cu, tiles = plan_tiles(meta.query_lens, meta.context_lens_host, DEVICE)
    got = prefill_attention(q, kv8[0], kv8[1], ref_meta.block_tables, ref_meta.context_lens, cu, tiles,
                            head_dim**-0.5, window, k_scale=scales[0], v_scale=scales[1])
    assert torch.isfinite(got).all()
    assert ((got.float() - want).norm() / want.norm()).item() < 1e-5


@pytest.mark.gpu
def test_reads_an_fp8_cache_bf16_on_gpu():
    from cluster.kernels.reference import kv_quantize

    heads, kv_heads, head_dim, query_lens, cached = 32, 8, 128, [1000, 3001], [3000, 0]
    q, k, v, kv, meta = _case(heads, kv_heads, head_dim, query_lens, cached, torch.bfloat16, "cuda", seed=11)
    kv8 = torch.stack([kv_quantize(kv[0], 0.05), kv_quantize(kv[1], 0.02)])
    ref_meta = AttentionMetadata(meta.slot_mapping, meta.block_tables.cuda(), meta.context_lens.cuda(),
                                 True, meta.query_lens, meta.context_lens_host)
    want = TorchAttentionBackend(heads, kv_heads, head_dim, None)._prefill(q, k, v, kv8, ref_meta, 0.05, 0.02)
    cu, tiles = plan_tiles(meta.query_lens, meta.context_lens_host, "cuda")
    got = prefill_attention(q, kv8[0], kv8[1], ref_meta.block_tables, ref_meta.context_lens, cu, tiles,
                            head_dim**-0.5, k_scale=0.05, v_scale=0.02)
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2
