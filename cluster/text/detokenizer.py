"""Incremental detokenization and stop-string matching, on the host, outside any decode loop.

Each new token is decoded against a short window of the tokens before it (vLLM's prefix/read offsets),
so the cost per token is constant; text that ends in an incomplete UTF-8 sequence waits for the next
token. Two decoders implement that rule and give the same text (tests/cluster/text/test_detokenizer.py):
the Rust `tokenizers.decoders.DecodeStream` (one call per token, ~2 us) where it is exact, and the
same algorithm in Python over the tokenizer's decode (two calls per token) as the reference and the
fallback. Text that could still turn into a stop string is held back until it can't.

Special tokens (`<s>`, `<|python_tag|>`, `[TOOL_CALLS]` ...) are dropped from the text unless the request
asks to keep them (`skip_special_tokens=False`: vLLM's field; tool-call parsers whose opening tag is
a special token need it).

The decode worker's token publisher runs one per request (cluster/wire/stream_messages.py carries the
text to the gateway); the in-process engine runs one per sequence.
"""

from __future__ import annotations

# Prompt tokens kept as left context so tokenizers that merge leading spaces decode correctly.
_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"
_COMPACT_CHARS = 4096  # IncrementalDetokenizer moves handed-out text out of its tail in chunks this big


class _OffsetsDecoder:
    """vLLM's incremental decode: new text = decode(window + new) - decode(window)."""

    def __init__(self, decode, tokens: list[int], read_offset: int):
        self._decode = decode
        self.tokens = tokens
        self.prefix_offset = 0
        self.read_offset = read_offset

    def push(self, token_id: int) -> str | None:
        self.tokens.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True) or ""

    def peek(self) -> str:
        """The text held back so far, decoded as it is (replacement characters included); no change."""
        if self.read_offset == len(self.tokens):
            return ""
        return self._decode(self.tokens[self.prefix_offset :])[len(self._decode(self.tokens[self.prefix_offset : self.read_offset])) :]

    def _advance(self, final: bool) -> str | None:
        if self.read_offset == len(self.tokens):
            return None
        prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset :])
        if not final and (len(full) <= len(prefix) or full.endswith(_REPLACEMENT)):
            return None  # an incomplete UTF-8 sequence: wait for the next token (at the end, emit it as is)
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return full[len(prefix) :]


class _RustStreamDecoder:
    """The same rule inside the Rust tokenizer (`DecodeStream.step`). Its state is mirrored here
    (`window`: the tokens its prefix decodes, `pending`: tokens not yet released) only to flush held
    bytes at the end and to hand over to the Python decoder if the stream ever refuses a token."""

    def __init__(self, backend, decode, context: list[int], skip_special_tokens: bool = True):
        from tokenizers.decoders import DecodeStream

        self._backend = backend
        self._decode = decode
        self._stream = DecodeStream(ids=list(context), skip_special_tokens=skip_special_tokens)
        self.window = list(context)
        self.pending: list[int] = []

    def push(self, token_id: int) -> str | None:
        self.pending.append(token_id)
        out = self._stream.step(self._backend, token_id)
        if out is not None:
            self.window, self.pending = self.pending, []
        return out

    def flush(self) -> str:
        text = self.peek()
        self.window, self.pending = self.pending, []
        return text

    def peek(self) -> str:
        if not self.pending:
            return ""
        return self._decode(self.window + self.pending)[len(self._decode(self.window)) :]

    def as_offsets(self) -> _OffsetsDecoder:
        return _OffsetsDecoder(self._decode, self.window + self.pending, len(self.window))


