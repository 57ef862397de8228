"""Loads a checkpoint into LlamaForCausalLM: a local Hugging Face directory or a GGUF file.

Reads the config (`config.json`, or a GGUF file's metadata), then the checkpoint's files of tensors
(cluster/model/checkpoint.py: `*.safetensors`, sharded or not, or the GGUF file, dequantized), tensor by
tensor, straight into the fused parameters on the target device. Linear layers take their tensors
(weights, biases, FP8 scales) through their own weight loaders (cluster.model.linear); FP8 formats are
described by cluster.model.quantization.

Tensor parallelism (`tp`): each rank reads only its part of every split tensor (safetensors: through
`get_slice`, the file memory-mapped and only the slice's bytes copied; GGUF: sliced after
dequantization); the layer says which part (`checkpoint_index`, cluster/model/parallel_linear.py).
Replicated tensors (embedding, norms) are read whole by every rank.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from cluster.errors import ModelLoadError
from cluster.model.checkpoint import read_config, tensor_files
from cluster.model.config import ModelArchConfig
from cluster.model.linear import Linear
from cluster.model.llama import LlamaForCausalLM
from cluster.model.parallel_linear import ParallelLMHead, TensorParallel
from cluster.model.quantization import QuantConfig

DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    key = name.replace("torch.", "")
    if key not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {name!r}; choose one of {sorted(set(DTYPES))}")
    return DTYPES[key]


def empty_model(cfg: ModelArchConfig, dtype: torch.dtype, device: str | torch.device, attention_backend: str = "torch",
                quant: QuantConfig | None = None, tp: TensorParallel | None = None) -> LlamaForCausalLM:
    """A model with uninitialised weights on `device` (built on the meta device: no init cost). Every
    parameter has its final dtype from construction (e4m3 weights and float32 scales for FP8 layers);
    with `tp`, this rank's part of it."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, attention_backend, dtype, quant, tp)
    # Module.to_empty's empty_like on meta tensors runs torch._refs, which imports sympy and torch.fx's
    # symbolic shapes (~0.4 s of CPU per worker process): the same uninitialised tensors, made directly.
    model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    for m in model.modules():
        if isinstance(m, Linear):
            m.method.init_buffers(m)
    model.tie_weights()  # to_empty breaks the tie; restore it
    model.rotary.build_tables(device, dtype)
    return model.eval().requires_grad_(False)


def random_model(cfg, dtype, device, seed: int = 0, attention_backend: str = "torch",
                 quantization: str | None = None, tp: TensorParallel | None = None) -> LlamaForCausalLM:
    """Random weights on `device` (benchmarks build 1B/8B shapes this way, without a checkpoint). With
    quantization="fp8" each linear weight is drawn in `dtype` and quantized as a checkpoint tensor
    would be at load time (the same draws as the unquantized model's). With `tp`, each rank draws its own
    part (seeded by seed and rank: a timing model, not the TP-1 model's weights)."""
    quant = QuantConfig.online_fp8() if quantization == "fp8" else QuantConfig.from_checkpoint({}, quantization)
    model = empty_model(cfg, dtype, device, attention_backend, quant, tp)
    if tp is not None:
        seed = seed * 1000 + tp.rank
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        module, _, pname = name.rpartition(".")
        if module in linears and pname in ("weight_scale", "input_scale"):
            continue  # filled by the weight's loader (online quantization)
        if module in linears and pname == "weight":
            w = torch.empty(p.shape, dtype=dtype, device=device).normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
            linears[module].load("weight", w, None)
        elif name.endswith("norm.weight"):
            p.fill_(1.0)
        elif p.dim() == 1:
            p.normal_(0.0, 0.02, generator=gen)
        else:
            p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
    model.tie_weights()
    return model


