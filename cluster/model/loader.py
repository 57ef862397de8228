"""Loads a local Hugging Face checkpoint directory into LlamaForCausalLM.

Reads `config.json`, then either `model.safetensors.index.json` (sharded) or the `*.safetensors`
files beside it, tensor by tensor, straight into the fused parameters on the target device.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from cluster.errors import ModelLoadError
from cluster.model.config import ModelArchConfig
from cluster.model.llama import LlamaForCausalLM

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


def empty_model(cfg: ModelArchConfig, dtype: torch.dtype, device: str | torch.device, attention_backend: str = "torch"):
    """A model with uninitialised weights on `device` (built on the meta device: no init cost)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, attention_backend)
    model = model.to(dtype).to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty breaks the tie; restore it
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary.build_tables(device, dtype)
    return model.eval().requires_grad_(False)


def random_model(cfg, dtype, device, seed: int = 0, attention_backend: str = "torch") -> LlamaForCausalLM:
    """Random weights on `device` (benchmarks build 1B/8B shapes this way, without a checkpoint)."""
    model = empty_model(cfg, dtype, device, attention_backend)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif p.dim() == 1:
            p.normal_(0.0, 0.02, generator=gen)
        else:
            p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
    return model


def _checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({model_dir / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"shard {f.name} named in {index.name} is missing from {model_dir}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {model_dir} (only safetensors checkpoints are supported)")
    return files


def load_model(
    model_dir: str | Path,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    attention_backend: str = "torch",
) -> LlamaForCausalLM:
    model_dir = Path(model_dir)
    cfg = ModelArchConfig.from_dir(model_dir)
    torch_dtype = resolve_dtype(dtype or cfg.dtype)
    model = empty_model(cfg, torch_dtype, device, attention_backend)
    params = dict(model.named_parameters(remove_duplicate=False))
    # Every (param, row-slice) that must be filled; a checkpoint that leaves one out is an error.
    pending = _expected_slices(cfg)
    for path in _checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                target = _map_name(name, cfg)
                if target is None:
                    continue
                pname, rows = target
                if pname not in params:
                    raise ModelLoadError(f"unexpected tensor {name!r} in {path.name}")
                dst = params[pname]
                tensor = f.get_tensor(name)
                view = dst if rows is None else dst[rows[0] : rows[1]]
                if tuple(view.shape) != tuple(tensor.shape):
                    raise ModelLoadError(
                        f"tensor {name!r} in {path.name} has shape {tuple(tensor.shape)}, expected {tuple(view.shape)}"
                    )
                view.copy_(tensor.to(torch_dtype))
                pending.discard((pname, rows))
    if cfg.tie_word_embeddings:
        pending.discard(("lm_head.weight", None))
    if pending:
        missing = sorted(p for p, _ in pending)
        raise ModelLoadError(f"checkpoint in {model_dir} lacks weights for: {', '.join(missing[:5])}")
    return model


def _map_name(name: str, cfg: ModelArchConfig) -> tuple[str, tuple[int, int] | None] | None:
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
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    fused = {
        "self_attn.q_proj": ("self_attn.qkv_proj", (0, q)),
        "self_attn.k_proj": ("self_attn.qkv_proj", (q, q + kv)),
        "self_attn.v_proj": ("self_attn.qkv_proj", (q + kv, q + 2 * kv)),
        "mlp.gate_proj": ("mlp.gate_up_proj", (0, inter)),
        "mlp.up_proj": ("mlp.gate_up_proj", (inter, 2 * inter)),
    }
    module, _, kind = rest.rpartition(".")
    if module in fused:
        target, rows = fused[module]
        return f"layers.{i}.{target}.{kind}", rows
    return f"layers.{i}.{rest}", None


def _expected_slices(cfg: ModelArchConfig) -> set[tuple[str, tuple[int, int] | None]]:
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    per_layer = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                 "input_layernorm.weight", "post_attention_layernorm.weight"]
    if cfg.attention_bias:
        per_layer += ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
    for i in range(cfg.num_layers):
        names += [f"model.layers.{i}.{n}" for n in per_layer]
    out = set()
    for n in names:
        t = _map_name(n, cfg)
        if t is not None:
            out.add(t)
    if cfg.tie_word_embeddings:
        out.add(("lm_head.weight", None))
    return out
