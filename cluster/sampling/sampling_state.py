"""SamplingState: what a sequence's logits processing needs across steps, in per-slot device tables.

A sequence that uses penalties, logit_bias, allowed_token_ids, bad_words or logprobs gets a slot for
its life on a worker (the decode graph runner assigns them, vLLM v1's persistent batch); the step's
rows name their slot (-1: none) and every kernel indexes these tables by it. Inside the captured decode
step nothing is rebuilt from the host: `cluster.kernels.update_sampling_state` adds each sampled token
to its slot's counts and history, on the device, after the draw. The host writes a slot only when a
sequence takes it (`init_slots`: outside the graph, on the same stream, so it lands after every step
already queued and before the next), from the tokens it has then; which is all of them, since a
sequence joins with no token in flight.

Tables (S slots, V vocabulary, W = ceil(V / 32)):
  counts     [S, V] int32     generated-token counts (presence / frequency / repetition penalties)
  prompt     [S, W] int32     bitmask of the prompt's tokens (repetition penalty)
  allowed    [S, W] int32     bitmask of allowed_token_ids
  fparams    [S, 4] float32   repetition, frequency, presence penalty, unused
  iparams    [S, 4] int32     flags, logit_bias entries, bad words, tokens generated
  bias_ids   [S, MAX_LOGIT_BIAS] int32, bias_vals [S, MAX_LOGIT_BIAS] float32
  bad_ids    [S, MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS] int32, bad_len [S, MAX_BAD_WORDS] int32
  history    [S, MAX_BAD_WORD_TOKENS] int32   the last generated tokens, newest last (bad words)

Memory: about 4 * S * V bytes (134 MB for 256 slots of a 128k vocabulary), allocated once.

The host-side samplers (first token after a prefill, the reference engine) build a throwaway state
with one slot per row (`for_rows`) and run the same kernels (or their references) on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence as Seq

import numpy as np
import torch

from cluster.sampling.sampling_params import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, MAX_LOGIT_BIAS, SamplingParams

# iparams columns
FLAGS, NUM_BIAS, NUM_BAD, NUM_GENERATED = 0, 1, 2, 3
# flag bits
ALLOWED, PENALTIES = 1, 2


def bitmask(ids: Seq[int], words: int) -> np.ndarray:
    """[words] int32: bit (t & 31) of word (t >> 5) set for each token t."""
    bits = np.zeros(words, dtype=np.uint32)
    if len(ids):
        t = np.unique(np.asarray(ids, dtype=np.int64))
        np.bitwise_or.at(bits, t >> 5, (np.uint32(1) << (t & 31).astype(np.uint32)))
    return bits.view(np.int32)


@dataclass
class SamplingState:
    counts: torch.Tensor
    prompt: torch.Tensor
    allowed: torch.Tensor
    fparams: torch.Tensor
    iparams: torch.Tensor
    bias_ids: torch.Tensor
    bias_vals: torch.Tensor
    bad_ids: torch.Tensor
    bad_len: torch.Tensor
    history: torch.Tensor

    @classmethod
    def allocate(cls, num_slots: int, vocab_size: int, device) -> "SamplingState":
        s, w = num_slots, (vocab_size + 31) // 32
        i32 = dict(dtype=torch.int32, device=device)
        return cls(
            counts=torch.zeros(s, vocab_size, **i32), prompt=torch.zeros(s, w, **i32),
            allowed=torch.zeros(s, w, **i32), fparams=torch.zeros(s, 4, dtype=torch.float32, device=device),
            iparams=torch.zeros(s, 4, **i32), bias_ids=torch.zeros(s, MAX_LOGIT_BIAS, **i32),
            bias_vals=torch.zeros(s, MAX_LOGIT_BIAS, dtype=torch.float32, device=device),
            bad_ids=torch.zeros(s, MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS, **i32), bad_len=torch.zeros(s, MAX_BAD_WORDS, **i32),
            history=torch.zeros(s, MAX_BAD_WORD_TOKENS, **i32),
        )

    @property
    def num_slots(self) -> int:
        return self.counts.shape[0]

    @property
    def vocab_size(self) -> int:
        return self.counts.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in vars(self).values())

    def init_slots(self, slots: Seq[int], params: Seq[SamplingParams], prompts: Seq[Seq[int]],
                   outputs: Seq[Seq[int]]) -> None:
        """Writes the slots of sequences that just took them: parameters, prompt mask, the counts and
        history of the tokens generated so far. One non-blocking copy from pinned memory, then a few
        small device ops; nothing waits for the device."""
        n, v, w = len(slots), self.vocab_size, self.prompt.shape[1]
        if n == 0:
            return
        fparams = np.zeros((n, 4), dtype=np.float32)
        iparams = np.zeros((n, 4), dtype=np.int32)
        prompt = np.zeros((n, w), dtype=np.int32)
        allowed = np.zeros((n, w), dtype=np.int32)
        bias_ids = np.zeros((n, MAX_LOGIT_BIAS), dtype=np.int32)
        bias_vals = np.zeros((n, MAX_LOGIT_BIAS), dtype=np.float32)
        bad_ids = np.zeros((n, MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS), dtype=np.int32)
        bad_len = np.zeros((n, MAX_BAD_WORDS), dtype=np.int32)
        history = np.zeros((n, MAX_BAD_WORD_TOKENS), dtype=np.int32)
        out_rows, out_ids = [], []
        for i, (p, prompt_ids, out) in enumerate(zip(params, prompts, outputs)):
            flags = 0
            if p.allowed_token_ids is not None:
                flags |= ALLOWED
                allowed[i] = bitmask(p.allowed_token_ids, w)
            if p.needs_penalties:
                flags |= PENALTIES
                fparams[i, :3] = (p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
                if p.repetition_penalty != 1.0:
                    prompt[i] = bitmask(prompt_ids, w)
            nb = len(p.logit_bias)
            if nb:
                bias_ids[i, :nb] = [t for t, _ in p.logit_bias]
                bias_vals[i, :nb] = [b for _, b in p.logit_bias]
            for j, word in enumerate(p.bad_words_token_ids):
                bad_ids[i, j, : len(word)] = word
                bad_len[i, j] = len(word)
            iparams[i] = (flags, nb, len(p.bad_words_token_ids), len(out))
            tail = list(out[-MAX_BAD_WORD_TOKENS:])
            if tail:
                history[i, MAX_BAD_WORD_TOKENS - len(tail):] = tail
            out_rows += [i] * len(out)
            out_ids += list(out)
        # One pinned buffer for all of it; PyTorch's pinned allocator keeps it until the copy is done.
        parts = [fparams.view(np.int32), iparams, prompt, allowed, bias_ids, bias_vals.view(np.int32), bad_ids,
                 bad_len, history, np.asarray(out_rows, dtype=np.int32), np.asarray(out_ids, dtype=np.int32),
                 np.asarray(list(slots), dtype=np.int32)]
        flat = np.concatenate([a.reshape(-1) for a in parts])
        host = torch.from_numpy(flat)
        dev = self.counts.device
        if dev.type == "cuda":
            host = host.pin_memory()
        flat_d = host.to(dev, non_blocking=True)
        views, at = [], 0
        for a in parts:
            views.append(flat_d[at : at + a.size].view(a.shape))
            at += a.size
        fp, ip, pr, al, bi, bv, bd, bl, hi, orow, oid, idx = views
        idx = idx.long()
        self.fparams.index_copy_(0, idx, fp.view(torch.float32))
        self.iparams.index_copy_(0, idx, ip)
        self.prompt.index_copy_(0, idx, pr)
        self.allowed.index_copy_(0, idx, al)
        self.bias_ids.index_copy_(0, idx, bi)
        self.bias_vals.index_copy_(0, idx, bv.view(torch.float32))
        self.bad_ids.index_copy_(0, idx, bd)
        self.bad_len.index_copy_(0, idx, bl)
        self.history.index_copy_(0, idx, hi)
        self.counts.index_fill_(0, idx, 0)
        if len(out_ids):
            flat_pos = idx[orow.long()] * v + oid.long()
            self.counts.view(-1).index_put_((flat_pos,), torch.ones_like(flat_pos, dtype=torch.int32), accumulate=True)

    @classmethod
    def for_rows(cls, params: Seq[SamplingParams], prompts: Seq[Seq[int]], outputs: Seq[Seq[int]], vocab_size: int,
                 device) -> "SamplingState":
        """A throwaway state with slot i for row i (host-side sampling after a prefill)."""
        state = cls.allocate(len(params), vocab_size, device)
        state.init_slots(range(len(params)), params, prompts, outputs)
        return state
