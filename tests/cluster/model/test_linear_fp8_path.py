"""The one FP8 dispatch rule (cluster/model/linear.py `fp8_path`): what may quantize its activations,
the tuned table's choice per shape and batch, the default threshold elsewhere; and each path through
Fp8LinearMethod computes its reference math (the Triton kernels under the interpreter on CPU)."""

import pytest
import torch
from triton_interpreter import use_interpreter_without_cuda

use_interpreter_without_cuda()  # before triton is imported

from cluster import kernels  # noqa: E402
from cluster.kernels import fp8_gemm_configs, reference  # noqa: E402
from cluster.model import linear  # noqa: E402
from cluster.model.linear import Fp8LinearMethod, Linear, fp8_path  # noqa: E402
from cluster.model.quantization import Fp8Scheme  # noqa: E402

CPU = torch.device("cpu")
DYNAMIC = Fp8Scheme("channel", "dynamic")
STATIC = Fp8Scheme("tensor", "static")
WEIGHT_ONLY = Fp8Scheme("channel", "none")
BLOCK = Fp8Scheme("block", "dynamic", block=(128, 128))


def test_without_a_table_the_threshold_decides():
    m = linear.FP8_GEMV_MAX_M
    for scheme in (DYNAMIC, STATIC):
        assert fp8_path(scheme, m, 4096, 4096, CPU) == linear.WEIGHT_ONLY
        assert fp8_path(scheme, m + 1, 4096, 4096, CPU) == linear.SCALED_MM


def test_weight_only_and_block_scaled_weights_never_quantize_activations(monkeypatch):
    monkeypatch.setattr(fp8_gemm_configs, "tuned_path", lambda n, k, m, device: linear.W8A8)
    for scheme in (WEIGHT_ONLY, BLOCK):
        for m in (1, 64, 4096):
            assert fp8_path(scheme, m, 4096, 4096, CPU) == linear.WEIGHT_ONLY
        with linear.forced_fp8_path(linear.SCALED_MM):
            assert fp8_path(scheme, 512, 4096, 4096, CPU) == linear.WEIGHT_ONLY


def test_the_tuned_table_decides_where_it_has_the_shape(monkeypatch):
    table = {(4096, 4096, 1): linear.WEIGHT_ONLY, (4096, 4096, 16): linear.W8A8, (4096, 4096, 128): linear.SCALED_MM}
    monkeypatch.setattr(fp8_gemm_configs, "tuned_path",
                        lambda n, k, m, device: table.get((n, k, fp8_gemm_configs.m_bucket(m))))
    assert fp8_path(DYNAMIC, 1, 4096, 4096, CPU) == linear.WEIGHT_ONLY
    assert fp8_path(DYNAMIC, 9, 4096, 4096, CPU) == linear.W8A8  # bucket 16
    assert fp8_path(DYNAMIC, 100, 4096, 4096, CPU) == linear.SCALED_MM
    assert fp8_path(DYNAMIC, 3, 4096, 4096, CPU) == linear.WEIGHT_ONLY  # bucket 4 not in the table: the rule
    assert fp8_path(DYNAMIC, 9, 2048, 4096, CPU) == linear.WEIGHT_ONLY  # another shape: the rule
    with linear.forced_fp8_path(linear.SCALED_MM):
        assert fp8_path(DYNAMIC, 1, 4096, 4096, CPU) == linear.SCALED_MM
    assert fp8_path(DYNAMIC, 1, 4096, 4096, CPU) == linear.WEIGHT_ONLY  # the override ends with its block


def _layer(scheme, n, k, gen):
    layer = Linear(k, [n], bias=True, method=Fp8LinearMethod(scheme), dtype=torch.float32)
    w = torch.randn(n, k, generator=gen) * k**-0.5
    q, s = linear.quantize_weight_per_channel(w)
    layer.weight.data.copy_(q)
    layer.weight_scale.data.copy_(s)
    layer.bias.data.copy_(torch.randn(n, generator=gen) * 0.1)
    if scheme.activations == "static":
        layer.input_scale.data.fill_(0.02)
    layer.method.init_buffers(layer)
    return layer


@pytest.mark.parametrize("scheme", [DYNAMIC, STATIC], ids=["dynamic", "static"])
@pytest.mark.parametrize("path", [linear.WEIGHT_ONLY, linear.W8A8, linear.SCALED_MM])
def test_each_path_computes_its_reference(path, scheme):
    gen = torch.Generator().manual_seed(7)
    layer = _layer(scheme, 96, 256, gen)
    x = torch.randn(5, 256, generator=gen)
    static = layer.input_scale if scheme.activations == "static" else None
    if path == linear.WEIGHT_ONLY:
        want = reference.fp8_linear_weight_only(x, layer.weight, layer.weight_scale, layer.bias)
    else:
        want = reference.fp8_linear_w8a8(x, layer.weight, layer.weight_scale, layer.bias, static)
    with linear.forced_fp8_path(path), kernels.use_kernels(True):  # CPU: Triton's interpreter
        got = layer(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
