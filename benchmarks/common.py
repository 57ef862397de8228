"""What the benchmarks share: the model shapes they build (random weights of real models' shapes),
the KV block size, the device copy bandwidth (what a memory-bound step is compared to), timing helpers
and the FLOP count of a prefill. One module, so two benchmarks never disagree on a shape or a rate."""

from __future__ import annotations

import statistics
import time

import torch

from cluster.model.config import ModelArchConfig

BLOCK_SIZE = 16

_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
SHAPES = {
    "llama-1b-shape": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                           num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                           rope_scaling=dict(_LLAMA3_ROPE, factor=32.0)),
    "llama-8b-shape": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                           num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                           rope_scaling=dict(_LLAMA3_ROPE, factor=8.0)),
    # --dry-run: the same code on CPU in seconds.
    "tiny-shape": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                       rope_scaling=dict(_LLAMA3_ROPE, factor=8.0)),
}
def hf_config_dict(name: str) -> dict:
    return dict(SHAPES[name], model_type="llama", architectures=["LlamaForCausalLM"],
                vocab_size=1024 if name == "tiny-shape" else 128256,
                hidden_act="silu", rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
                bos_token_id=128000, eos_token_id=128001, dtype="bfloat16")


def arch_of(name: str) -> ModelArchConfig:
    # Positions past MAX_MODEL_LEN are never used here: keep the rotary tables small.
    d = hf_config_dict(name)
    d["max_position_embeddings"] = 4096
    return ModelArchConfig.from_dict(d)


def log(*a):
    print(*a, flush=True)


def median(xs):
    return statistics.median(xs) if xs else float("nan")


# -- memory bandwidth ---------------------------------------------------------------------------
def copy_bandwidth_gbps(device: str, nbytes: int = 2 << 30, reps: int = 20) -> float:
    """Device-to-device copy, counting bytes read plus written (what a decode step's reads compare to)."""
    if device != "cuda":
        nbytes, reps = 64 << 20, 3
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        b.copy_(a)
        sync(device)
        times.append(time.perf_counter() - t0)
    del a, b
    return 2 * nbytes / median(times) / 1e9


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def model_flops(arch, prompt_lens: list[int]) -> float:
    h, i, layers = arch.hidden_size, arch.intermediate_size, arch.num_layers
    per_layer = h * (arch.q_size + 2 * arch.kv_size) + arch.q_size * h + 3 * h * i
    tokens = sum(prompt_lens)
    matmul = 2 * per_layer * layers * tokens + 2 * h * arch.vocab_size * len(prompt_lens)
    attention = 4 * arch.num_heads * arch.head_dim * layers * sum(n * (n + 1) // 2 for n in prompt_lens)
    return matmul + attention


def step_read_bytes(model, arch, bs: int, context: int, kv_dtype: torch.dtype) -> int:
    """The memory floor's bytes, the one every benchmark uses: what one decode step reads. Every
    linear's parameters (weights, scales), the LM head and the norms, each once; of the embedding table
    only the `bs` rows the step looks up (a tied table is read in full anyway, as the LM head); and
    every row's K/V over its `context` tokens at the cache's element size (`kv_dtype`)."""
    total = 0
    for name, p in model.named_parameters():
        if name == "embed_tokens.weight":
            total += bs * p.shape[1] * p.element_size()
        else:
            total += p.numel() * p.element_size()
    if arch.tie_word_embeddings:  # the tied head is read in full (named_parameters lists it once)
        total += model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    elem = torch.empty((), dtype=kv_dtype).element_size()
    return total + bs * context * arch.kv_bytes_per_token(elem)


def memory_floor_ms(nbytes: int, copy_gbps: float) -> float:
    """The step's memory floor: its bytes read at the device's copy bandwidth."""
    return nbytes / (copy_gbps * 1e9) * 1e3
