"""The OpenAI-compatible HTTP gateway (FastAPI): tokenize, hand to the router, stream text back.

`build_app(gateway)` returns the FastAPI app; `Gateway` holds what the endpoints share (tokenizer,
router client, token stream, metrics) and owns their start/stop through the app's lifespan. Several
gateway processes serve one port (deploy/api_server.py); each has its own token sink.

Per request the gateway tokenizes (chat template for /v1/chat/completions), resolves the sampling
seed, and submits a `GenerateRequest` naming its token sink (`reply_to`) to the one router over its
channel (router/router_client.py); admission and placement errors become HTTP status codes before
any byte of the response is sent. Text then arrives straight from the decode worker, already
detokenized with stop strings applied there (decode_worker/token_publisher.py): this event loop only
frames SSE events. A client that goes away or an error ends the request with `finish(abort=True)`,
which frees its KV blocks on every worker; a worker's death migrates it (`Generation._recover`).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import random
import time
import uuid
from contextlib import asynccontextmanager
from typing import Annotated, AsyncIterator

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.errors import CapacityError, InvalidRequestError, PdserveError
from cluster.messages import GenerateRequest
from cluster.sampling_params import SamplingParams
from cluster.stream_messages import DeltaLogprobs, StreamDelta
from cluster.tokenizer import encode_bad_words, encode_chat, encode_prompt
from router.admission import NoHealthyWorkerError, OverloadedError
from router.gateway_config import GatewayConfig
from router.metrics import CONTENT_TYPE, GatewayMetrics
from router.openai_protocol import (
    ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
    ChatResponseMessage, CompletionChoice, CompletionRequest, CompletionResponse, DeltaMessage, ErrorResponse,
    DetokenizeRequest, DetokenizeResponse, ModelCard, ModelList, TokenizeRequest, TokenizeResponse, UsageInfo,
    VersionResponse,
)
from router.openai_logprobs import CompletionLogprobsBuilder, PromptStart, chat_logprobs
from router.router import DrainingError
from router.router_client import RouterClient
from router.router_messages import Drain, PrefillDone, RequestFailed
from router.step_stats import DEFAULT_LIMIT, MAX_LIMIT
from router.token_stream import TokenMailbox, TokenStreamReceiver

log = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers


class GenerationError(Exception):
    """A worker failed the request after it was admitted (HTTP 500 / an error event in the stream)."""


def _printable(s: str | None) -> str | None:
    # A message or param may quote what the client sent: a lone surrogate in it could not be encoded
    # as UTF-8 JSON (a 500 instead of the error). Escaped, it can.
    return s if s is None else s.encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(e: APIError) -> JSONResponse:
    body = ErrorResponse.of(_printable(e.message), e.type, _printable(e.param), e.code).model_dump()
    return JSONResponse(body, status_code=e.status, headers=e.headers)


def _draining() -> APIError:
    return APIError(503, "the server is shutting down; retry on another replica", "service_unavailable",
                    code="draining", headers={"Retry-After": "1", "Connection": "close"})


def _api_error(e: Exception) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, InvalidRequestError):
        return APIError(400, str(e), "invalid_request_error", e.param)
    if isinstance(e, OverloadedError):
        return APIError(429, str(e), "rate_limit_error", code="rate_limit_exceeded",
                        headers={"Retry-After": str(e.retry_after_s)})
    if isinstance(e, CapacityError):
        return APIError(429, str(e), "rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": "1"})
    if isinstance(e, DrainingError):
        return _draining()
    if isinstance(e, NoHealthyWorkerError):
        return APIError(503, str(e), "service_unavailable", code="no_healthy_worker")
    if isinstance(e, GenerationError):
        return APIError(500, str(e), "internal_error")
    return APIError(500, f"internal error: {e.__class__.__name__}: {e}", "internal_error")


class Generation:
    """One admitted request from the gateway's side: text pieces out of its mailbox."""

    def __init__(self, gw: "Gateway", req: GenerateRequest, mailbox: TokenMailbox):
        self.gw = gw
        self.request_id = req.request_id
        self.worker_request_id = req.request_id  # changes when a worker's death moves the request
        self.arrival = req.arrival_time
        self.mailbox = mailbox
        self.params = req.params
        self.prompt_tokens = len(req.prompt_token_ids)
        self.generated: list[int] = []  # every token id the client got (what a migration resumes from)
        self.emitted_chars = 0  # ... and how many characters of text
        self.migrations = 0
        self.first_token_time: float | None = None
        self.finish_reason: str | None = None
        self.cached_tokens = 0  # of the prompt, from a prefix cache (PrefillDone)
        self.prefilled = asyncio.Event()
        self.closing = False  # the gateway itself ends it (drain timeout, stop): an error is final
        self.admitted = False  # the router took it (a refused one is counted as rejected, not here)
        self.prompt_logprobs: tuple | None = None  # from the first delta, when asked (prompt_logprobs)

    @property
    def completion_tokens(self) -> int:
        return len(self.generated)

    async def settle(self, timeout_s: float = 5.0) -> None:
        """Waits for PrefillDone, which says how much of the prompt was cached (the usage's
        prompt_tokens_details): a prefill worker's answer may reach the router after the decode
        worker's tokens reached us."""
        try:
            await asyncio.wait_for(self.prefilled.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass

    async def pieces(self) -> AsyncIterator[tuple[str, str | None, DeltaLogprobs | None]]:
        """Yields (new text, finish reason or None, the new tokens' logprobs or None); the last piece
        carries the finish reason. A piece may have logprobs and no text (held-back bytes)."""
        gw, m = self.gw, self.gw.metrics
        last = None
        abort = True  # unless a worker itself finished the request
        try:
            while True:
                d = await self.mailbox.next()
                if d.token_ids:
                    now = time.time()
                    if last is None:
                        m.ttft.observe(now - self.arrival)
                        self.first_token_time = now
                        gw.client.first_token(self.request_id, now)
                    else:
                        m.itl.observe(now - last)
                    last = now
                    self.generated.extend(d.token_ids)
                text, finish, logprobs = d.text, d.finish_reason, d.logprobs
                if logprobs is not None and logprobs.prompt is not None and self.prompt_logprobs is None:
                    self.prompt_logprobs = logprobs.prompt  # a migrated request's second copy is ignored
                if finish == "error" or d.error is not None:
                    if self.closing:  # ended by this gateway: nothing to recover, the router may be gone
                        end = ("error", d.error)
                    else:
                        end = await self._recover(d.error or "the decode worker failed the request")
                    if end is None:  # placed again: the tokens read with the failure still go out
                        if text or (logprobs is not None and logprobs.tokens):
                            self.emitted_chars += len(text)
                            yield text, None, logprobs
                        continue
                    finish, error = end
                    if finish == "error":
                        self.finish_reason = "error"
                        raise GenerationError(error or "the decode worker failed the request")
                if text or finish is not None or (logprobs is not None and logprobs.tokens):
                    self.emitted_chars += len(text)
                    self.finish_reason = finish
                    yield text, finish, logprobs
                if finish is not None:  # the worker (or the router) finished it: nothing to abort
                    abort = False
                    m.e2e.observe(time.time() - self.arrival)
                    m.generation_tokens.inc(self.completion_tokens)
                    m.finished(finish, self.prompt_tokens, self.completion_tokens)
                    return
        finally:
            # Also on cancellation (the client went away): frees the request's KV blocks everywhere.
            gw.end(self, abort)

    async def _recover(self, error: str) -> tuple[str, str | None] | None:
        """A worker failed the request: the router places it again if that worker died (None: go on
        reading the same mailbox), else says how it ends."""
        ts = self.gw.token_stream
        ts.unregister(self.worker_request_id)  # nothing more from that placement may reach the client
        self.migrations += 1
        wrid = f"{self.request_id}.m{self.migrations}"
        ts.attach(wrid, self.mailbox)  # before the router places it: its first token may come at once
        end = await self.gw.client.migrate(self.request_id, wrid, tuple(self.generated), self.emitted_chars, error)
        if end is None:
            self.worker_request_id = wrid
        else:
            ts.unregister(wrid)
        return end


class Gateway:
    def __init__(self, cfg: GatewayConfig, tokenizer, client: RouterClient, token_stream: TokenStreamReceiver,
                 metrics: GatewayMetrics):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.client = client
        self.token_stream = token_stream
        self.metrics = metrics
        self.active: dict[str, Generation] = {}
        self._rng = random.Random()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.draining = False  # set by drain(): new requests get 503, /ready is false
        self.on_drained = lambda left: None  # the API-server process stops its HTTP server here
        client.on_failed = self._request_failed
        client.on_prefilled = self._prefilled
        client.on_drain = self._drain_requested
        client.status = lambda: (token_stream.open_streams, len(asyncio.all_tasks()), self.draining)

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.token_stream.start()
        await self.client.start()

    async def stop(self) -> None:
        for gen in list(self.active.values()):
            self.end(gen, abort=True)
        await self.client.stop()
        await self.token_stream.stop()

    @property
    def ready(self) -> bool:
        """The router is ready (every worker polled, a decode worker healthy) and every gateway
        process is up, and this one is not draining."""
        st = self.client.state
        return (not self.draining and self.client.connected and st is not None and st.ready
                and st.gateways_up >= st.gateways_expected)

    def end(self, gen: Generation, abort: bool) -> None:
        """The request is over for this gateway (safe to call twice)."""
        if self.active.pop(gen.request_id, None) is None:
            return
        if abort and gen.admitted:
            # Cancelled (the client left, a sibling choice failed, drain) or failed: counted here, once,
            # with the tokens it streamed; a request a worker finished was counted by pieces().
            self.metrics.finished("error" if gen.finish_reason == "error" else "abort", gen.prompt_tokens,
                                  gen.completion_tokens)
            self.metrics.generation_tokens.inc(gen.completion_tokens)
        self.token_stream.unregister(gen.worker_request_id)
        self.client.finish(gen.request_id, abort, gen.first_token_time, gen.completion_tokens)

    def _request_failed(self, msg: RequestFailed) -> None:
        """A worker of the request died or failed it: drop that placement's late tokens, then let
        the reader see the failure (it asks the router to migrate the request)."""
        self.token_stream.push(StreamDelta(msg.worker_request_id, (), "", "error", msg.error))
        self.token_stream.unregister(msg.worker_request_id)

    def _prefilled(self, msg: PrefillDone) -> None:
        gen = self.active.get(msg.request_id)
        if gen is not None:
            gen.cached_tokens = msg.cached_tokens
            gen.prefilled.set()

    def _drain_requested(self, msg: Drain) -> None:
        if not self.draining:
            self.draining = True
            asyncio.get_running_loop().create_task(self._drain_then_notify(msg.timeout_s), name="drain")

    async def _drain_then_notify(self, timeout_s: float) -> None:
        left = await self.drain(timeout_s)
        self.on_drained(left)

    async def drain(self, timeout_s: float) -> int:
        """Stops admission, then waits up to `timeout_s` for the in-flight requests to finish;
        returns how many were still running (each ends with a clear error event)."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.active and loop.time() < deadline:
            await asyncio.sleep(0.05)
        left = len(self.active)
        self.end_all(f"the server shut down (drain timeout {timeout_s:g}s) before the request finished")
        return left

    def end_all(self, error: str) -> None:
        """Ends every request in flight with `error`: an error event and [DONE] on a stream, a 500 on a
        non-streaming request; each is aborted on its workers. New requests get 503 from now on."""
        self.draining = True
        for gen in list(self.active.values()):
            gen.closing = True
            self.token_stream.push(StreamDelta(gen.worker_request_id, (), "", "error", error))

    async def stop_requests(self, error: str, timeout_s: float) -> int:
        """A stop (a second SIGTERM, SIGINT): `end_all`, then waits up to `timeout_s` for the requests
        to hand their last events to their responses; returns how many were ended."""
        n = len(self.active)
        self.end_all(error)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.active and loop.time() < deadline:
            await asyncio.sleep(0.02)
        return n

    # -- request building -------------------------------------------------------------------------
    def _check_accepting(self) -> None:
        if self.draining:
            raise _draining()

    def _check_model(self, name: str) -> None:
        if name != self.cfg.model_name:
            raise APIError(404, f"The model `{name}` does not exist.", "invalid_request_error", "model",
                           "model_not_found")

    def _kv_capacity_tokens(self) -> int:
        st = self.client.state
        return st.kv_capacity_tokens if st is not None else 0

    def _params(self, body, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None) -> SamplingParams:
        bias = ()
        if body.logit_bias:
            try:
                bias = {int(k): v for k, v in body.logit_bias.items()}
            except ValueError:
                raise InvalidRequestError("logit_bias keys must be token ids", "logit_bias") from None
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=0 if body.top_k is None else body.top_k,
            min_p=0.0 if body.min_p is None else body.min_p,
            seed=body.seed, stop=body.stop_strings, stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos, min_tokens=body.min_tokens,
            presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            logit_bias=bias, allowed_token_ids=body.allowed_token_ids,
            bad_words_token_ids=encode_bad_words(self.tokenizer, body.bad_words) if body.bad_words else (),
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        )
        params.check_token_ids(self.cfg.vocab_size or len(self.tokenizer))
        return params

    async def start_generation(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                               seed: int | None = None) -> Generation:
        """`seed`: the sampling seed if not params.seed (choice i of a seeded request: seed + i)."""
        if seed is None:
            seed = params.seed if params.seed is not None else self._rng.randrange(2**63)
        req = GenerateRequest(request_id, tuple(prompt_ids), params, seed, time.time(),
                              reply_to=self.token_stream.address)
        mailbox = self.token_stream.register(request_id)  # before the router places it
        gen = Generation(self, req, mailbox)
        self.active[request_id] = gen
        try:
            await self.client.submit(req)
            gen.admitted = True
        except BaseException:
            # Refused (nothing to undo), or the client left while it was being placed: the router
            # undoes whatever placement it made.
            self.end(gen, abort=True)
            raise
        return gen

    async def completion(self, body: CompletionRequest, request: Request) -> Response:
        return await self._serve(_COMPLETIONS, body, request)

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        return await self._serve(_CHAT, body, request)

    async def _serve(self, api: "_Endpoint", body, request: Request) -> Response:
        """Both endpoints: checks, tokenize, admit and place every choice, then stream SSE events or
        collect. A request's choices are independent generations (one per prompt and per n): choice
        `p * n + i` is prompt p's i-th, sampled with seed + i when the request has a seed (as vLLM),
        so it equals the single request with that seed."""
        self._check_accepting()
        self._check_model(body.model)
        body.check_unsupported()
        prompts = [(p, api.encode(self, p)) for p in api.prompts(body)]
        num_logprobs = api.num_logprobs(body)
        echo = api.echo(body)
        rid = f"{api.id_prefix}-{uuid.uuid4().hex}"
        single = len(prompts) * body.n == 1

        async def place_all() -> list[_Choice]:
            choices: list[_Choice] = []
            try:
                for p, (prompt, ids) in enumerate(prompts):
                    params = self._params(body, api.max_tokens(self, body, ids), num_logprobs,
                                          num_logprobs if echo else None)
                    echo_text = (prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)) if echo else None
                    for i in range(body.n):
                        index = p * body.n + i
                        seed = None if body.seed is None else (body.seed + i) % 2**63
                        gen = await self.start_generation(rid if single else f"{rid}-{index}", ids, params, seed)
                        choices.append(_Choice(index, gen, ids, echo_text, self.tokenizer))
            except BaseException:
                for c in choices:  # a later choice refused (429, ...) or the client left: none of them runs
                    self.end(c.gen, abort=True)
                raise
            return choices

        def end_all(choices: list[_Choice]) -> None:
            for c in choices:
                self.end(c.gen, abort=True)  # a no-op for a choice that finished

        choices = await _unless_gone(request, place_all(), end_all)
        if choices is None:
            return Response(status_code=499)  # the client left while its request waited for a worker
        if body.stream:
            # The request is let go however the stream ends, even when the client left before the
            # body iterator ever started (then Generation.pieces() never runs its cleanup).
            return _sse(self._events(api, choices, rid, body), on_close=lambda: end_all(choices))

        async def collect():
            tasks = [asyncio.ensure_future(c.collect()) for c in choices]
            try:
                results = await asyncio.gather(*tasks)
            finally:  # one failed (or the client left): the others stop too, and abort
                for t in tasks:
                    t.cancel()
            return api.response(rid, body, choices, results, await _usage(choices))
        return await _unless_disconnected(request, collect())

    async def _events(self, api: "_Endpoint", choices: list["_Choice"], rid: str, body) -> AsyncIterator[str]:
        fmt = api.chunks(rid, body, int(time.time()))
        try:
            for c in choices:
                for event in fmt.opening(c.index):
                    yield event
            if len(choices) == 1:  # the common case: no task, no queue
                c = choices[0]
                async for text, finish, positions in c.pieces():
                    yield fmt.piece(c.index, text, finish, positions)
            else:
                async for index, (text, finish, positions) in _merged(choices):
                    yield fmt.piece(index, text, finish, positions)
            if body.include_usage:
                yield fmt.usage(await _usage(choices))
        except GenerationError as e:
            yield _event(ErrorResponse.of(str(e), "internal_error", code=500).model_dump_json())
        yield "data: [DONE]\n\n"


class _Choice:
    """One choice of a response: its generation, and what echo puts before its text."""

    def __init__(self, index: int, gen: Generation, prompt_ids: list[int], echo: str | None, tokenizer):
        self.index = index
        self.gen = gen
        self.prompt_ids = prompt_ids
        self.echo = echo  # the prompt's text (echo), else None
        self.tokenizer = tokenizer

    async def pieces(self) -> AsyncIterator[tuple[str, str | None, list]]:
        """(text, finish reason or None, logprob positions of the piece's tokens); with echo, the first
        piece starts with the prompt's text and (when logprobs are asked) the prompt's logprobs."""
        first = self.echo is not None
        async for text, finish, lp in self.gen.pieces():
            positions = list(lp.tokens) if lp is not None else []
            if first:
                first = False
                text = self.echo + text
                if self.gen.params.prompt_logprobs is not None:
                    positions = self._prompt_positions() + positions
            yield text, finish, positions

    def _prompt_positions(self) -> list:
        prompt = self.gen.prompt_logprobs
        if prompt is None or len(prompt) < len(self.prompt_ids):
            raise GenerationError("the worker sent no prompt logprobs")
        # The first prompt token has no logprob (nothing precedes it): its string only.
        return [PromptStart(self.tokenizer.decode([self.prompt_ids[0]]))] + list(prompt[1:len(self.prompt_ids)])

    async def collect(self) -> tuple[str, list]:
        text, positions = [], []
        async for t, _, lp in self.pieces():
            text.append(t)
            positions.extend(lp)
        return "".join(text), positions


async def _merged(choices: list[_Choice]) -> AsyncIterator[tuple[int, tuple]]:
    """Every choice's pieces as they come, tagged with the choice's index. Cancelling the consumer
    (the client left) cancels every reader, whose cleanup aborts its generation."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def read(c: _Choice):
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


async def _usage(choices: list[_Choice]) -> UsageInfo:
    """Prompt tokens once per prompt (its n choices share it), completion tokens of every choice; the
    cached prompt tokens as the prompt's first choice found them (once its PrefillDone arrived)."""
    await asyncio.gather(*(c.gen.settle() for c in choices))
    prompts: dict[int, tuple[int, int]] = {}
    for c in choices:
        prompts.setdefault(id(c.prompt_ids), (len(c.prompt_ids), min(c.gen.cached_tokens, len(c.prompt_ids))))
    return UsageInfo.of(sum(n for n, _ in prompts.values()), sum(c.gen.completion_tokens for c in choices),
                        sum(k for _, k in prompts.values()))


class _Endpoint:
    """What differs between /v1/completions and /v1/chat/completions; everything else is shared."""

    id_prefix: str

    def prompts(self, body) -> list:
        """The request's prompts, each as the client sent it."""
        raise NotImplementedError

    def encode(self, gw: Gateway, prompt) -> list[int]:
        raise NotImplementedError

    def max_tokens(self, gw: Gateway, body, ids: list[int]) -> int:
        raise NotImplementedError

    def num_logprobs(self, body) -> int | None:
        """SamplingParams.logprobs for this body (None: no logprobs)."""
        raise NotImplementedError

    def echo(self, body) -> bool:
        return False

    def response(self, rid: str, body, choices: list[_Choice], results: list[tuple[str, list]], usage: UsageInfo):
        """results: each choice's (text, logprob positions; empty unless asked)."""
        raise NotImplementedError

    def chunks(self, rid: str, body, created: int) -> "_ChunkFormat":
        raise NotImplementedError


class _ChunkFormat:
    def opening(self, index: int) -> list[str]:
        return []

    def piece(self, index: int, text: str, finish: str | None, positions) -> str:
        """positions: the logprobs of this piece's tokens (empty unless asked)."""
        raise NotImplementedError

    def usage(self, usage: UsageInfo) -> str:
        raise NotImplementedError


class _CompletionsEndpoint(_Endpoint):
    id_prefix = "cmpl"

    def prompts(self, body: CompletionRequest) -> list:
        return body.prompts()

    def encode(self, gw, prompt) -> list[int]:
        return encode_prompt(gw.tokenizer, prompt)

    def max_tokens(self, gw, body: CompletionRequest, ids) -> int:
        return body.max_tokens if body.max_tokens is not None else gw.cfg.default_max_tokens

    def num_logprobs(self, body: CompletionRequest) -> int | None:
        return body.logprobs

    def echo(self, body: CompletionRequest) -> bool:
        return bool(body.echo)

    def response(self, rid, body, choices, results, usage):
        out = []
        for c, (text, positions) in zip(choices, results):
            logprobs = CompletionLogprobsBuilder(body.logprobs).add(positions) if body.logprobs is not None else None
            out.append(CompletionChoice(index=c.index, text=text, logprobs=logprobs, finish_reason=c.gen.finish_reason))
        return CompletionResponse(id=rid, model=body.model, usage=usage, choices=out)

    def chunks(self, rid, body, created):
        return _CompletionChunks(rid, body, created)


class _CompletionChunks(_ChunkFormat):
    def __init__(self, rid: str, body: CompletionRequest, created: int):
        self.rid, self.body, self.created = rid, body, created
        # Hot path (one event per token per request): the chunk's fixed parts are encoded once and
        # only index, text and finish_reason are serialised per event (~1 us instead of ~12 through pydantic).
        self.head = (f'data: {{"id":{json.dumps(rid)},"object":"text_completion","created":{created},'
                     f'"model":{json.dumps(body.model)},"choices":[{{"index":')
        self.tail = ',"usage":null}\n\n' if body.include_usage else '}\n\n'
        self.logprobs: dict[int, CompletionLogprobsBuilder] = {}  # per choice (text offsets go on)

    def piece(self, index, text, finish, positions):
        lp = "null"
        if self.body.logprobs is not None:
            builder = self.logprobs.get(index)
            if builder is None:
                builder = self.logprobs[index] = CompletionLogprobsBuilder(self.body.logprobs)
            lp = builder.add(positions).model_dump_json()
        return (f'{self.head}{index},"text":{json.dumps(text)},"logprobs":{lp},'
                f'"finish_reason":{json.dumps(finish)}}}]{self.tail}')

    def usage(self, usage):
        chunk = CompletionResponse(id=self.rid, created=self.created, model=self.body.model, choices=[], usage=usage)
        return _event(chunk.model_dump_json())


class _ChatEndpoint(_Endpoint):
    id_prefix = "chatcmpl"

    def prompts(self, body: ChatCompletionRequest) -> list:
        return [body.messages]

    def encode(self, gw, messages) -> list[int]:
        return encode_chat(gw.tokenizer, [m.as_template_dict() for m in messages])

    def max_tokens(self, gw, body: ChatCompletionRequest, ids) -> int:
        max_tokens = body.requested_max_tokens
        if max_tokens is None:  # like vLLM: as much as the context (and the KV cache) leaves
            room = min(gw.cfg.max_model_len, gw._kv_capacity_tokens() or gw.cfg.max_model_len) - len(ids)
            max_tokens = max(1, room)
        return max_tokens

    def num_logprobs(self, body: ChatCompletionRequest) -> int | None:
        return body.num_logprobs

    def response(self, rid, body, choices, results, usage):
        out = []
        for c, (text, positions) in zip(choices, results):
            logprobs = chat_logprobs(positions, body.num_logprobs) if body.num_logprobs is not None else None
            out.append(ChatChoice(index=c.index, message=ChatResponseMessage(content=text), logprobs=logprobs,
                                  finish_reason=c.gen.finish_reason))
        return ChatCompletionResponse(id=rid, model=body.model, usage=usage, choices=out)

    def chunks(self, rid, body, created):
        return _ChatChunks(rid, body, created)


class _ChatChunks(_ChunkFormat):
    def __init__(self, rid: str, body: ChatCompletionRequest, created: int):
        self.rid, self.body, self.created = rid, body, created

    def _chunk(self, index: int, delta: DeltaMessage, finish: str | None, positions=()) -> str:
        logprobs = None
        if self.body.num_logprobs is not None and positions:
            logprobs = chat_logprobs(positions, self.body.num_logprobs)
        c = ChatCompletionChunk(id=self.rid, created=self.created, model=self.body.model,
                                choices=[ChatChunkChoice(index=index, delta=delta, logprobs=logprobs,
                                                         finish_reason=finish)])
        d = c.model_dump(exclude_none=True)
        d["choices"][0]["finish_reason"] = finish  # always present, null until the end
        if self.body.include_usage:
            d["usage"] = None
        return _event(json.dumps(d, separators=(",", ":")))

    def opening(self, index):
        return [self._chunk(index, DeltaMessage(role="assistant", content=""), None)]

    def piece(self, index, text, finish, positions):
        return self._chunk(index, DeltaMessage(content=text) if text else DeltaMessage(), finish, positions)

    def usage(self, usage):
        c = ChatCompletionChunk(id=self.rid, created=self.created, model=self.body.model, choices=[], usage=usage)
        return _event(c.model_dump_json())

_COMPLETIONS, _CHAT = _CompletionsEndpoint(), _ChatEndpoint()


def _event(data: str) -> str:
    return f"data: {data}\n\n"


def _sse(chunks: AsyncIterator[str], on_close=None) -> StreamingResponse:
    # Starlette cancels the iterator when the client disconnects; Generation.pieces() then aborts.
    # on_close runs after the response, however it ended (Starlette runs the background task then).
    return StreamingResponse(chunks, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                             background=BackgroundTask(on_close) if on_close is not None else None)


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_gone(request: Request, work, on_gone):
    """Awaits `work` (admission and placement, which may wait for a decode worker with room) while
    watching the connection. A client that hangs up meanwhile cancels it (start_generation's cleanup
    tells the router, which cancels the placement, releases the admission ticket and aborts whatever
    a worker took), so a gone client stops counting as waiting at once. Returns None when the client
    went (`on_gone(result)` lets go of a request placed just as it left)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    if not task.cancelled() and task.exception() is None:
        on_gone(task.result())
    return None


async def _unless_disconnected(request: Request, work) -> Response:
    """Runs a non-streaming request while watching its connection: a client that hangs up cancels
    the work (whose cleanup aborts the request on the workers)."""
    task = asyncio.ensure_future(work)

    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        try:
            result = task.result()
        except GenerationError as e:
            raise APIError(500, str(e), "internal_error") from None
        return JSONResponse(result.model_dump())
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return Response(status_code=499)  # nobody reads it; nginx's "client closed request"


def check_api_key(authorization: str, key: str) -> bool:
    """`Authorization: Bearer <key>`, compared in constant time."""
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(given.strip().encode(), key.encode())


# Paths behind the API key; /health, /ready, /metrics, /version and the schema stay open for probes.
KEYED_PATHS = ("/v1", "/tokenize", "/detokenize", "/stats")


class APIKeyAuth:
    """ASGI middleware: every request to KEYED_PATHS without the API key gets 401 before anything reads its
    body, so an unauthenticated client learns nothing from validation (not even that its JSON is
    invalid) and never costs a parse. The outermost middleware: before the body-size limit too."""

    def __init__(self, app, key: str | None, on_refused=lambda: None):
        self.app = app
        self.key = key
        self.on_refused = on_refused

    async def __call__(self, scope, receive, send):
        if self.key and scope["type"] == "http" and scope["path"].startswith(KEYED_PATHS):
            auth = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
            if not check_api_key(auth.decode("latin-1"), self.key):
                self.on_refused()
                resp = error_response(APIError(401, "Incorrect API key provided.", "authentication_error",
                                               code="invalid_api_key"))
                return await resp(scope, receive, send)
        return await self.app(scope, receive, send)


class BodySizeLimit:
    """ASGI middleware: refuses request bodies above `max_bytes` with a 413 before the app parses them."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        for k, v in scope.get("headers", ()):
            if k == b"content-length" and v.isdigit() and int(v) > self.max_bytes:
                return await self._too_large(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # disconnected while sending the body
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._too_large(scope, receive, send)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()
        await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send):
        resp = error_response(APIError(413, f"request body is larger than {self.max_bytes} bytes",
                                       "invalid_request_error", code="request_too_large"))
        await resp(scope, receive, send)


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("pdserve")
    except Exception:  # noqa: BLE001 - not installed (a source checkout): the package's own
        return "0.1.0+source"


def build_app(gw: Gateway) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await gw.start()
        try:
            yield
        finally:
            await gw.stop()

    # /openapi.json is generated from the request models (router/openai_protocol.py); /docs renders it.
    app = FastAPI(title="pdserve", version=_version(), lifespan=lifespan, docs_url="/docs", redoc_url=None,
                  openapi_url="/openapi.json")
    app.add_middleware(BodySizeLimit, max_bytes=gw.cfg.max_body_bytes)
    app.add_middleware(APIKeyAuth, key=gw.cfg.api_key, on_refused=lambda: gw.metrics.rejected(401))  # outermost

    @app.exception_handler(APIError)
    async def _api(request: Request, e: APIError):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            msg, param = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".rstrip(": "), None
        else:
            msg = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid value')}"
            param = loc[0] if loc else None
        gw.metrics.rejected(400)
        return error_response(APIError(400, msg, "invalid_request_error", param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(APIError(e.status_code, str(e.detail), kind, headers=getattr(e, "headers", None)))

    async def _known(request: Request, e: Exception):
        err = _api_error(e)
        if err.status >= 400 and err.status != 404:
            gw.metrics.rejected(err.status)
        return error_response(err)

    # Specific classes go through Starlette's ExceptionMiddleware (answered, not re-raised);
    # the catch-all below is the last resort for bugs: a 500 with an OpenAI body, and a log line.
    app.add_exception_handler(PdserveError, _known)
    app.add_exception_handler(GenerationError, _known)

    @app.exception_handler(Exception)
    async def _other(request: Request, e: Exception):
        log.error("request failed", exc_info=e)
        return error_response(APIError(500, f"internal error: {e.__class__.__name__}", "internal_error"))

    v1 = APIRouter(prefix="/v1")  # the API key is checked before routing (APIKeyAuth)

    @v1.get("/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=gw.cfg.model_name, max_model_len=gw.cfg.max_model_len)])

    @v1.get("/models/{model_id:path}")  # a served name may contain '/'
    async def model(model_id: str) -> ModelCard:
        gw._check_model(model_id)
        return ModelCard(id=gw.cfg.model_name, max_model_len=gw.cfg.max_model_len)

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await gw.completion(body, request)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await gw.chat(body, request)

    app.include_router(v1)

    # vLLM's tokenizer endpoints (at the root, as vLLM serves them), behind the key (KEYED_PATHS).
    keyed = APIRouter()

    @keyed.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        if body.model is not None:
            gw._check_model(body.model)
        body.check()
        if body.messages is not None:
            ids = encode_chat(gw.tokenizer, [m.as_template_dict() for m in body.messages])
        else:
            ids = list(gw.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens).input_ids)
        return TokenizeResponse(count=len(ids), max_model_len=gw.cfg.max_model_len, tokens=ids)

    @keyed.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        if body.model is not None:
            gw._check_model(body.model)
        vocab = gw.cfg.vocab_size or len(gw.tokenizer)
        if not all(0 <= t < vocab for t in body.tokens):
            raise InvalidRequestError(f"tokens must be token ids in [0, {vocab})", "tokens")
        return DetokenizeResponse(prompt=gw.tokenizer.decode(body.tokens))

    @keyed.get("/stats")
    async def stats(cursor: Annotated[int, Query(ge=0)] = 0, limit: Annotated[int, Query(ge=1, le=MAX_LIMIT)] = DEFAULT_LIMIT):
        """Decode steps (batch size, bucket, padding, step time) and request timings recorded since
        `cursor` (at most `limit`), with the cursor to ask from next: built by the router, so the
        poll costs this event loop one frame in and one out."""
        return Response(await gw.client.query("stats", cursor, limit), media_type="application/json")

    app.include_router(keyed)

    @app.get("/version")
    async def version() -> VersionResponse:
        return VersionResponse(version=_version())

    @app.get("/health")
    async def health():
        st = gw.client.state
        healthy = st.healthy_decode if st is not None and gw.client.connected else 0
        body = {"status": "ok" if healthy else "unhealthy", "healthy_decode_workers": healthy,
                "healthy_prefill_workers": st.healthy_prefill if st is not None else 0}
        return JSONResponse(body, status_code=200 if healthy else 503)

    @app.get("/ready")
    async def ready():
        ok = gw.ready
        body = {"ready": ok, "draining": True} if gw.draining else {"ready": ok}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        router_text = await gw.client.query("metrics")
        return Response(gw.metrics.render() + router_text, media_type=CONTENT_TYPE)

    return app
