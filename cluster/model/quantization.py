"""Which FP8 format each linear layer's weights are in: parsed once from `quantization_config` in a
checkpoint's config.json, or asked for with `--quantization fp8` (quantize a float checkpoint at load).

Three sources, one description (`Fp8Scheme`) per linear layer:

- compressed-tensors (`quant_method: compressed-tensors`, what llm-compressor writes: the `*-FP8` and
  `*-FP8-dynamic` repositories): `config_groups` of {targets, weights, input_activations}, an `ignore`
  list, optionally a `kv_cache_scheme`. On disk, per quantized linear: `weight` (float8_e4m3fn),
  `weight_scale` (float32, `[out, 1]` per channel or `[1]` per tensor, `[out/bn, in/bk]` per block),
  `input_scale` (`[1]`) when activations are static; with a kv_cache_scheme `self_attn.k_scale` and
  `self_attn.v_scale` (older writers: `k_proj.output_scale` / `v_proj.output_scale`).
- Hugging Face's `quant_method: fp8` (transformers' FineGrainedFP8, DeepSeek-V3 style): `weight` in
  e4m3 with `weight_scale_inv` per 128 x 128 block (a multiplier, despite the name), dynamic
  activations; without `weight_block_size`, vLLM's layout: a per-tensor `weight_scale` and, for static
  activations, `input_scale`. `modules_to_not_convert` stays in the checkpoint's dtype.
- `--quantization fp8` on a float checkpoint: per-output-channel e4m3 scales computed at load time
  (amax / 448 of each row), dynamic per-token activation scales.

Everything else (another quant_method, an integer or 4-bit scheme, group-wise weights, output
activations, sparsity, transforms, asymmetric scales) is a ModelLoadError naming what was found; a
checkpoint is never loaded as if it were bf16.

How a scheme is computed (weight-only in registers at small batch, W8A8 on FP8 tensor cores at large
batch and in prefill) is `cluster.model.linear`'s concern; this module only describes formats.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

from cluster.errors import ModelLoadError

FP8_MAX = 448.0  # largest finite float8_e4m3fn
SUPPORTED_QUANTIZATION = ("fp8",)  # values of --quantization
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # values of --kv-cache-dtype (vLLM's spellings)


@dataclass(frozen=True)
class Fp8Scheme:
    """The FP8 format of one linear layer's weights and activations."""

    weight_strategy: str  # "tensor" | "channel" | "block"
    # "none": weight-only (bf16 activations); "dynamic": per-token scales computed at run time;
    # "static": one per-tensor scale from the checkpoint (`input_scale`).
    activations: str
    block: tuple[int, int] | None = None  # (rows, cols) of a weight-scale block, "block" strategy only
    online: bool = False  # quantized at load time from a float checkpoint (no scales on disk)
    scale_name: str = "weight_scale"  # the scale tensor's name on disk ("weight_scale_inv" for HF blocks)

    def __post_init__(self):
        assert self.weight_strategy in ("tensor", "channel", "block")
        assert self.activations in ("none", "dynamic", "static")
        assert (self.block is not None) == (self.weight_strategy == "block")