def _stream_is_exact(decode, context: list[int]) -> bool:
    """DecodeStream takes its prompt context as text only if that text is complete: a prompt ending
    inside a UTF-8 character would be re-emitted as output."""
    try:
        from tokenizers.decoders import DecodeStream

        DecodeStream(ids=[], skip_special_tokens=True)  # tokenizers >= 0.22: prefill ids
    except (ImportError, TypeError):
        return False
    return not decode(context).endswith(_REPLACEMENT)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids, stop: tuple[str, ...] = (), *, resumed_tokens: int = 0,
                 resumed_chars: int = 0, use_decode_stream: bool = True, skip_special_tokens: bool = True):
        """`resumed_tokens`/`resumed_chars`: a migrated request's prompt ends with `resumed_tokens`
        tokens it already generated, of whose text the client has `resumed_chars` characters; they are
        decoded again here (not handed out again), so the text goes on exactly where it stopped.
        `skip_special_tokens`: special tokens give no text (False: their text is output)."""
        # The output text so far (truncated at a stop string once one matches) is `_head` joined, then
        # `_tail`, which starts at character `_tail_start`. `_tail` holds what is not handed out yet and
        # the `hold` characters a stop string may still straddle; the rest moves to `_head` in chunks,
        # so appending a token costs its own length, not the text's (`text +=` on an attribute copies
        # the whole text each time: quadratic in a long output).
        self._head: list[str] = []
        self._tail = ""
        self._tail_start = 0
        self.emitted = 0  # characters of the text already handed out
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        # A stop string with U+FFFD can match bytes that are still held back (an incomplete UTF-8
        # sequence decodes to it): those are looked at as they are after every token (see add()).
        self._stop_on_held = any(_REPLACEMENT in s for s in stop)
        self.stopped = False
        # The Rust tokenizer under a fast HF tokenizer decodes a short window in ~3 us; the HF Python
        # wrapper around it costs ~50 us a call, which at thousands of tokens/s would be the limit.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        skip = skip_special_tokens
        if backend is not None:
            decode = lambda ids: backend.decode(ids, skip_special_tokens=skip)  # noqa: E731
        else:
            decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=skip,  # noqa: E731
                                                  clean_up_tokenization_spaces=False)
        prompt = list(prompt_token_ids)
        n = len(prompt) - resumed_tokens
        context = prompt[:n][-_CONTEXT_TOKENS:]
        if use_decode_stream and backend is not None and _stream_is_exact(decode, context):
            self._decoder: _OffsetsDecoder | _RustStreamDecoder = _RustStreamDecoder(backend, decode, context, skip)
        else:
            self._decoder = _OffsetsDecoder(decode, context, len(context))
        for token_id in prompt[n:]:
            self.add(token_id)
        self.emitted = min(resumed_chars, self.length)

    @property
    def text(self) -> str:
        """All output text so far (a join: read it once the output is done)."""
        return "".join(self._head) + self._tail

    @property
    def length(self) -> int:
        return self._tail_start + len(self._tail)

    @property
    def uses_decode_stream(self) -> bool:
        return isinstance(self._decoder, _RustStreamDecoder)

    def add(self, token_id: int) -> None:
        """Appends one token; sets `stopped` if a stop string completed."""
        if self.stopped:
            return
        try:
            new = self._decoder.push(token_id)
        except Exception:  # the Rust stream refused a prefix it did not expect: go on in Python
            if not isinstance(self._decoder, _RustStreamDecoder):
                raise
            self._decoder = self._decoder.as_offsets()
            new = self._decoder._advance(final=False)
        if new is not None:
            self._append(new)
        elif self._stop_on_held and self._matches(self._decoder.peek()):
            self._append(self._decoder.flush())  # the held bytes complete a stop string: stop at this token

    def _since(self, start: int) -> str:
        """The text from character `start` on (start >= _tail_start, or the tail if it is shorter)."""
        return self._tail[max(0, start - self._tail_start):]

    def _matches(self, tail: str) -> bool:
        window = self._since(self.length - self.hold) + tail
        return bool(tail) and any(s in window for s in self.stop)

    def _append(self, new: str) -> None:
        start = self.length
        self._tail += new
        if self.stop:
            from_ = max(0, start - self.hold)
            window = self._since(from_)
            hits = [i for i in (window.find(s) for s in self.stop) if i >= 0]
            if hits:
                self._tail = self._tail[: from_ + min(hits) - self._tail_start]
                self.stopped = True
        self._compact()

    def _compact(self) -> None:
        # Moves to _head what is handed out and more than `hold` characters back (never read again);
        # in chunks of at least _COMPACT_CHARS, so the tail is copied O(1) times per character.
        keep_from = min(self.emitted, self.length - self.hold)
        if keep_from - self._tail_start >= _COMPACT_CHARS:
            cut = keep_from - self._tail_start
            self._head.append(self._tail[:cut])
            self._tail = self._tail[cut:]
            self._tail_start = keep_from

    def flush(self) -> None:
        """The sequence ended: tokens still held back (an incomplete UTF-8 sequence) become text."""
        if not self.stopped:
            new = self._decoder.flush()
            if new:
                self._append(new)

    def take_new_text(self, final: bool = False) -> str:
        """Text not yet handed out, minus a tail that might still become a stop string."""
        if final:
            self.flush()
        length = self.length
        end = length if (final or self.stopped) else max(self.emitted, length - self.hold)
        out = self._tail[self.emitted - self._tail_start : end - self._tail_start]
        self.emitted = end
        return out