def load_model(
    model_dir: str | Path,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    attention_backend: str = "torch",
    quantization: str | None = None,
    tp: TensorParallel | None = None,
) -> LlamaForCausalLM:
    """Loads a checkpoint; `quantization` is --quantization (None: the checkpoint's own, see
    cluster.model.quantization). `dtype` is the activation dtype (FP8 weights keep theirs). With `tp`,
    this rank's part of the model, reading only its part of each split tensor."""
    model_dir = Path(model_dir)
    cfg = ModelArchConfig.from_dir(model_dir)
    config, config_path = read_config(model_dir)
    quant = QuantConfig.from_checkpoint(config, quantization, str(config_path))
    torch_dtype = resolve_dtype(dtype or cfg.dtype)
    model = empty_model(cfg, torch_dtype, device, attention_backend, quant, tp)
    lm_head = model.lm_head if isinstance(model.lm_head, ParallelLMHead) else None
    params = dict(model.named_parameters(remove_duplicate=False))
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    attns = {f"layers.{i}.self_attn": layer.self_attn for i, layer in enumerate(model.layers)}
    # Parameters outside the linears that must be filled; each Linear tracks its own (Linear.missing).
    pending = {n for n in params if n.rpartition(".")[0] not in linears}
    if cfg.tie_word_embeddings:
        pending.discard("lm_head.weight")
    for tensor_file in tensor_files(model_dir):
        with tensor_file as f:
            for name in f.keys():
                target = _map_name(name, cfg)
                if target is None:
                    continue
                pname, shard = target
                module, _, leaf = pname.rpartition(".")
                if module in linears:
                    lin = linears[module]
                    try:
                        index = lin.checkpoint_index(leaf, shard, f.shape(name))
                        lin.load(leaf, None if index is None else f.read(name, index), shard)
                    except ModelLoadError as e:
                        raise ModelLoadError(f"tensor {name!r} in {f.name}: {e}") from None
                elif lm_head is not None and pname == "lm_head.weight":
                    try:
                        lm_head.load(f.read(name, lm_head.checkpoint_index(f.shape(name))))
                    except ModelLoadError as e:
                        raise ModelLoadError(f"tensor {name!r} in {f.name}: {e}") from None
                    pending.discard(pname)
                elif module in attns and leaf in ("k_scale", "v_scale"):
                    if not quant.kv_cache_scales:
                        raise ModelLoadError(f"unexpected tensor {name!r} in {f.name}: k/v scales without "
                                             "a kv_cache_scheme in quantization_config")
                    setattr(attns[module], leaf, _scalar(f.read(name), name))
                elif pname in params:
                    dst = params[pname]
                    if tuple(dst.shape) != f.shape(name):
                        raise ModelLoadError(f"tensor {name!r} in {f.name} has shape {f.shape(name)}, "
                                             f"expected {tuple(dst.shape)}")
                    tensor = f.read(name)
                    if tensor.dtype == torch.float8_e4m3fn:
                        raise ModelLoadError(f"tensor {name!r} in {f.name} is FP8 but its module is not "
                                             f"quantized by the checkpoint's quantization_config")
                    dst.copy_(tensor.to(torch_dtype))
                    pending.discard(pname)
                else:
                    raise ModelLoadError(f"unexpected tensor {name!r} in {f.name}")
    missing = sorted(pending) + sorted(f"{m}.{p}" for m, lin in linears.items() for p, _ in lin.missing())
    if missing:
        raise ModelLoadError(f"checkpoint in {model_dir} lacks weights for: {', '.join(missing[:5])}")
    model.tie_weights()  # a tied, padded LM-head shard is a copy of the embedding's rows: take them now
    return model


def _scalar(t: torch.Tensor, name: str) -> float:
    if t.numel() != 1:
        raise ModelLoadError(f"{name!r} has shape {tuple(t.shape)}, expected one value")
    value = float(t.float().reshape(()))
    if not value > 0 or value == float("inf"):
        raise ModelLoadError(f"{name!r} is {value}, expected a positive finite scale")
    return value


_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", "q"),
    "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
    "self_attn.v_proj": ("self_attn.qkv_proj", "v"),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
# Per-layer k/v scales of an FP8 KV cache: compressed-tensors' names, and older writers' output scales.
_KV_SCALES = {"self_attn.k_scale": "k_scale", "self_attn.v_scale": "v_scale",
              "self_attn.k_proj.output_scale": "k_scale", "self_attn.v_proj.output_scale": "v_scale"}


def _map_name(name: str, cfg: ModelArchConfig) -> tuple[str, str | int | None] | None:
    """Checkpoint tensor name -> (our parameter name, part of a fused layer), None to skip. Scale
    tensors map like weights: q_proj.weight_scale -> (layers.i.self_attn.qkv_proj.weight_scale, "q");
    HF fp8's weight_scale_inv is our weight_scale."""
    if name == "model.embed_tokens.weight":
        return "embed_tokens.weight", None
    if name == "model.norm.weight":
        return "norm.weight", None
    if name == "lm_head.weight":
        return None if cfg.tie_word_embeddings else ("lm_head.weight", None)
    m = _LAYER.match(name)
    if not m:
        return None
    i, rest = m.group(1), m.group(2)
    if rest.endswith("rotary_emb.inv_freq"):
        return None
    if rest in _KV_SCALES:
        return f"layers.{i}.self_attn.{_KV_SCALES[rest]}", None
    module, _, kind = rest.rpartition(".")
    if kind == "weight_scale_inv":
        kind = "weight_scale"
    if module in _FUSED:
        target, shard = _FUSED[module]
        return f"layers.{i}.{target}.{kind}", shard
    return f"layers.{i}.{module}.{kind}", None