@dataclass(frozen=True)
class QuantConfig:
    """The model's quantization: `method` names the source ("none", "fp8" for load-time quantization,
    "compressed-tensors", "hf-fp8"); `groups` maps module-name targets to schemes, first match wins;
    `ignore` lists modules kept in the checkpoint's dtype."""

    method: str = "none"
    groups: tuple[tuple[tuple[str, ...], Fp8Scheme], ...] = ()
    ignore: tuple[str, ...] = ()
    kv_cache_scales: bool = False  # the checkpoint carries per-layer k/v scales for an FP8 KV cache

    @property
    def quantized(self) -> bool:
        return self.method != "none"

    @property
    def tag(self) -> str:
        """A short name for logs, benchmark rows and the prefix-cache salt (different numerics, different KV)."""
        if not self.quantized:
            return "none"
        kinds = sorted({f"{s.weight_strategy}/{s.activations}" for _, s in self.groups})
        return f"{self.method}:{','.join(kinds)}"

    def scheme_for(self, module_names: Sequence[str]) -> Fp8Scheme | None:
        """The scheme of a layer that fuses the checkpoint modules `module_names` (Hugging Face names,
        e.g. model.layers.0.self_attn.q_proj, .k_proj, .v_proj for our qkv_proj); None: unquantized.
        The fused parts must agree: one matmul runs them."""
        found = {name: self._scheme_of(name) for name in module_names}
        distinct = set(found.values())
        if len(distinct) > 1:
            parts = ", ".join(f"{n}: {_describe(s)}" for n, s in found.items())
            raise ModelLoadError(f"modules fused into one matmul are quantized differently ({parts}); "
                                 "pdserve needs one scheme for q/k/v and for gate/up")
        return distinct.pop()

    def _scheme_of(self, name: str) -> Fp8Scheme | None:
        if not self.quantized or any(_matches(pattern, name) for pattern in self.ignore):
            return None
        for targets, scheme in self.groups:
            if any(_matches(t, name) for t in targets):
                return scheme
        return None

    # -- construction ------------------------------------------------------------------------------
    @classmethod
    def online_fp8(cls) -> "QuantConfig":
        """`--quantization fp8`: every decoder linear, per-output-channel weight scales computed at load,
        dynamic per-token activation scales. The LM head stays in the model's dtype (as vLLM's)."""
        return cls("fp8", ((("Linear",), Fp8Scheme("channel", "dynamic", online=True)),), ignore=("lm_head",))

    @classmethod
    def from_checkpoint(cls, config: dict[str, Any], quantization: str | None = None,
                        source: str = "config.json") -> "QuantConfig":
        """The quantization of a checkpoint (its config.json as a dict), with `quantization` the
        user's `--quantization` (None: the checkpoint's own)."""
        if quantization is not None and quantization not in SUPPORTED_QUANTIZATION:
            raise ModelLoadError(f"unsupported quantization {quantization!r}; supported: {SUPPORTED_QUANTIZATION}")
        qc = config.get("quantization_config")
        if qc is None:
            return cls.online_fp8() if quantization == "fp8" else cls()
        if not isinstance(qc, dict):
            raise ModelLoadError(f"quantization_config in {source} is not an object")
        method = qc.get("quant_method")
        if method == "fp8":
            return _parse_hf_fp8(qc, source)
        if quantization is not None:
            raise ModelLoadError(f"--quantization {quantization} asks to quantize a checkpoint that is already "
                                 f"quantized (quant_method {method!r} in {source}); leave --quantization out")
        if method == "compressed-tensors":
            return _parse_compressed_tensors(qc, source)
        raise ModelLoadError(f"unsupported quantization_config.quant_method {method!r} in {source}; pdserve loads "
                             "FP8 checkpoints only: 'compressed-tensors' (FP8) and 'fp8'")


