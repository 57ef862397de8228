"""Log-probabilities returned to users: what they are and how they travel.

Which distribution: the model's own, log_softmax of the raw logits in float32, before penalties,
logit_bias, allowed/bad tokens, temperature and top-k/top-p/min-p (vLLM's default "raw_logprobs",
and what a transformers log_softmax over the same logits gives). The sampled token's logprob is
under that distribution even when processing changed the draw (a banned token is never sampled, but
the logprobs still show how likely the model found it).

Computed where the token is sampled: inside the decode step's CUDA graph (`cluster.kernels.
token_logprobs`: log-sum-exp partials and torch.topk, no sync), and by the host-side sampler after a
prefill (first token). Prompt logprobs (`prompt_logprobs`) come from the prefill's logits at every
prompt position.

On the wire they are `TokenLogprobs` (msgpack arrays); token strings are added by the decode worker's
token publisher (cluster.wire.stream_messages.PositionLogprobs), never by a gateway.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence as Seq

import msgspec

if TYPE_CHECKING:
    import torch

# torch and cluster.kernels are imported by the two functions that compute logprobs, not here: the
# types above travel through processes that never compute (the decode worker's publisher process
# would otherwise pay torch's import, seconds, at every start and restart).


class TokenLogprobs(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One position: the logprob of its token and the `k` most likely tokens with theirs."""

    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


class PrefillLogprobs(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """What a prefill hands the decode side with the first token: that token's logprobs (None: not
    asked) and the prompt's (None: not asked; else one entry per prompt token, the first None)."""

    first: TokenLogprobs | None = None
    prompt: tuple[TokenLogprobs | None, ...] | None = None


encode_prefill_logprobs = msgspec.msgpack.Encoder().encode
decode_prefill_logprobs = msgspec.msgpack.Decoder(PrefillLogprobs).decode


def rows_to_logprobs(lp, top_ids, top_lp, ks: Seq[int | None]) -> list[TokenLogprobs | None]:
    """Host lists of per-row arrays -> one TokenLogprobs per row asking for them (k top entries)."""
    out: list[TokenLogprobs | None] = []
    for i, k in enumerate(ks):
        if k is None:
            out.append(None)
        else:
            out.append(TokenLogprobs(float(lp[i]), tuple(int(t) for t in top_ids[i][:k]),
                                     tuple(float(x) for x in top_lp[i][:k])))
    return out


def sampled_logprobs(logits: torch.Tensor, tokens: torch.Tensor, ks: Seq[int | None]) -> list[TokenLogprobs | None]:
    """Logprobs of tokens just sampled from `logits` (rows whose k is None get None). Syncs."""
    from cluster import kernels

    kmax = max((k for k in ks if k is not None), default=None)
    if kmax is None:
        return [None] * len(ks)
    lp, ids, top = kernels.token_logprobs(logits, tokens, kmax)
    return rows_to_logprobs(lp.tolist(), ids.tolist(), top.tolist(), ks)


def prompt_logprobs(logits_of, num_rows: int, prompt: Seq[int], start: int, k: int,
                    slice_rows: int = 512) -> list[TokenLogprobs | None]:
    """Logprobs of prompt tokens start + 1 .. start + num_rows (those in the prompt) from the logits at
    positions start .. start + num_rows - 1 (row i predicts token start + i + 1); `logits_of(a, b)`
    gives rows a..b. The prompt's first token gets None (nothing predicts it). A slice of rows at a
    time, so that no [T, V] float32 temporary is ever whole. Syncs."""
    import torch

    from cluster import kernels

    out: list[TokenLogprobs | None] = [None] if start == 0 else []
    n = max(0, min(num_rows, len(prompt) - 1 - start))
    for a in range(0, n, slice_rows):
        b = min(n, a + slice_rows)
        logits = logits_of(a, b)
        targets = torch.as_tensor(list(prompt[start + 1 + a : start + 1 + b]), dtype=torch.int64, device=logits.device)
        lp, ids, top = kernels.token_logprobs(logits, targets, k)
        out += rows_to_logprobs(lp.tolist(), ids.tolist(), top.tolist(), [k] * (b - a))
    return out
