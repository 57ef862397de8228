"""`python -m benchmarks.make_model --shape llama-1b DIR`: a random-weight checkpoint of a real model's shape.

For load tests on a GPU, where what matters is the cost of a decode step (weights read per token,
KV bytes per token, the vocabulary projection), not what the model says. The tokenizer is the demo
model's (a few hundred tokens, see cluster.model.demo); the config's vocabulary is padded to the real
model's size so the embedding and LM-head matmuls have their real shape. Embedding rows past the
tokenizer's vocabulary are zero, so their logits are 0 and greedy decoding (almost surely: some real
token has a positive logit) stays on ids the tokenizer can decode. Weights are N(0, 1/fan_in), which
keeps bf16 activations finite through 16 layers; norms are 1.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

# Hugging Face meta-llama/Llama-3.2-1B, minus its tokenizer ids (the demo tokenizer's are used).
SHAPES: dict[str, dict] = {
    "llama-1b": {
        "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "tie_word_embeddings": True,
    },
    # Hugging Face meta-llama/Llama-3.1-8B's shape.
    "llama-8b": {
        "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "tie_word_embeddings": False,
    },
    # The same layout at a size a CPU test can load in a second.
    "llama-tiny": {
        "vocab_size": 4096, "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 4096,
        "rope_theta": 500000.0, "rope_scaling": None, "tie_word_embeddings": True,
    },
}


def model_config(shape: str, dtype: str = "bfloat16") -> dict:
    if shape not in SHAPES:
        raise SystemExit(f"error: unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "rms_norm_eps": 1e-5,
        "attention_bias": False, "mlp_bias": False, "bos_token_id": 0, "eos_token_id": [1, 4], "pad_token_id": 2,
        "torch_dtype": dtype, **SHAPES[shape],
    }
    if cfg["rope_scaling"] is None:
        del cfg["rope_scaling"]
    return cfg


def write_model(shape: str, out_dir: str | Path, dtype: str = "bfloat16", seed: int = 0, device: str = "cpu") -> Path:
    from cluster.model.demo import ensure_demo_model

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    demo = ensure_demo_model()
    demo_vocab = json.loads((demo / "config.json").read_text())["vocab_size"]
    for f in demo.iterdir():
        if "token" in f.name or f.name.endswith(".jinja") or f.name == "generation_config.json":
            shutil.copy(f, out / f.name)

    cfg = model_config(shape, dtype)
    tdtype = getattr(torch, dtype)
    # On a GPU host, drawing 8B random numbers on the device takes seconds instead of minutes.
    gen = torch.Generator(device=device).manual_seed(seed)
    h, inter, layers, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]

    def w(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=gen, device=device) * cols**-0.5).to(tdtype).cpu()

    emb = torch.zeros(v, h, dtype=tdtype)
    emb[:demo_vocab] = (torch.randn(demo_vocab, h, generator=gen, device=device) * 0.5).to(tdtype).cpu()
    tensors = {"model.embed_tokens.weight": emb, "model.norm.weight": torch.ones(h, dtype=tdtype)}
    if not cfg["tie_word_embeddings"]:
        # Rows past the tokenizer's vocab stay zero, like the embedding's, so decoding prefers real ids.
        head = torch.zeros(v, h, dtype=tdtype)
        head[:demo_vocab] = (torch.randn(demo_vocab, h, generator=gen, device=device) * 0.5).to(tdtype).cpu()
        tensors["lm_head.weight"] = head
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": w(q, h), p + "self_attn.k_proj.weight": w(kv, h),
            p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, q),
            p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
            p + "mlp.down_proj.weight": w(h, inter),
            p + "input_layernorm.weight": torch.ones(h, dtype=tdtype),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=tdtype),
        })
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "pdserve_loadtest_model.json").write_text(json.dumps({"shape": shape, "seed": seed, "dtype": dtype}) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.make_model", description=__doc__.split("\n\n")[0])
    p.add_argument("dir")
    p.add_argument("--shape", default="llama-1b", choices=sorted(SHAPES))
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="where to draw the random numbers (cuda is much faster)")
    args = p.parse_args(argv)
    print(write_model(args.shape, args.dir, args.dtype, args.seed, args.device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
