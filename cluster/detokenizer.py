"""Incremental detokenization and stop-string matching, on the host, outside any decode loop.

Decodes only a short window of recent tokens per step (vLLM's prefix/read offsets), so the cost per
token is constant. Text that could still turn into a stop string is held back until it can't.
"""

from __future__ import annotations

# Prompt tokens kept as left context so tokenizers that merge leading spaces decode correctly.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.tokens: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""  # all output text so far (truncated at a stop string once one matches)
        self.emitted = 0  # characters of self.text already handed out
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.stopped = False
        # The Rust tokenizer under a fast HF tokenizer decodes a short window in ~3 us; the HF Python
        # wrapper around it costs ~50 us a call, which at thousands of tokens/s is the gateway's limit.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            self._decode = lambda ids: backend.decode(ids, skip_special_tokens=True)
        else:
            self._decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> None:
        """Appends one token; sets `stopped` if a stop string completed."""
        if self.stopped:
            return
        self.tokens.append(token_id)
        self._advance(final=False)

    def _advance(self, final: bool) -> None:
        if self.read_offset == len(self.tokens):
            return
        prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset :])
        if not final and (len(full) <= len(prefix) or full.endswith("\ufffd")):
            return  # an incomplete UTF-8 sequence: wait for the next token (at the end, emit it as is)
        start = len(self.text)
        self.text += full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        if self.stop:
            window = self.text[max(0, start - self.hold) :]
            hits = [i for i in (window.find(s) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[: max(0, start - self.hold) + min(hits)]
                self.stopped = True

    def flush(self) -> None:
        """The sequence ended: tokens still held back (an incomplete UTF-8 sequence) become text."""
        if not self.stopped:
            self._advance(final=True)

    def take_new_text(self, final: bool = False) -> str:
        """Text not yet handed out, minus a tail that might still become a stop string."""
        if final:
            self.flush()
        end = len(self.text) if (final or self.stopped) else max(self.emitted, len(self.text) - self.hold)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out
