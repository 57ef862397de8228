"""PrefillGraphRunner (cluster/engine/prefill_graph_runner.py): the bucket a short prefill pass replays in, its
padded inputs, the eager fallback, and the padded pass against the eager one - on CPU (the same padded
pass without capture; the packed attention kernel through Triton's interpreter) and, marked gpu, the
captured graphs against the eager pass on CUDA."""

import random

import numpy as np
import pytest
import torch
from triton_interpreter import use_interpreter_without_cuda

# Before triton is imported. The passes below run the packed-attention kernel: through the interpreter
# on CPU tensors without CUDA, compiled on CUDA tensors with it (it cannot take CPU tensors there).
KERNEL_DEVICE = "cpu" if use_interpreter_without_cuda() else "cuda"

from cluster import kernels  # noqa: E402
from cluster.engine.graph_buckets import (PREFILL_GRAPH_MAX_SEQS, prefill_bucket_for, prefill_graph_seqs,  # noqa: E402
                                   prefill_token_buckets)
from cluster.kernels.prefill_attention import BLOCK_M, max_tiles, tile_plan  # noqa: E402
from cluster.kv.kv_cache import NULL_BLOCK, KVCacheSpec  # noqa: E402
from cluster.engine.model_runner import ModelRunner, PrefillChunk  # noqa: E402
from cluster.engine.prefill_graph_runner import PassLayout, PrefillGraphRunner  # noqa: E402
from cluster.worker.worker_config import WorkerConfig  # noqa: E402


def test_token_buckets_and_the_bucket_a_pass_replays_in():
    assert prefill_token_buckets(512) == [16, 32, 64, 128, 192, 256, 320, 384, 448, 512]
    assert prefill_token_buckets(300) == [16, 32, 64, 128, 192, 256, 300]
    assert prefill_token_buckets(100) == [16, 32, 64, 100]
    assert prefill_token_buckets(8) == [8]
    assert prefill_token_buckets(0) == []
    sizes = prefill_token_buckets(512)
    assert prefill_bucket_for(sizes, 1, 1) == 16
    assert prefill_bucket_for(sizes, 16, 1) == 16
    assert prefill_bucket_for(sizes, 17, 2) == 32
    assert prefill_bucket_for(sizes, 129, 1) == 192
    assert prefill_bucket_for(sizes, 512, 4) == 512
    assert prefill_bucket_for(sizes, 513, 1) is None  # past the largest: eager
    assert prefill_bucket_for(sizes, 16, 16) == 16
    assert prefill_bucket_for(sizes, 500, PREFILL_GRAPH_MAX_SEQS + 1) is None  # more prompts than rows: eager
    assert prefill_bucket_for(sizes, 0, 0) is None
    assert prefill_graph_seqs(16) == 16 and prefill_graph_seqs(512) == PREFILL_GRAPH_MAX_SEQS


def test_max_tiles_bounds_every_plan():
    rng = random.Random(3)
    for _ in range(300):
        bucket = rng.choice(prefill_token_buckets(512))
        rows = prefill_graph_seqs(bucket)
        n = rng.randint(1, rows)
        cuts = sorted(rng.sample(range(1, bucket), n - 1)) if n > 1 else []
        lens = np.diff([0] + cuts + [rng.randint(max(cuts, default=0) + 1, bucket)])
        _, seq, _ = tile_plan(lens, lens + rng.randint(0, 300))
        assert len(seq) <= max_tiles(bucket, rows)
    assert max_tiles(512, 1) == 512 // BLOCK_M + 1


def test_eager_reason_names_why_a_worker_runs_prefill_eagerly():
    on = WorkerConfig(model_dir="/m", device="cuda", attention_backend="triton")
    assert on.prefill_graph_max_tokens > 0
    assert PrefillGraphRunner.eager_reason(on, tensor_parallel=False) is None
    assert "0" in PrefillGraphRunner.eager_reason(WorkerConfig(model_dir="/m", device="cuda", attention_backend="triton",
                                                               prefill_graph_max_tokens=0), False)
    assert "GPU" in PrefillGraphRunner.eager_reason(WorkerConfig(model_dir="/m", attention_backend="triton"), False)
    assert "triton" in PrefillGraphRunner.eager_reason(WorkerConfig(model_dir="/m", device="cuda"), False)
    assert "tensor parallel" in PrefillGraphRunner.eager_reason(on, tensor_parallel=True)


def _model(device, dtype="float32", gpu_shape=False):
    """A random Llama (2 layers, GQA; on GPU 4 layers of head_dim 64)."""
    from cluster.model.config import ModelArchConfig
    from cluster.model.loader import random_model

    shape = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=64) if gpu_shape else \
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16)
    arch = ModelArchConfig.from_dict(dict(model_type="llama", vocab_size=512, max_position_embeddings=1024,
                                          rms_norm_eps=1e-5, **shape))
    return random_model(arch, getattr(torch, dtype), device, seed=3, attention_backend="triton")


