"""The Triton paged decode kernel against the torch reference: on GPU natively, on CPU through
Triton's interpreter (skipped if triton is not installed)."""

import pytest
import torch
from triton_interpreter import use_interpreter_without_cuda

use_interpreter_without_cuda()  # before triton is imported

from cluster.attention import AttentionMetadata, get_backend  # noqa: E402
from cluster.attention.torch_ref import TorchAttentionBackend  # noqa: E402
from cluster.attention.triton_decode import paged_decode_attention  # noqa: E402


def _case(b, heads, kv_heads, head_dim, page, ctx_lens, num_blocks, dtype, device, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    kv = torch.randn(2, num_blocks, page, kv_heads, head_dim, generator=g).to(device=device, dtype=dtype)
    q = torch.randn(b, heads, head_dim, generator=g).to(device=device, dtype=dtype)
    width = max(-(-c // page) for c in ctx_lens) + 2
    # Random, non-contiguous blocks (never block 0) and NULL padding past each row's context.
    tables = torch.zeros(b, width, dtype=torch.int32)
    for i, c in enumerate(ctx_lens):
        n = -(-c // page)
        tables[i, :n] = torch.randperm(num_blocks - 1, generator=g)[:n] + 1
    ctx = torch.tensor(ctx_lens, dtype=torch.int32)
    return q, kv, tables.to(device), ctx.to(device)


def _reference(q, kv, tables, ctx, heads, kv_heads, head_dim, window):
    ref = TorchAttentionBackend(heads, kv_heads, head_dim, window)
    meta = AttentionMetadata(torch.zeros(q.shape[0], dtype=torch.long, device=q.device), tables, ctx)
    return ref._decode(q.float(), kv.float(), meta)


CPU_CASES = [  # (batch, heads, kv_heads, head_dim, ctx lens, window, splits)
    (3, 8, 2, 32, [1, 37, 150], None, 1),
    (3, 8, 2, 32, [1, 37, 150], None, 3),
    (2, 4, 4, 16, [64, 17], None, 2),  # MHA
    (2, 6, 1, 32, [200, 9], 40, 1),  # MQA + sliding window
    (2, 6, 1, 32, [200, 9], 40, 4),
]


@pytest.mark.parametrize("b,heads,kv_heads,head_dim,ctx,window,splits", CPU_CASES)
def test_kernel_matches_reference_float32(b, heads, kv_heads, head_dim, ctx, window, splits):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, kv, tables, ctx_t = _case(b, heads, kv_heads, head_dim, 16, ctx, 40, torch.float32, device, seed=len(ctx) + splits)
    out = paged_decode_attention(q, kv[0], kv[1], tables, ctx_t, head_dim**-0.5, window, num_splits=splits)
    ref = _reference(q, kv, tables, ctx_t, heads, kv_heads, head_dim, window)
    assert torch.isfinite(out).all()
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-4


def test_registered_as_backend_and_decodes_like_torch_in_the_model(demo_model_dir):
    from cluster.kv.kv_cache import KVCacheSpec
    from cluster.model.loader import load_model
    from cluster.engine.model_runner import ModelRunner, PrefillChunk

    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert get_backend("triton").name == "triton"
    logits = {}
    for backend in ("torch", "triton"):
        model = load_model(demo_model_dir, dtype="float32", device=device, attention_backend=backend)
        spec = KVCacheSpec.for_model(model.cfg, 16, 32, torch.float32)
        runner = ModelRunner(model, spec, device)
        prompts = [[0] + list(range(5, 5 + n)) for n in (4, 40)]
        tables = [[1, 2, 3, 4], [5, 6, 7, 8]]
        runner.prefill([PrefillChunk(p, 0, t) for p, t in zip(prompts, tables)])
        logits[backend] = runner.decode([7, 9], [len(p) for p in prompts], tables)
    torch.testing.assert_close(logits["triton"], logits["torch"], rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("b", [1, 4, 64])
@pytest.mark.parametrize("window", [None, 1000])
def test_kernel_bf16_llama_shapes_on_gpu(b, window):
    heads, kv_heads, head_dim = 32, 8, 128
    ctx = [int(x) for x in torch.randint(1, 4097, (b,), generator=torch.Generator().manual_seed(b))]
    ctx[0] = 4096
    q, kv, tables, ctx_t = _case(b, heads, kv_heads, head_dim, 16, ctx, 4096 // 16 * b + 1, torch.bfloat16, "cuda", b)
    out = paged_decode_attention(q, kv[0], kv[1], tables, ctx_t, head_dim**-0.5, window)
    ref = _reference(q, kv, tables, ctx_t, heads, kv_heads, head_dim, window)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.gpu
def test_kernel_replays_in_a_cuda_graph_with_new_context_lengths():
    heads, kv_heads, head_dim, b = 16, 4, 64, 2
    q, kv, tables, ctx_t = _case(b, heads, kv_heads, head_dim, 16, [300, 5], 64, torch.bfloat16, "cuda", 7)
    out = paged_decode_attention(q, kv[0], kv[1], tables, ctx_t, head_dim**-0.5)  # warm-up / compile
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = paged_decode_attention(q, kv[0], kv[1], tables, ctx_t, head_dim**-0.5)
    for lens in ([300, 5], [17, 301], [1, 1]):
        ctx_t.copy_(torch.tensor(lens, dtype=torch.int32))
        g.replay()
        ref = _reference(q, kv, tables, ctx_t, heads, kv_heads, head_dim, None)
        assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2


FP8_CASES = [  # (batch, heads, kv_heads, head_dim, ctx lens, window, splits, k_scale, v_scale)
    (3, 8, 2, 32, [1, 37, 150], None, 1, 1.0, 1.0),
    (3, 8, 2, 32, [1, 37, 150], None, 3, 0.02, 0.3),
    (2, 6, 1, 32, [200, 9], 40, 4, 0.5, 2.0),
]


@pytest.mark.parametrize("b,heads,kv_heads,head_dim,ctx,window,splits,k_scale,v_scale", FP8_CASES)
def test_kernel_reads_an_fp8_cache_like_the_reference(b, heads, kv_heads, head_dim, ctx, window, splits, k_scale,
                                                       v_scale):
    """An e4m3 cache (k / k_scale, v / v_scale stored): the kernel folds the scales in, the reference
    dequantizes; both attend over the same quantized values."""
    from cluster.kernels.reference import kv_quantize

    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, kv, tables, ctx_t = _case(b, heads, kv_heads, head_dim, 16, ctx, 40, torch.float32, device, seed=splits)
    kv8 = torch.stack([kv_quantize(kv[0] * k_scale, k_scale), kv_quantize(kv[1] * v_scale, v_scale)])
    out = paged_decode_attention(q, kv8[0], kv8[1], tables, ctx_t, head_dim**-0.5, window, num_splits=splits,
                                 k_scale=k_scale, v_scale=v_scale)
    meta = AttentionMetadata(torch.zeros(b, dtype=torch.long, device=device), tables, ctx_t)
    ref = TorchAttentionBackend(heads, kv_heads, head_dim, window)._decode(q, kv8, meta, k_scale, v_scale)
    assert torch.isfinite(out).all()
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-5
    # And it is attention over the dequantized values, close to the unquantized one (e4m3: ~3% per value).
    full = _reference(q, torch.stack([kv[0] * k_scale, kv[1] * v_scale]), tables, ctx_t, heads, kv_heads, head_dim,
                      window)
    assert ((out.float() - full).norm() / full.norm()).item() < 0.1


@pytest.mark.gpu
def test_fp8_cache_bf16_llama_shapes_on_gpu():
    from cluster.kernels.reference import kv_quantize

    heads, kv_heads, head_dim, b = 32, 8, 128, 16
    ctx = [int(x) for x in torch.randint(1, 4097, (b,), generator=torch.Generator().manual_seed(b))]
    q, kv, tables, ctx_t = _case(b, heads, kv_heads, head_dim, 16, ctx, 4096 // 16 * b + 1, torch.bfloat16, "cuda", b)
    kv8 = torch.stack([kv_quantize(kv[0], 0.05), kv_quantize(kv[1], 0.02)])
    out = paged_decode_attention(q, kv8[0], kv8[1], tables, ctx_t, head_dim**-0.5, k_scale=0.05, v_scale=0.02)
    meta = AttentionMetadata(torch.zeros(b, dtype=torch.long, device="cuda"), tables, ctx_t)
    ref = TorchAttentionBackend(heads, kv_heads, head_dim, None)._decode(q.float(), kv8, meta, 0.05, 0.02)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
