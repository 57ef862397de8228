"""The limits every request must fit, in one place: the served context length and a KV pool.

`served_max_model_len` is the context length a deployment serves: the configured `max_model_len`,
never beyond the model's `max_position_embeddings` (the launcher, the decode worker, the prefill
worker and the engine all take it from here, so the router admits exactly what the workers accept).

`check_request_fits` is "does this request fit": prompt + max_tokens within that context length and,
when a KV pool is named, its blocks within the pool's. The router's admission checks it against the
largest healthy decode worker; the decode worker and the engine against their own pool; the prefill
worker, which only ever holds the prompt, with max_tokens 0. `default_max_tokens` is the chat
default when a request asks for none: the most that check leaves (vLLM's), capped by the model's own.
"""

from __future__ import annotations

from cluster.errors import InvalidRequestError
from cluster.kv.kv_blocks import blocks_for_tokens


def served_max_model_len(configured: int | None, max_position_embeddings: int) -> int:
    """The context length served: `configured` (None: the model's own), clamped to the model's."""
    return min(configured or max_position_embeddings, max_position_embeddings)


def check_request_fits(prompt_len: int, max_tokens: int, max_model_len: int, *, block_size: int | None = None,
                       kv_blocks: int | None = None, holder: str = "the KV pool") -> None:
    """Raises InvalidRequestError (HTTP 400, param max_tokens) when a request of `prompt_len` prompt
    tokens and `max_tokens` output tokens can never run: beyond `max_model_len`, or (with `kv_blocks`)
    needing more than `kv_blocks` blocks of `block_size` tokens even alone. `holder` names the pool in
    the message ("any decode worker", "this prefill worker")."""
    total = prompt_len + max_tokens
    if total > max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{total} tokens ({prompt_len} in the prompt, {max_tokens} for the completion). Please reduce "
            f"the prompt or max_tokens.", "max_tokens")
    if kv_blocks is None:
        return
    if block_size is None or block_size < 1:
        raise ValueError("a KV pool's fit needs its block_size")
    if blocks_for_tokens(total, block_size) > kv_blocks:
        asked = f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens})" if max_tokens else \
            f"prompt ({prompt_len} tokens)"
        raise InvalidRequestError(
            f"{asked} does not fit in the KV cache of {holder} ({kv_blocks * block_size} tokens)", "max_tokens")


def largest_max_tokens(prompt_len: int, max_model_len: int, kv_capacity_tokens: int | None = None) -> int:
    """The largest max_tokens `check_request_fits` accepts for a prompt of `prompt_len` tokens, within
    `max_model_len` and a pool of `kv_capacity_tokens` (its blocks x block_size; None or 0: no pool
    named). Zero or less: not even max_tokens 1 fits."""
    return min(max_model_len, kv_capacity_tokens or max_model_len) - prompt_len


def default_max_tokens(prompt_len: int, max_model_len: int, kv_capacity_tokens: int | None,
                       model_default: int | None) -> int:
    """A chat request's max_tokens when it asks for none: as much as the context and the KV cache leave
    (vLLM's default), at most the model's own `max_new_tokens` (`model_default`), at least 1 (a prompt
    that leaves no room is refused by the fit check, with its message)."""
    room = largest_max_tokens(prompt_len, max_model_len, kv_capacity_tokens)
    return max(1, min(room, model_default or room))