def _runners(device, max_tokens=64, blocks=48, dtype="float32"):
    """One model, its eager ModelRunner (whose cache the model is bound to) and a PrefillGraphRunner on it."""
    model = _model(device, dtype, gpu_shape=device == "cuda")
    spec = KVCacheSpec.for_model(model.cfg, 16, blocks, getattr(torch, dtype))
    runner = ModelRunner(model, spec, device)
    graphs = PrefillGraphRunner(model, runner.kv_cache, 16, max_blocks_per_seq=blocks, max_tokens=max_tokens)
    return runner, graphs


def _both(runner, graphs, chunks):
    """(eager logits, eager KV cache, graphed logits, graphed KV cache), each pass from the same cache."""
    before = runner.kv_cache.clone()
    runner.prefill_graphs = None
    want = runner.prefill(chunks)
    want_kv = runner.kv_cache.clone()
    runner.kv_cache.copy_(before)
    runner.prefill_graphs = graphs
    replays = graphs.replays
    got = runner.prefill(chunks)
    assert graphs.replays == replays + 1
    return want, want_kv, got, runner.kv_cache.clone()


def _chunks(rng, lens, starts=None, blocks_from=1):
    out, at = [], blocks_from
    for i, n in enumerate(lens):
        start = starts[i] if starts else 0
        nb = -(-(start + n) // 16)
        out.append(PrefillChunk([rng.randrange(5, 500) for _ in range(n)], start, list(range(at, at + nb))))
        at += nb
    return out


def test_staged_inputs_are_the_eager_inputs_then_padding():
    runner, graphs = _runners("cpu")
    rng = random.Random(1)
    chunks = _chunks(rng, [5, 20], starts=[0, 16])
    lay = graphs.layouts[32]
    words, width, q_lens, ctx = graphs.stage(chunks, lay)
    assert (q_lens, ctx, width) == ((5, 20), (5, 36), 3)
    ids, pos, meta, last = runner.build_prefill_inputs(chunks)
    buf = graphs._np
    assert buf[lay.ids][:25].tolist() == ids.tolist() and buf[lay.ids][25:].tolist() == [0] * 7
    assert buf[lay.positions][:25].tolist() == pos.tolist() and buf[lay.positions][25:].tolist() == [0] * 7
    assert buf[lay.slots][:25].tolist() == meta.slot_mapping.tolist()
    assert buf[lay.slots][25:].tolist() == [NULL_BLOCK * 16] * 7  # padding writes only the null block
    assert buf[lay.last][:2].tolist() == last.tolist() and not buf[lay.last][2:].any()
    assert buf[lay.context_lens].tolist() == [5, 36] + [0] * (lay.rows - 1)
    assert buf[lay.cu_query_lens].tolist() == [0, 5, 25] + [25] * (lay.rows - 1)
    tiles = buf[lay.tile_list].reshape(2, lay.tiles)
    assert tiles.shape[1] == max_tiles(32, prefill_graph_seqs(32))
    assert sorted(tiles[0, :2].tolist()) == [0, 1] and (tiles[0, 2:] == lay.rows).all()  # unused: the padding row
    assert buf[lay.tables : lay.tables + 2 * width].reshape(2, width).tolist() == meta.block_tables.tolist()
    assert words == lay.tables + 2 * width


def test_passes_past_the_buckets_are_declined_and_run_eagerly():
    runner, graphs = _runners(KERNEL_DEVICE, max_tokens=32)
    if KERNEL_DEVICE == "cuda":
        graphs.capture()  # (on CUDA a pass replays only a captured graph; on CPU the padded pass runs as is)
    runner.prefill_graphs = graphs
    rng = random.Random(2)
    long = _chunks(rng, [40])
    assert graphs.bucket_for(long) is None
    assert graphs.run(long) is None and graphs.declined == 1
    got = runner.prefill(long)
    assert graphs.replays == 0 and graphs.declined == 2
    runner.prefill_graphs = None
    assert torch.equal(got, runner.prefill(long))  # the fallback is the eager pass
    runner.prefill_graphs = graphs
    many = _chunks(rng, [1] * (prefill_graph_seqs(32) + 1))
    assert graphs.run(many) is None
    runner.prefill(_chunks(rng, [3, 4]))
    assert graphs.replays == 1
    # prompt logprobs need every position's logits: always eager
    runner.prefill(_chunks(rng, [3]), all_logits=True)
    assert graphs.replays == 1


@pytest.mark.parametrize("fused", [False, True], ids=["torch-attention", "triton-kernel"])
def test_padded_pass_equals_the_eager_pass(fused):
    """The padded pass (what each graph replays) against the eager one: fresh prompts and a cached
    prefix's tail in one pass, the KV cache poisoned so that a read of an unwritten slot shows."""
    rng = random.Random(5)
    runner, graphs = _runners(KERNEL_DEVICE, max_tokens=16)  # one bucket of 16 tokens, 16 prompt rows (the interpreter is slow)
    runner.kv_cache.fill_(float("nan"))
    with kernels.use_kernels(fused):
        if KERNEL_DEVICE == "cuda":
            graphs.capture()  # (with this kernel choice: a graph replays what it captured)
        prefix = _chunks(rng, [32])
        runner.prefill(prefix)
        tail = PrefillChunk([rng.randrange(5, 500) for _ in range(7)], 32, prefix[0].block_table + [3])
        chunks = [_chunks(rng, [6], blocks_from=10)[0], tail, _chunks(rng, [1], blocks_from=20)[0]]  # 14 tokens
        want, want_kv, got, got_kv = _both(runner, graphs, chunks)
    assert got.shape == want.shape == (3, 512)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    real = torch.arange(1, runner.spec.num_blocks)  # every block but the null one, which padding writes
    torch.testing.assert_close(got_kv[:, :, real], want_kv[:, :, real], rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_captured_graphs_equal_the_eager_pass(dtype):
    """On CUDA: every shape of short pass replays its graph and gives the eager pass's first tokens,
    logits and KV (bit for bit where the bucket is the pass's token count: the same GEMM shapes)."""
    rng = random.Random(7)
    runner, graphs = _runners("cuda", max_tokens=128, blocks=96, dtype=dtype)
    graphs.capture()
    assert sorted(graphs.graphs) == [16, 32, 64, 128]
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == "bfloat16" else dict(rtol=1e-4, atol=1e-4)
    prefix = _chunks(rng, [200])  # past the buckets: eager; a cached prefix for the tail below
    runner.prefill(prefix)
    cases = [[16], [128], [5, 20, 7], [64, 64], [1] * 16, [100], [3, 9]]
    at = 20
    for lens in cases:
        chunks = _chunks(rng, lens, blocks_from=at)
        at += sum(-(-n // 16) for n in lens)
        if lens == [100]:  # a cached prefix's tail: 100 tokens after the 200 above
            chunks = [PrefillChunk(chunks[0].token_ids, 200, prefix[0].block_table + list(range(at, at + 6)))]
            at += 6
        want, want_kv, got, got_kv = _both(runner, graphs, chunks)
        torch.testing.assert_close(got.float(), want.float(), **tol)
        assert torch.equal(got.argmax(-1), want.argmax(-1)), lens
        blocks = sorted({b for c in chunks for b in c.block_table})
        if sum(lens) in graphs.buckets:
            assert torch.equal(got_kv[:, :, blocks], want_kv[:, :, blocks]), lens
        else:
            torch.testing.assert_close(got_kv[:, :, blocks].float(), want_kv[:, :, blocks].float(), **tol)
        runner.kv_cache.copy_(want_kv)
    torch.cuda.synchronize()


def test_prefill_worker_on_cpu_reports_why_its_passes_are_eager(demo_model_dir):
    from prefill_worker.prefill_worker import PrefillWorker

    w = PrefillWorker("p0", WorkerConfig(model_dir=str(demo_model_dir), num_blocks=32, max_prefill_tokens=64))
    try:
        assert w.prefill_graphs is None and w.runner.prefill_graphs is None
        assert "GPU" in w.stats().extra["prefill_graphs"]["off"]
    finally:
        w.shutdown()


@pytest.mark.gpu
def test_prefill_worker_captures_before_serving_and_replays_its_short_passes(demo_model_dir):
    import dataclasses

    from prefill_worker.prefill_worker import PrefillWorker

    cfg = WorkerConfig(model_dir=str(demo_model_dir), dtype="float32", device="cuda", attention_backend="triton",
                       num_blocks=256, max_prefill_tokens=1024, prefill_graph_max_tokens=256)
    w = PrefillWorker("p0", cfg)
    try:
        graphs = w.prefill_graphs
        assert graphs is not None and w.runner.prefill_graphs is graphs
        assert sorted(graphs.graphs) == prefill_token_buckets(256)  # captured at construction, before serving
        w.warmup()
        st = w.stats().extra["prefill_graphs"]
        assert st["replays"] > 0 and st["declined"] > 0  # warm-up's short shapes replayed, its long ones eager
    finally:
        w.shutdown()
    off = PrefillWorker("p1", dataclasses.replace(cfg, prefill_graph_max_tokens=0))
    try:
        assert off.runner.prefill_graphs is None and "is 0" in off.stats().extra["prefill_graphs"]["off"]
    finally:
        off.shutdown()
