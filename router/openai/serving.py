"""What /v1/completions and /v1/chat/completions share: one request from its body to its response.

`OpenAIServing.serve` checks the request, resolves what it asks beyond sampling (`RequestOptions`:
its structured-output constraint, checked by the grammar engine before admission, and for chat its
tools), tokenizes its prompts and bad words (in this process, on the gateway's tokenizer threads:
never on the event loop, whose stall would stop this process's heartbeats and streams; prompts of
token ids only need no tokenizer and are checked on the loop, `needs_tokenizer`), builds the
SamplingParams, admits and places every choice through the router, then streams SSE events or
collects the whole response. The endpoints differ only in the hooks their subclasses implement
(router/openai/serving_completion.py, serving_chat.py): the options, how prompts are read and
encoded, the default max_tokens, logprobs, the response and its chunks.

Prompt scoring: `max_tokens: 0` with echo (or vLLM's prompt_logprobs) asks for the prompt's
logprobs and no token; echo and max_tokens 0 without logprobs asks for the prompt's text only, and
is served the same way with the cheapest prompt logprobs (k = 0), which nobody reads.

A request's choices are independent generations (one per prompt and per n): choice `p * n + i` is
prompt p's i-th, sampled with seed + i when the request has a seed (as vLLM), so it equals the single
request with that seed. One choice failing, or the client leaving, aborts them all.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from cluster.errors import InvalidRequestError
from cluster.kv.request_limits import check_request_fits
from cluster.sampling.sampling_params import SamplingParams
from cluster.text.tokenizer import encode_bad_words
from router.errors import GenerationError
from router.openai.errors import error_event_data
from router.openai.generation import Generation
from router.openai.logprobs import PromptStart
from router.openai.middleware import RECEIVED
from router.openai.protocol_responses import UsageInfo
from router.openai.streaming import DONE, event, sse, unless_disconnected, unless_gone
from router.openai.structured_fields import Constraint, constraint

if TYPE_CHECKING:
    from router.openai.gateway import Gateway
    from router.openai.tool_calling import ToolCalling


@dataclass(frozen=True)
class RequestOptions:
    """What a body asks beyond sampling, resolved once per request (the `options` hook)."""

    constraint: Constraint | None = None  # structured output (response_format, guided_*, a forced tool call)
    skip_special_tokens: bool = True
    tools: ToolCalling | None = None  # chat only

log = logging.getLogger(__name__)


class Choice:
    """One choice of a response: its generation, and what echo puts before its text."""

    def __init__(self, index: int, gen: Generation, prompt_ids: list[int], echo: str | None, tokenizer):
        self.index = index
        self.gen = gen
        self.prompt_ids = prompt_ids
        self.echo = echo  # the prompt's text (echo), else None
        self.tokenizer = tokenizer

    async def pieces(self) -> AsyncIterator[tuple[str, str | None, list, int]]:
        """(text, finish reason or None, logprob positions of the piece's tokens, completion tokens so
        far); with echo, the first piece starts with the prompt's text and (when logprobs are asked)
        the prompt's logprobs."""
        first = self.echo is not None
        async for text, finish, lp in self.gen.pieces():
            positions = list(lp.tokens) if lp is not None else []
            if first:
                first = False
                text = self.echo + text
                if self.gen.params.prompt_logprobs is not None:
                    positions = self._prompt_positions() + positions
            yield text, finish, positions, self.gen.completion_tokens

    def prompt_logprobs(self) -> tuple:
        """The prompt's logprobs, one per prompt token (the first None), as the worker sent them."""
        prompt = self.gen.prompt_logprobs
        if prompt is None or len(prompt) < len(self.prompt_ids):
            raise GenerationError("the worker sent no prompt logprobs")
        return tuple(prompt[: len(self.prompt_ids)])

    def _prompt_positions(self) -> list:
        # The first prompt token has no logprob (nothing precedes it): its string only.
        return [PromptStart(self.tokenizer.decode([self.prompt_ids[0]]))] + list(self.prompt_logprobs()[1:])

    async def collect(self) -> tuple[str, list]:
        text, positions = [], []
        async for t, _, lp, _ in self.pieces():
            text.append(t)
            positions.extend(lp)
        return "".join(text), positions


class ChunkFormat:
    """One streamed response's events (an endpoint's chunk shape)."""

    def opening(self, index: int) -> list[str]:
        return []

    def piece(self, index: int, text: str, finish: str | None, positions, usage: UsageInfo | None = None) -> str:
        """positions: the logprobs of this piece's tokens (empty unless asked); usage: the choice's so
        far, with `stream_options.continuous_usage_stats` (else None)."""
        raise NotImplementedError

    def usage(self, usage: UsageInfo) -> str:
        raise NotImplementedError


