"""`pdserve demo-model DIR`: a tiny random-weight Llama checkpoint in standard Hugging Face format.

Deterministic from the seed: the tokenizer is a byte-level BPE trained by `tokenizers` on the text
shipped beside this file, and the weights come from a seeded generator. Nothing is downloaded.
Weights are scaled so the next-token distribution is peaked: greedy decoding then has clear margins
and is stable across attention implementations (the HF-equivalence tests rely on that).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

CORPUS = Path(__file__).with_name("demo_corpus.txt")
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
DEMO_VERSION = 1


def demo_config(vocab_size: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        # Llama-3 style frequency rescaling, so the demo exercises it.
        "rope_scaling": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 1024},
        "tie_word_embeddings": True,
        "attention_bias": False,
        "bos_token_id": 0,
        "eos_token_id": [1, 4],
        "pad_token_id": 2,
        "torch_dtype": "float32",
    }


def train_tokenizer(vocab_size: int = 512):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS.read_text()], trainer=trainer)
    # Prepend BOS like Llama tokenizers do.
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)])
    return tok


def write_demo_model(out_dir: str | Path, seed: int = 0) -> Path:
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer()
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, "special token ids are fixed by the config"
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"], model_max_length=4096,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(out)

    vocab = -(-tok.get_vocab_size() // 64) * 64
    cfg = demo_config(vocab)
    gen = torch.Generator().manual_seed(seed)
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]

    def w(rows: int, cols: int, gain: float = 1.0) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) * (gain / cols**0.5)

    tensors = {"model.embed_tokens.weight": torch.randn(vocab, h, generator=gen) * 0.5}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": w(q, h, 2.0),
            p + "self_attn.k_proj.weight": w(kv, h, 2.0),
            p + "self_attn.v_proj.weight": w(kv, h),
            p + "self_attn.o_proj.weight": w(h, q),
            p + "mlp.gate_proj.weight": w(inter, h),
            p + "mlp.up_proj.weight": w(inter, h),
            p + "mlp.down_proj.weight": w(h, inter),
            p + "input_layernorm.weight": 1.0 + 0.1 * torch.randn(h, generator=gen),
            p + "post_attention_layernorm.weight": 1.0 + 0.1 * torch.randn(h, generator=gen),
        })
    tensors["model.norm.weight"] = torch.ones(h)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": [1, 4], "pad_token_id": 2}, indent=2) + "\n"
    )
    (out / "pdserve_demo.json").write_text(json.dumps({"version": DEMO_VERSION, "seed": seed}) + "\n")
    return out


def default_demo_dir() -> Path:
    root = Path(os.environ.get("PDSERVE_HOME", Path.home() / ".cache" / "pdserve"))
    return root / f"demo-model-v{DEMO_VERSION}"


def ensure_demo_model() -> Path:
    """The demo model's directory, written on first use (a second or two on CPU)."""
    d = default_demo_dir()
    if not (d / "pdserve_demo.json").is_file():
        tmp = d.with_name(d.name + f".tmp{os.getpid()}")
        write_demo_model(tmp)
        try:
            tmp.rename(d)
        except OSError:  # another process won the race; its copy is identical
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return d
