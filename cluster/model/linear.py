"""The model's linear layers: `Linear` owns its parameters and how each checkpoint tensor lands in them;
a `LinearMethod` decides what the parameters are and how the matmul runs.

- `UnquantizedLinearMethod`: a weight in the model's dtype, `F.linear` (what nn.Linear does).
- `Fp8LinearMethod`: an e4m3 weight with float32 scales (per output channel, or per 128 x 128 block)
  and, for static activations, the checkpoint's `input_scale`. Three ways to run it, chosen on the host
  from the shape and the number of rows (static under CUDA-graph capture; `fp8_path` is the one rule):
    * "weight_only", `fp8_gemm.fp8_gemm`: the e4m3 weight is read once and widened in registers against
      bf16 activations; decode is memory-bound, so this is where FP8 halves the step. Block-scaled
      weights and weight-only checkpoints always run this way.
    * "w8a8", `fp8_gemm.fp8_gemm_w8a8`: activations quantized per token (`fp8_quant.py`, or with the
      static input_scale), e4m3 x e4m3 on the FP8 tensor cores in our Triton kernel.
    * "scaled_mm": the same quantization and `torch._scaled_mm` (cuBLASLt FP8) with row-wise scales.
  The choice comes from the table benchmarks/tune_fp8_gemm.py measured (cluster/kernels/
  fp8_gemm_configs.json, per (N, K, M bucket)); a shape it lacks runs weight-only up to
  FP8_GEMV_MAX_M rows and `_scaled_mm` above (`_scaled_mm` reads weights at 0.95-2.36 TB/s at M <= 64
  on an H200, issue 27). The two W8A8 paths are the same math; weight-only differs (activations
  unquantized), so where the tuned table switches paths, the numerics switch with it.
  On CPU (and without Triton) both are their torch references in cluster/kernels/reference.py.

Weight loading (as vLLM's): each parameter has a weight loader, `Linear.load(name, tensor, shard)`
calls it, where `shard` names the part of a fused layer the checkpoint tensor fills ("q"/"k"/"v" of
qkv_proj, 0/1 of gate_up_proj, None for all of it). The model loader never touches a parameter
itself: before reading a tensor it asks `Linear.checkpoint_index(name, shard, shape)` which part of it
this layer needs (all of it here; the tensor-parallel subclasses of cluster/model/parallel_linear.py
return their rank's rows or columns, scales included, and the loader reads only those bytes), so the
FP8 math never knows about tensor parallelism. `LinearMethod.granularity` says how a parameter's
checkpoint tensor maps onto the weight's rows and columns (a block scale covers 128 x 128).
`Linear.expected()` lists the (parameter, shard) pairs a checkpoint must provide. Loaders are kept by
parameter name, not on the parameter: materialising a meta-device model (`to_empty`) replaces the
parameter objects.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import contextmanager
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from cluster import kernels
from cluster.errors import ModelLoadError
from cluster.kernels import fp8_gemm_configs, reference
from cluster.kernels.reference import FP8, FP8_MAX
from cluster.model.quantization import Fp8Scheme

# Shapes the tuned table lacks: weight-only up to this many rows, W8A8 through torch._scaled_mm above.
FP8_GEMV_MAX_M = 64
WEIGHT_ONLY, W8A8, SCALED_MM = fp8_gemm_configs.PATHS
_forced_path: str | None = None


def fp8_path(scheme: Fp8Scheme, num_rows: int, n: int, k: int, device: torch.device) -> str:
    """THE dispatch rule: which FP8 path a [num_rows, k] x [n, k]^T product takes (host-side, from
    shapes only: static per CUDA-graph bucket)."""
    if scheme.activations == "none" or scheme.weight_strategy == "block":
        return WEIGHT_ONLY  # nothing allows quantizing the activations (W8A8 is per-channel only)
    if _forced_path is not None:
        return _forced_path
    tuned = fp8_gemm_configs.tuned_path(n, k, num_rows, device)
    if tuned is not None:
        return tuned
    return SCALED_MM if num_rows > FP8_GEMV_MAX_M else WEIGHT_ONLY


@contextmanager
def forced_fp8_path(path: str | None):
    """Every FP8 linear that may quantize its activations takes `path` (benchmarks and tests comparing
    the paths); None: the rule above."""
    global _forced_path
    assert path is None or path in fp8_gemm_configs.PATHS
    before, _forced_path = _forced_path, path
    try:
        yield
    finally:
        _forced_path = before


class Linear(nn.Module):
    """y = x W^T (+ b) for W of [sum(output_sizes), input_size]; `output_sizes` are the fused parts
    (q, k, v or gate, up) in order, named by `shard_ids`."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool, method: "LinearMethod",
                 dtype: torch.dtype, shard_ids: Sequence[str | int] | None = None):
        super().__init__()
        self.input_size = input_size
        self.output_sizes = tuple(output_sizes)
        self.output_size = sum(self.output_sizes)
        self.shard_ids = tuple(shard_ids) if shard_ids is not None else (None,)
        assert len(self.shard_ids) == len(self.output_sizes) or self.shard_ids == (None,)
        self.method = method
        self.params_dtype = dtype
        self._expected: list[tuple[str, str | int | None]] = []
        self._loaders: dict[str, Callable] = {}
        self._loaded: set[tuple[str, str | int | None]] = set()  # host-side bookkeeping, kept by to_empty
        method.create_weights(self, dtype)
        if bias:
            self.add_param("bias", torch.empty(self.output_size, dtype=dtype), Linear.load_rows)
        else:
            self.register_parameter("bias", None)

    # -- parameters and their loaders -------------------------------------------------------------
    def add_param(self, name: str, value: torch.Tensor, loader: Callable, from_checkpoint: bool = True):
        """Registers a parameter and its loader `loader(layer, param, tensor, shard)`; with
        from_checkpoint, every shard of it must be loaded."""
        self.register_parameter(name, nn.Parameter(value, requires_grad=False))
        self._loaders[name] = loader
        if from_checkpoint:
            self._expected += [(name, s) for s in self.shard_ids]

    def load(self, name: str, t: torch.Tensor, shard: str | int | None) -> None:
        """Fills parameter `name` (or its shard's part of it) from a checkpoint tensor."""
        if name not in self._loaders:
            raise ModelLoadError(f"unexpected tensor {name!r} for a {type(self.method).__name__} layer")
        self._loaders[name](self, getattr(self, name), t, shard)
        self._loaded.add((name, shard))

    def missing(self) -> list[tuple[str, str | int | None]]:
        """Expected (parameter, shard) pairs not loaded yet."""
        return [e for e in self._expected if e not in self._loaded]

    def expected(self) -> list[tuple[str, str | int | None]]:
        """(parameter name, shard) pairs a checkpoint must fill."""
        return list(self._expected)

    def granularity(self, name: str) -> tuple[int | None, int | None]:
        """(weight rows, weight columns) one element of parameter `name`'s checkpoint tensor covers along
        its dims 0 and 1; None where the tensor does not follow the weight's rows / columns."""
        if name == "bias":
            return 1, None
        return self.method.granularity(name)

    def checkpoint_index(self, name: str, shard: str | int | None, shape: tuple[int, ...]) -> tuple[slice, ...] | None:
        """The part of checkpoint tensor `name` (of `shape`, for fused part `shard`) this layer loads, as
        one slice per dimension; None: none of it (the loader reads nothing). Here: all of it."""
        return tuple(slice(None) for _ in shape)

    def shard_rows(self, shard: str | int | None) -> tuple[int, int]:
        """Output rows [start, end) of one fused part (None: all rows)."""
        if shard is None:
            return 0, self.output_size
        i = self.shard_ids.index(shard)
        start = sum(self.output_sizes[:i])
        return start, start + self.output_sizes[i]

    def load_rows(self, param: nn.Parameter, t: torch.Tensor, shard) -> None:  # a loader
        """Copies a checkpoint tensor into the rows of `param` its shard covers (weights, biases,
        per-channel scales stored as [n] or [n, 1])."""
        lo, hi = self.shard_rows(shard)
        dst = param.data[lo:hi]
        if t.dim() == dst.dim() + 1 and t.shape[-1] == 1:
            t = t.squeeze(-1)
        _check_shape(t, dst.shape, shard)
        dst.copy_(t.to(dst.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_sizes}, method={type(self.method).__name__}"


def _check_shape(t: torch.Tensor, shape, shard) -> None:
    if tuple(t.shape) != tuple(shape):
        where = "" if shard is None else f" (part {shard!r} of a fused layer)"
        raise ModelLoadError(f"tensor has shape {tuple(t.shape)}{where}, expected {tuple(shape)}")


class LinearMethod(ABC):
    @abstractmethod
    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None:
        """Registers the layer's parameters (uninitialised, any device) with their loaders."""

    @abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """[M, input_size] -> [M, output_size] in x's dtype. No host sync (runs under graph capture)."""

    def init_buffers(self, layer: Linear) -> None:
        """Called once the layer is materialised on its device (before any weight loads)."""

    def granularity(self, name: str) -> tuple[int | None, int | None]:
        """See Linear.granularity: the weight maps one to one."""
        return (1, 1) if name == "weight" else (None, None)


class UnquantizedLinearMethod(LinearMethod):
    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None:
        layer.add_param("weight", torch.empty(layer.output_size, layer.input_size, dtype=dtype), Linear.load_rows)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


class Fp8LinearMethod(LinearMethod):
    """e4m3 weights [N, K] + float32 `weight_scale`: [N] (per-tensor checkpoints too: each fused part's
    scale fills its rows, so q/k/v with different scales stay exact) or [ceil(N/128), ceil(K/128)]
    per block; `input_scale` [1] for static activations (the maximum over fused parts)."""

    def __init__(self, scheme: Fp8Scheme):
        self.scheme = scheme

    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None:
        s = self.scheme
        n, k = layer.output_size, layer.input_size
        loader = self._quantize_rows if s.online else Linear.load_rows
        layer.add_param("weight", torch.empty(n, k, dtype=FP8), loader)
        if s.weight_strategy == "block":
            bn, bk = s.block
            if layer.shard_ids != (None,) and any(size % bn for size in layer.output_sizes[:-1]):
                raise ModelLoadError(f"block-scaled FP8 needs fused parts of a multiple of {bn} rows, got "
                                     f"{layer.output_sizes}")
            scale = torch.empty(-(-n // bn), -(-k // bk), dtype=torch.float32)
            layer.add_param("weight_scale", scale, self._load_block_scale)
        else:
            loader = self._load_tensor_scale if s.weight_strategy == "tensor" else Linear.load_rows
            layer.add_param("weight_scale", torch.empty(n, dtype=torch.float32), loader, from_checkpoint=not s.online)
        if s.activations == "static":
            layer.add_param("input_scale", torch.zeros(1, dtype=torch.float32), self._load_input_scale)

    def init_buffers(self, layer: Linear) -> None:
        from cluster.kernels.fp8_gemm import make_locks

        # The split-K kernel's per-tile counters: zero, and left zero by every launch.
        layer.register_buffer("gemm_locks", make_locks(layer.output_size, layer.weight.device), persistent=False)

    def granularity(self, name: str) -> tuple[int | None, int | None]:
        if name == "weight":
            return 1, 1
        if name == "weight_scale":
            # A block scale covers block[0] x block[1] of the weight; a channel scale one row ([N] or
            # [N, 1] on disk); a per-tensor scale is one value per fused part (never split).
            return self.scheme.block if self.scheme.weight_strategy == "block" else (1, None)
        return None, None  # input_scale: one value

    # -- loaders ---------------------------------------------------------------------------------
    def _quantize_rows(self, layer: Linear, param, t: torch.Tensor, shard) -> None:
        """--quantization fp8: a float checkpoint tensor -> e4m3 rows and their per-row scales."""
        lo, hi = layer.shard_rows(shard)
        _check_shape(t, param.data[lo:hi].shape, shard)
        q, scale = quantize_weight_per_channel(t.to(param.device))
        param.data[lo:hi].copy_(q)
        layer.weight_scale.data[lo:hi].copy_(scale)

    def _load_tensor_scale(self, layer: Linear, param, t: torch.Tensor, shard) -> None:
        lo, hi = layer.shard_rows(shard)
        if t.numel() != 1:
            raise ModelLoadError(f"per-tensor weight_scale of shape {tuple(t.shape)}, expected one value")
        param.data[lo:hi] = t.reshape(()).float()

    def _load_block_scale(self, layer: Linear, param, t: torch.Tensor, shard) -> None:
        lo, hi = layer.shard_rows(shard)
        bn = self.scheme.block[0]
        dst = param.data[lo // bn : -(-hi // bn)]
        _check_shape(t, dst.shape, shard)
        dst.copy_(t.float())

    def _load_input_scale(self, layer: Linear, param, t: torch.Tensor, shard) -> None:
        if t.numel() != 1:
            raise ModelLoadError(f"input_scale of shape {tuple(t.shape)}, expected one value")
        # Fused parts share one activation quantization: the largest scale covers each part's range.
        t = t.reshape(1).float().to(param.device)
        first = not any(name == "input_scale" for name, _ in layer._loaded)
        param.data.copy_(t if first else torch.maximum(param.data, t))

    # -- the matmul ------------------------------------------------------------------------------
    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        s = self.scheme
        path = fp8_path(s, x.shape[0], layer.output_size, layer.input_size, x.device)
        if path == WEIGHT_ONLY:
            return fp8_linear_weight_only(x, layer.weight, layer.weight_scale, layer.bias, s.block, layer.gemm_locks)
        return fp8_linear_w8a8(x, layer.weight, layer.weight_scale, layer.bias,
                               layer.input_scale if s.activations == "static" else None, path == SCALED_MM,
                               layer.gemm_locks)


def quantize_weight_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (e4m3 [N, K], float32 scales [N]): each row's amax / 448."""
    amax = w.abs().amax(dim=1).float()
    scale = reference.div_rn(amax, FP8_MAX).clamp(min=reference.FP8_MIN_SCALE)
    return (w.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_linear_weight_only(x, weight, scale, bias, block=None, locks=None, config=None) -> torch.Tensor:
    if kernels.enabled(x):
        from cluster.kernels.fp8_gemm import fp8_gemm

        return fp8_gemm(x, weight, scale, bias, block, locks, config)
    return reference.fp8_linear_weight_only(x, weight, scale, bias, block)


def fp8_linear_w8a8(x, weight, scale, bias, input_scale=None, scaled_mm: bool = True, locks=None,
                    config=None) -> torch.Tensor:
    """W8A8: per-token (or static) e4m3 activations, then torch._scaled_mm or our Triton kernel."""
    if not kernels.enabled(x) or (scaled_mm and not x.is_cuda):  # cuBLASLt's FP8 GEMM is CUDA-only
        return reference.fp8_linear_w8a8(x, weight, scale, bias, input_scale)
    from cluster.kernels.fp8_quant import quantize_per_token

    xq, xs = quantize_per_token(x, input_scale)
    if not scaled_mm:
        from cluster.kernels.fp8_gemm import fp8_gemm_w8a8

        return fp8_gemm_w8a8(xq, xs, weight, scale, bias, x.dtype, locks, config)
    # weight.t() is the column-major [K, N] operand cuBLASLt wants; scales: [M, 1] and [1, N] float32.
    y = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=scale.view(1, -1), out_dtype=x.dtype)
    return y if bias is None else y + bias