class OpenAIServing:
    """One endpoint: `serve` is shared, the hooks below are what differs between the two."""

    id_prefix: str

    def __init__(self, gw: Gateway):
        self.gw = gw

    # -- the hooks --------------------------------------------------------------------------------
    def options(self, body) -> RequestOptions:
        return RequestOptions(constraint(body), body.skip_special_tokens is not False)

    def prompts(self, body) -> list:
        """The request's prompts, each as the client sent it."""
        raise NotImplementedError

    def encode(self, prompt, opts: RequestOptions) -> list[int]:
        raise NotImplementedError

    def max_tokens(self, body, ids: list[int]) -> int:
        raise NotImplementedError

    def num_logprobs(self, body) -> int | None:
        """SamplingParams.logprobs for this body (None: no logprobs)."""
        raise NotImplementedError

    def echo(self, body) -> bool:
        return False

    def needs_tokenizer(self, body, echo: bool) -> bool:
        """Whether reading the prompts and bad words runs the tokenizer (text, a chat template, an
        echo's decode): then `tokenize` runs on a tokenizer thread; else (token ids only) it is a
        bounds check, linear in ids the loop has just parsed from the body, and runs on the loop:
        the thread hop cost ~0.4 ms of TTFT at p50 and ~1 ms at p90 on a loaded CPU
        (loadtest/results/ttft_http_cpu.md)."""
        return True

    def response(self, rid: str, body, opts: RequestOptions, choices: list[Choice], results: list[tuple[str, list]],
                 usage: UsageInfo):
        """results: each choice's (text, logprob positions; empty unless asked)."""
        raise NotImplementedError

    def chunks(self, rid: str, body, opts: RequestOptions, created: int) -> ChunkFormat:
        raise NotImplementedError

    # -- shared -----------------------------------------------------------------------------------
    @staticmethod
    def prompt_logprobs(body, num_logprobs: int | None, echo: bool, max_tokens: int) -> int | None:
        """SamplingParams.prompt_logprobs: vLLM's field, echo's logprobs (the more of them), and k = 0
        for an echo of nothing but the prompt (max_tokens 0: see the module docstring)."""
        asked = [k for k in (body.prompt_logprobs, num_logprobs if echo else None) if k is not None]
        if not asked and echo and max_tokens == 0:
            asked = [0]
        return max(asked) if asked else None

    def sampling_params(self, body, opts: RequestOptions, max_tokens: int, logprobs: int | None,
                        prompt_logprobs: int | None, bad_words: tuple = ()) -> SamplingParams:
        """bad_words: body.bad_words as token sequences (`tokenize`)."""
        gw = self.gw
        bias = ()
        if body.logit_bias:
            try:
                bias = {int(k): v for k, v in body.logit_bias.items()}
            except ValueError:
                raise InvalidRequestError("logit_bias keys must be token ids", "logit_bias") from None
        d = gw.cfg.sampling_defaults  # the model's recommendations (--generation-config), where the body is silent

        def pick(value, default, api_default):
            return value if value is not None else (default if default is not None else api_default)
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=pick(body.temperature, d.temperature, 1.0),
            top_p=pick(body.top_p, d.top_p, 1.0),
            top_k=pick(body.top_k, d.top_k, 0),
            min_p=pick(body.min_p, d.min_p, 0.0),
            seed=body.seed, stop=body.stop_strings, stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos, min_tokens=body.min_tokens,
            presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=pick(body.repetition_penalty, d.repetition_penalty, 1.0),
            logit_bias=bias, allowed_token_ids=body.allowed_token_ids,
            bad_words_token_ids=bad_words,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            structured=opts.constraint.output if opts.constraint is not None else None,
            skip_special_tokens=opts.skip_special_tokens,
        )
        params.check_token_ids(gw.cfg.vocab_size or len(gw.tokenizer))
        return params

    def tokenize(self, body, opts: RequestOptions, echo: bool) -> tuple[list[tuple], tuple]:
        """On a tokenizer thread: each prompt as (prompt, ids, its echo text or None), and the bad
        words' token sequences. The body's lists were capped when it was parsed (protocol.py)."""
        tok = self.gw.tokenizer
        prompts = []
        for p in self.prompts(body):
            ids = self.encode(p, opts)
            prompts.append((p, ids, (p if isinstance(p, str) else tok.decode(ids)) if echo else None))
        return prompts, encode_bad_words(tok, body.bad_words) if body.bad_words else ()

    async def serve(self, body, request: Request) -> Response:
        """Checks, tokenize, admit and place every choice, then stream SSE events or collect."""
        gw = self.gw
        received = request.scope.get(RECEIVED)
        gw.check_accepting()
        gw.check_model(body.model)
        body.check_unsupported()
        opts = self.options(body)
        if opts.constraint is not None:
            if body.allowed_token_ids is not None:  # the two together may leave no token to sample
                raise InvalidRequestError(f"allowed_token_ids cannot be combined with {opts.constraint.param}",
                                          "allowed_token_ids")
            await gw.check_constraint(opts.constraint.output, opts.constraint.param)
        num_logprobs = self.num_logprobs(body)
        echo = self.echo(body)
        if self.needs_tokenizer(body, echo):
            prompts, bad_words = await gw.off_loop(self.tokenize, body, opts, echo)
        else:
            prompts, bad_words = self.tokenize(body, opts, echo)
        rid = f"{self.id_prefix}-{uuid.uuid4().hex}"
        single = len(prompts) * body.n == 1
        if body.user is not None:  # what OpenAI's `user` is for: attributing a request to an end user
            log.info("%s: user %r", rid, body.user)

        async def place_all() -> list[Choice]:
            choices: list[Choice] = []
            try:
                for p, (prompt, ids, echo_text) in enumerate(prompts):
                    max_tokens = self.max_tokens(body, ids)
                    # Here, not only at admission: a prompt past the context never crosses the channel.
                    check_request_fits(len(ids), max_tokens, gw.cfg.max_model_len)
                    params = self.sampling_params(body, opts, max_tokens, num_logprobs,
                                                  self.prompt_logprobs(body, num_logprobs, echo, max_tokens), bad_words)
                    gw.metrics.prompt_placed(body.n, params.max_tokens)
                    for i in range(body.n):
                        index = p * body.n + i
                        seed = None if body.seed is None else (body.seed + i) % 2**63
                        gen = await gw.start_generation(rid if single else f"{rid}-{index}", ids, params, seed,
                                                        received)
                        choices.append(Choice(index, gen, ids, echo_text, gw.tokenizer))
            except BaseException:
                for c in choices:  # a later choice refused (429, ...) or the client left: none of them runs
                    gw.end(c.gen, abort=True)
                raise
            return choices

        def end_all(choices: list[Choice]) -> None:
            for c in choices:
                gw.end(c.gen, abort=True)  # a no-op for a choice that finished

        choices = await unless_gone(request, place_all(), end_all)
        if choices is None:
            return Response(status_code=499)  # the client left while its request waited for a worker
        if body.stream:
            # The request is let go however the stream ends, even when the client left before the
            # body iterator ever started (then Generation.pieces() never runs its cleanup).
            return sse(self._events(choices, rid, body, opts), on_close=lambda: end_all(choices))

        async def collect():
            tasks = [asyncio.ensure_future(c.collect()) for c in choices]
            try:
                results = await asyncio.gather(*tasks)
            finally:  # one failed (or the client left): the others stop too, and abort
                for t in tasks:
                    t.cancel()
            observe_finished(gw, choices, body.n)
            return self.response(rid, body, opts, choices, results, await usage(choices))
        return await unless_disconnected(request, collect())

    async def _events(self, choices: list[Choice], rid: str, body, opts: RequestOptions) -> AsyncIterator[str]:
        fmt = self.chunks(rid, body, opts, int(time.time()))
        try:
            for c in choices:
                for ev in fmt.opening(c.index):
                    yield ev
            prompt_len = {c.index: len(c.prompt_ids) for c in choices} if body.continuous_usage else None
            if len(choices) == 1:  # the common case: no task, no queue
                c = choices[0]
                async for text, finish, positions, n in c.pieces():
                    yield fmt.piece(c.index, text, finish, positions,
                                    UsageInfo.of(prompt_len[c.index], n) if prompt_len else None)
                    # Resumed once Starlette's send of that event returned: it is on the socket.
                    c.gen.wrote_first()
            else:
                async for index, (text, finish, positions, n) in merged(choices):
                    yield fmt.piece(index, text, finish, positions,
                                    UsageInfo.of(prompt_len[index], n) if prompt_len else None)
                    choices[index].gen.wrote_first()  # choices are in index order
            observe_finished(self.gw, choices, body.n)
            if body.include_usage:
                yield fmt.usage(await usage(choices))
        except GenerationError as e:
            yield event(error_event_data(e))
        yield DONE