def _matches(pattern: str, name: str) -> bool:
    """compressed-tensors' target matching: 're:<regex>' matched from the start of the module name, the
    class name 'Linear' (every linear layer: all our names are linears), or the exact name / its last
    component (as `ignore: ["lm_head"]` is written)."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == "Linear" or pattern == name or name.endswith("." + pattern)


def _describe(s: Fp8Scheme | None) -> str:
    return "unquantized" if s is None else f"fp8 {s.weight_strategy} weights, {s.activations} activations"


# -- compressed-tensors --------------------------------------------------------------------------
_CT_FORMATS = ("float-quantized", "naive-quantized")


def _parse_compressed_tensors(qc: dict, source: str) -> QuantConfig:
    where = f"quantization_config in {source}"
    fmt = qc.get("format")
    if fmt not in _CT_FORMATS:
        raise ModelLoadError(f"unsupported compressed-tensors format {fmt!r} ({where}); supported: {_CT_FORMATS}")
    if qc.get("quantization_status", "compressed") != "compressed":
        raise ModelLoadError(f"compressed-tensors quantization_status {qc.get('quantization_status')!r} ({where}); "
                             "only 'compressed' checkpoints (weights stored in FP8) load")
    for key in ("sparsity_config", "transform_config"):
        if qc.get(key):
            raise ModelLoadError(f"compressed-tensors {key} is not supported ({where}): {qc[key]!r}")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ModelLoadError(f"compressed-tensors config without config_groups ({where})")
    parsed = []
    for name, g in groups.items():
        gwhere = f"config_groups.{name} of {where}"
        if g.get("format") not in (None, *_CT_FORMATS):
            raise ModelLoadError(f"unsupported compressed-tensors format {g['format']!r} in {gwhere}")
        if g.get("output_activations"):
            raise ModelLoadError(f"output_activations quantization is not supported ({gwhere})")
        targets = g.get("targets") or []
        if isinstance(targets, str):
            targets = [targets]
        if not targets:
            raise ModelLoadError(f"no targets in {gwhere}")
        w = g.get("weights")
        if not w:
            raise ModelLoadError(f"{gwhere} quantizes no weights; only FP8 weight schemes are supported")
        strategy, block = _ct_weight_args(w, gwhere)
        acts = _ct_activation_args(g.get("input_activations"), strategy, gwhere)
        parsed.append((tuple(targets), Fp8Scheme(strategy, acts, block)))
    kv = qc.get("kv_cache_scheme")
    if kv:
        _ct_check_float8(kv, f"kv_cache_scheme of {where}")
        if kv.get("strategy", "tensor") != "tensor" or kv.get("dynamic"):
            raise ModelLoadError(f"kv_cache_scheme {kv.get('strategy')!r}/dynamic={kv.get('dynamic')} is not "
                                 f"supported ({where}); only static per-tensor k/v scales")
    return QuantConfig("compressed-tensors", tuple(parsed), tuple(qc.get("ignore") or ()), kv_cache_scales=bool(kv))


def _ct_check_float8(args: dict, where: str) -> None:
    if args.get("num_bits") != 8 or args.get("type") != "float":
        raise ModelLoadError(f"unsupported quantization {args.get('type')!r} with num_bits={args.get('num_bits')} "
                             f"({where}); pdserve supports FP8 (num_bits 8, type float) only")
    if args.get("symmetric") is False:
        raise ModelLoadError(f"asymmetric FP8 quantization (zero points) is not supported ({where})")


def _ct_weight_args(w: dict, where: str) -> tuple[str, tuple[int, int] | None]:
    _ct_check_float8(w, f"weights of {where}")
    strategy = w.get("strategy")
    if w.get("dynamic"):
        raise ModelLoadError(f"dynamic weight quantization is not supported ({where})")
    if strategy in ("tensor", "channel"):
        return strategy, None
    if strategy == "block":
        block = tuple(w.get("block_structure") or ())
        if block != (128, 128):
            raise ModelLoadError(f"FP8 block_structure {list(block)} is not supported ({where}); only [128, 128]")
        return "block", (128, 128)
    raise ModelLoadError(f"FP8 weight strategy {strategy!r} is not supported ({where}); "
                         "supported: 'tensor', 'channel', 'block'")


def _ct_activation_args(a: dict | None, weight_strategy: str, where: str) -> str:
    if not a:
        return "none"
    _ct_check_float8(a, f"input_activations of {where}")
    strategy, dynamic = a.get("strategy"), bool(a.get("dynamic"))
    if weight_strategy == "block":
        # FP8_BLOCK's per-token-group (1 x 128) dynamic activations. NOTE: block-scaled weights run
        # weight-only at every batch size (bf16 activations, never quantized): more precise than the
        # checkpoint asks, at the bf16 GEMM rate in prefill (a block-scaled W8A8 GEMM is future work).
        if strategy == "group" and dynamic and a.get("group_size") == 128:
            return "dynamic"
        raise ModelLoadError(f"activations {strategy!r}/dynamic={dynamic} with block-scaled weights are not "
                             f"supported ({where}); only dynamic groups of 128")
    if strategy == "token" and dynamic:
        return "dynamic"
    if strategy == "tensor" and not dynamic:
        return "static"
    raise ModelLoadError(f"FP8 activation strategy {strategy!r} with dynamic={dynamic} is not supported ({where}); "
                         "supported: dynamic per-token, static per-tensor")


# -- Hugging Face fp8 ----------------------------------------------------------------------------
def _parse_hf_fp8(qc: dict, source: str) -> QuantConfig:
    where = f"quantization_config in {source}"
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ModelLoadError(f"fp8 fmt {fmt!r} is not supported ({where}); only 'e4m3'")
    acts = qc.get("activation_scheme", "dynamic")
    if acts not in ("dynamic", "static"):
        raise ModelLoadError(f"fp8 activation_scheme {acts!r} is not supported ({where})")
    block = qc.get("weight_block_size")
    ignore = tuple(qc.get("modules_to_not_convert") or ()) + ("lm_head",)
    if block is None:  # vLLM's fp8 layout: per-tensor weight_scale (+ input_scale when static)
        return QuantConfig("hf-fp8", ((("Linear",), Fp8Scheme("tensor", acts)),), ignore)
    if tuple(block) != (128, 128):
        raise ModelLoadError(f"fp8 weight_block_size {list(block)} is not supported ({where}); only [128, 128]")
    if acts != "dynamic":
        raise ModelLoadError(f"fp8 block-wise weights with activation_scheme {acts!r} are not supported ({where})")
    scheme = Fp8Scheme("block", "dynamic", (128, 128), scale_name="weight_scale_inv")
    return QuantConfig("hf-fp8", ((("Linear",), scheme),), ignore)
