"""FP8 checkpoints written in tests, from a float Hugging Face checkpoint directory.

- `write_compressed_tensors`: by the compressed-tensors library itself, as llm-compressor drives it
  (apply_quantization_config, the library's calculate_qparams on each weight's min/max, input scales
  from a calibration pass over a few prompts for static activations, ModelCompressor.compress_model,
  save_pretrained, update_config). With `kv_scales`, the k/v scales are added by hand in the format
  llm-compressor writes (`model.layers.N.self_attn.k_scale` / `v_scale`, one float32 value each, and a
  `kv_cache_scheme` in quantization_config): compressed-tensors 0.20 finds no cached attention module
  in transformers 5's Llama (its forward takes `cache`, not `past_key_values`), so it cannot write them.
- `write_hf_fp8_block`: transformers' FineGrainedFP8 format by hand: e4m3 `weight` and float32
  `weight_scale_inv` per 128 x 128 block (a multiplier), `quant_method: fp8` with weight_block_size.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch


def _copy_tokenizer(src: Path, out: Path) -> None:
    for f in src.iterdir():
        if "token" in f.name or f.name.endswith(".jinja") or f.name == "generation_config.json":
            shutil.copy(f, out / f.name)


def _hf_model(src: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()


def write_compressed_tensors(src: Path, out: Path, preset: str = "FP8_DYNAMIC", weights_only: bool = False,
                             kv_scales: dict[int, tuple[float, float]] | None = None) -> Path:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, apply_quantization_config
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    model = _hf_model(src)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if weights_only:
        scheme = QuantizationScheme(targets=["Linear"], weights=scheme.weights)
    # Calibration: each linear's input amax over a few prompts (static activation scales).
    amax: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_pre_hook(lambda mod, args, name=name: amax.__setitem__(
        name, torch.maximum(amax.get(name, torch.zeros(())), args[0].abs().amax())))
        for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        model(torch.arange(5, 69).view(2, 32))
    for h in hooks:
        h.remove()
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    with torch.no_grad():
        for name, m in model.named_modules():
            s = getattr(m, "quantization_scheme", None)
            if s is None or not hasattr(m, "weight_scale"):
                continue
            w = m.weight.data
            if s.weights.strategy == "channel":
                lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
            elif s.weights.strategy == "block":
                bn, bk = s.weights.block_structure
                n, k = w.shape
                pad = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk)  # as the library pads ragged blocks
                pad[:n, :k] = w
                t = pad.view(pad.shape[0] // bn, bn, pad.shape[1] // bk, bk)
                lo, hi = t.amin(dim=(1, 3)), t.amax(dim=(1, 3))
            else:
                lo, hi = w.amin().reshape(1), w.amax().reshape(1)
            scale, _ = calculate_qparams(lo, hi, s.weights)
            m.weight_scale.data.copy_(scale.reshape(m.weight_scale.shape))
            if hasattr(m, "input_scale"):
                m.input_scale.data.fill_(float(amax[name]) / 448.0)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    _copy_tokenizer(src, out)
    if kv_scales:
        _add_kv_scales(out, kv_scales)
    return out


def _add_kv_scales(out: Path, kv_scales: dict[int, tuple[float, float]]) -> None:
    from safetensors.torch import load_file, save_file

    path = out / "model.safetensors"
    tensors = load_file(path)
    for layer, (k, v) in kv_scales.items():
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(k, dtype=torch.float32)
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(v, dtype=torch.float32)
    save_file(tensors, path, metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "symmetric": True,
                                                     "strategy": "tensor", "dynamic": False}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


def block_quantize(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (e4m3 [N, K], float32 scales [ceil(N/b), ceil(K/b)]): each block's amax / 448."""
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    pad = torch.zeros(nb * block, kb * block)
    pad[:n, :k] = w.float()
    scale = (pad.view(nb, block, kb, block).abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)
    full = scale.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return (w.float() / full).clamp(-448, 448).to(torch.float8_e4m3fn), scale


def write_hf_fp8_block(src: Path, out: Path, not_converted: tuple[str, ...] = ()) -> Path:
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    written = {}
    for name, t in tensors.items():
        module = name.rpartition(".")[0]
        if name.endswith("proj.weight") and module not in not_converted:
            q, s = block_quantize(t)
            written[name], written[module + ".weight_scale_inv"] = q, s
        else:
            written[name] = t
    save_file(written, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                  "weight_block_size": [128, 128], "modules_to_not_convert": list(not_converted)}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    _copy_tokenizer(src, out)
    return out


def write_float_llama(src_tokenizer: Path, out: Path, seed: int = 0, **shape) -> Path:
    """A random float32 Llama checkpoint (written by transformers) with the demo tokenizer; peaked
    weights as the demo's, so greedy decoding has clear margins."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=512, bos_token_id=0, eos_token_id=1, max_position_embeddings=2048,
                      tie_word_embeddings=False, **shape)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "embed_tokens" in name or "lm_head" in name:
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 1.5 / p.shape[-1] ** 0.5)
    model.save_pretrained(out)
    _copy_tokenizer(src_tokenizer, out)
    return out