async def merged(choices: list[Choice]) -> AsyncIterator[tuple[int, tuple]]:
    """Every choice's pieces as they come, tagged with the choice's index. Cancelling the consumer
    (the client left) cancels every reader, whose cleanup aborts its generation."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def read(c: Choice):
        try:
            async for piece in c.pieces():
                queue.put_nowait((c.index, piece))
        except BaseException as e:  # GenerationError, or cancelled: the consumer re-raises the first
            queue.put_nowait((c.index, e))
            return
        queue.put_nowait((c.index, done))

    tasks = [asyncio.ensure_future(read(c)) for c in choices]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is done:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def observe_finished(gw: Gateway, choices: list[Choice], n: int) -> None:
    """Every choice finished: the most tokens any of a prompt's n choices generated (vLLM's
    request_max_num_generation_tokens; choices p*n .. p*n+n-1 are prompt p's)."""
    for p in range(0, len(choices), n):
        gw.metrics.request_max_num_generation_tokens.observe(max(c.gen.completion_tokens for c in choices[p:p + n]))


async def usage(choices: list[Choice]) -> UsageInfo:
    """Prompt tokens once per prompt (its n choices share it), completion tokens of every choice; the
    cached prompt tokens as the prompt's first choice found them (once its PrefillDone arrived)."""
    await asyncio.gather(*(c.gen.settle() for c in choices))
    prompts: dict[int, tuple[int, int]] = {}
    for c in choices:
        prompts.setdefault(id(c.prompt_ids), (len(c.prompt_ids), min(c.gen.cached_tokens, len(c.prompt_ids))))
    return UsageInfo.of(sum(n for n, _ in prompts.values()), sum(c.gen.completion_tokens for c in choices),
                        sum(k for _, k in prompts.values()))
