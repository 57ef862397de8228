"""StreamText: one request's token ids -> the text deltas its gateway gets.

The one rule for what a client sees of its tokens, used by both workers that send them: its prefill
worker sends the first token (prefill_worker/first_token_sender.py) and its decode worker every token
(decode_worker/token_publisher.py), the first one again. Built from the same request, the two sides'
StreamTexts turn the same tokens into the same deltas, each numbered by its first token's position
(`StreamDelta.start`): the gateway keeps whichever copy of the first token comes first and drops the
other (router/streams/token_stream.py TokenMailbox). HAZARD: the two copies travel from two processes on two
sockets, so the decode worker's second token can reach the gateway before the prefill worker's first
(a loaded host; the chaos "faults" run found it as a stream with its first two tokens swapped).

- A stop token (the loop's finish "stop": stop_token_ids or EOS) stays in token_ids and its logprobs,
  but its text is not output (as vLLM).
- A stop string ends the request here: finish "stop", the text cut before the stop string, and the
  tokens after the one that completed it dropped (`stopped_here` tells the caller to drop the
  request in its loop).
- An error ends the request, not its text: the held-back bytes (an incomplete UTF-8 sequence, a tail
  that may become a stop string) stay unsent, since the worker the request moves to decodes the same
  tokens again and sends them (issue 29).
"""

from __future__ import annotations

from cluster.text.detokenizer import IncrementalDetokenizer
from cluster.wire.messages import GenerateRequest
from cluster.wire.stream_messages import DeltaLogprobs, PositionLogprobs, StreamDelta


class TokenStrings:
    """Token id -> the token's own string (the `token` fields of logprobs), cached per worker."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            s = self._cache[token_id] = self.tokenizer.decode([token_id])
        return s

    def position(self, token_id: int, lp) -> PositionLogprobs:
        """A TokenLogprobs (ids) as the wire's PositionLogprobs (with strings)."""
        return PositionLogprobs(token_id, self(token_id), lp.logprob, lp.top_ids, tuple(self(t) for t in lp.top_ids),
                                lp.top_logprobs)


class StreamText:
    __slots__ = ("reply_to", "detok", "prompt", "tokens_out")

    def __init__(self, tokenizer, req: GenerateRequest):
        self.reply_to = req.reply_to
        self.detok = IncrementalDetokenizer(tokenizer, req.prompt_token_ids, req.params.stop,
                                            resumed_tokens=req.resumed_tokens, resumed_chars=req.resumed_chars,
                                            skip_special_tokens=req.params.skip_special_tokens)
        self.prompt = req.prompt_token_ids if req.params.prompt_logprobs is not None else None  # for its strings
        self.tokens_out = 0  # tokens of this placement in the deltas so far: the next delta's `start`

    def delta(self, request_id: str, tokens: tuple[int, ...], finish: str | None, error: str | None, token_lps,
              prompt_lps, strings: TokenStrings) -> tuple[StreamDelta, bool]:
        """(the StreamDelta of these new tokens, stopped_here: a stop string ended the request here
        while its worker's loop still runs it). `finish` is the loop's (None, "stop" for a stop token,
        "length", "abort", "error")."""
        detok = self.detok
        stopped_here = False
        text_tokens = len(tokens) - 1 if finish == "stop" else len(tokens)
        for i, tok in enumerate(tokens[:text_tokens]):
            detok.add(tok)
            if detok.stopped:
                stopped_here = finish is None
                tokens, finish = tokens[: i + 1], "stop"
                break
        text = detok.take_new_text(final=finish is not None and finish != "error")
        logprobs = None
        if token_lps is not None or prompt_lps is not None:
            toks = tuple(strings.position(t, lp) for t, lp in zip(tokens, token_lps or ()))
            pr = None
            if prompt_lps is not None and self.prompt is not None:
                pr = tuple(None if lp is None else strings.position(t, lp) for t, lp in zip(self.prompt, prompt_lps))
            logprobs = DeltaLogprobs(toks, pr)
        start = self.tokens_out if tokens else -1
        self.tokens_out += len(tokens)
        return StreamDelta(request_id, tokens, text, finish, error, logprobs, start), stopped_here
