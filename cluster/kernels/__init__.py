"""The forward pass's fused kernels and the sampler: Triton on CUDA, their torch references elsewhere.

One file per kernel (`rmsnorm`, `rotary_kv`, `silu_mul`, `prefill_attention`, `sampling`,
`logits_processing`, `logprobs`, `decode_step_inputs`, `fp8_gemm`, `fp8_quant`, `token_bitmask`): the Triton
kernel, its launcher, and a docstring naming its reference in `reference.py`. `fp8_gemm_configs` holds the
FP8 GEMMs' tile configs: the table benchmarks/tune_fp8_gemm.py measured (`fp8_gemm_configs.json`) and defaults. The functions below pick
one per call: the kernel for CUDA tensors, the reference otherwise (CPU, and machines without triton).
Tests force either with `use_kernels(True/False)`; on CPU the kernels then run under Triton's
interpreter (TRITON_INTERPRET=1, set before triton is imported).

The choice is made on the host from the tensor's device, so it is static under CUDA-graph capture.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from types import SimpleNamespace

import torch

from cluster.kernels import reference

_forced: bool | None = None


@functools.cache
def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def enabled(t: torch.Tensor) -> bool:
    """Whether ops on `t` run the Triton kernels."""
    if _forced is not None:
        return _forced
    return t.is_cuda and _triton_available()


@contextmanager
def use_kernels(on: bool):
    """Forces the kernels (on CPU: through Triton's interpreter) or the references, for tests."""
    global _forced
    before, _forced = _forced, on
    try:
        yield
    finally:
        _forced = before


@functools.cache
def _k() -> SimpleNamespace:
    from cluster.kernels import (decode_step_inputs, logits_processing, logprobs, rmsnorm, rotary_kv, sampling, silu_mul,
                                 token_bitmask)

    return SimpleNamespace(rms_norm=rmsnorm.rms_norm, fused_add_rms_norm=rmsnorm.fused_add_rms_norm,
                           rotary_store_kv=rotary_kv.rotary_store_kv, silu_and_mul=silu_mul.silu_and_mul,
                           sample=sampling.sample, decode_inputs=decode_step_inputs.decode_inputs,
                           process_logits=logits_processing.process_logits,
                           update_sampling_state=logits_processing.update_sampling_state,
                           token_logprobs=logprobs.token_logprobs,
                           apply_token_bitmask=token_bitmask.apply_token_bitmask)


def rms_norm(x, weight, eps):
    return (_k().rms_norm if enabled(x) else reference.rms_norm)(x, weight, eps)


def fused_add_rms_norm(x, residual, weight, eps):
    """residual <- x + residual; returns (rms_norm(residual), residual). In place on CUDA."""
    return (_k().fused_add_rms_norm if enabled(x) else reference.fused_add_rms_norm)(x, residual, weight, eps)


def rotary_store_kv(qkv, positions, cos_sin, kv_layer, slot_mapping, num_heads, num_kv_heads, head_dim,
                    k_scale: float = 1.0, v_scale: float = 1.0):
    """Rotates q and k and writes k, v into their cache slots (an FP8 cache: k / k_scale, v / v_scale);
    returns q, k, v as [T, heads, head_dim]."""
    fn = _k().rotary_store_kv if enabled(qkv) else reference.rotary_store_kv
    return fn(qkv, positions, cos_sin, kv_layer, slot_mapping, num_heads, num_kv_heads, head_dim, k_scale, v_scale)


def silu_and_mul(gate_up):
    return (_k().silu_and_mul if enabled(gate_up) else reference.silu_and_mul)(gate_up)


def sample(logits, temperature, top_k, top_p, seeds, positions, filtered: bool | None = None, out=None,
           log_min_p=None):
    """See reference.sample; the tokens go to `out` if given. `filtered` is a hint for the reference
    (skip the sort); the kernel decides per row and never syncs."""
    if enabled(logits):
        return _k().sample(logits, temperature, top_k, top_p, seeds, positions, out=out, log_min_p=log_min_p)
    tokens = reference.sample(logits, temperature, top_k, top_p, seeds, positions, filtered, log_min_p)
    return tokens if out is None else out.copy_(tokens)


def process_logits(logits, row_slots, state, out=None):
    """Penalties, logit_bias, allowed tokens and bad words of the rows with a sampling-state slot;
    float32 [B, V] (into `out` if given)."""
    return (_k().process_logits if enabled(logits) else reference.process_logits)(logits, row_slots, state, out)


def update_sampling_state(row_slots, tokens, state):
    """Counts each slotted row's sampled token in its slot (after the draw, on the device)."""
    (_k().update_sampling_state if enabled(tokens) else reference.update_sampling_state)(row_slots, tokens, state)


def apply_token_bitmask(logits, row_mask, bitmask):
    """Grammar masks: -inf where a constrained row's bitmask bans the token (rows with index -1 untouched);
    in place."""
    return (_k().apply_token_bitmask if enabled(logits) else reference.apply_token_bitmask)(logits, row_mask, bitmask)


def token_logprobs(logits, tokens, k: int, out_lp=None, out_top_ids=None, out_top_lp=None):
    """(logprob of each row's token, top-k ids, their logprobs) under log_softmax(logits)."""
    if enabled(logits):
        return _k().token_logprobs(logits, tokens, k, out_lp, out_top_ids, out_top_lp)
    lp, ids, top = reference.token_logprobs(logits, tokens, k)
    if out_lp is not None:
        b = logits.shape[0]
        out_lp[:b].copy_(lp)
        out_top_ids[:b].copy_(ids)
        out_top_lp[:b].copy_(top)
        return out_lp[:b], out_top_ids[:b], out_top_lp[:b]
    return lp, ids, top


def decode_inputs(packed, rows, out_tokens, ids, positions, slots, context_lens, next_positions, tables, block_size):
    fn = _k().decode_inputs if enabled(packed) else reference.decode_inputs
    fn(packed, rows, out_tokens, ids, positions, slots, context_lens, next_positions, tables, block_size)
