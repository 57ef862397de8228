"""The OpenAI-compatible HTTP gateway (FastAPI): tokenize, hand to the router, stream text back.

`build_app(gateway)` returns the FastAPI app; `Gateway` holds what the endpoints share (tokenizer,
router client, token stream, metrics) and owns their start/stop through the app's lifespan. Several
gateway processes serve one port (cluster/app/api_server.py); each has its own token sink.

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
from dataclasses import dataclass
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
from router.metrics import CONTENT_TYPE, GatewayMetrics
from router.openai_protocol import (
    ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
    ChatResponseMessage, CompletionChoice, CompletionRequest, CompletionResponse, DeltaMessage, ErrorResponse,
    ModelCard, ModelList, UsageInfo,
)
from router.openai_logprobs import CompletionLogprobsBuilder, chat_logprobs
from router.router import DrainingError
from router.router_client import RouterClient
from router.router_messages import Drain, PrefillDone, RequestFailed
from router.step_stats import DEFAULT_LIMIT, MAX_LIMIT
from router.token_stream import TokenMailbox, TokenStreamReceiver

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GatewayConfig:
    model_name: str
    max_model_len: int
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    token_timeout_s: float = 600.0  # no token for this long: the request fails (a stuck worker)
    default_max_tokens: int = 16  # /v1/completions without max_tokens (OpenAI's default)
    vocab_size: int | None = None  # the model's (token ids in sampling parameters must be below it)


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers


class GenerationError(Exception):
    """A worker failed the request after it was admitted (HTTP 500 / an error event in the stream)."""


def error_response(e: APIError) -> JSONResponse:
    body = ErrorResponse.of(e.message, e.type, e.param, e.code).model_dump()
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
        self.prompt_tokens = len(req.prompt_token_ids)
        self.generated: list[int] = []  # every token id the client got (what a migration resumes from)
        self.emitted_chars = 0  # ... and how many characters of text
        self.migrations = 0
        self.first_token_time: float | None = None
        self.finish_reason: str | None = None
        self.cached_tokens = 0  # of the prompt, from a prefix cache (PrefillDone)
        self.prefilled = asyncio.Event()
        self.closing = False  # the gateway itself ends it (drain timeout, stop): an error is final
        self.prompt_logprobs: tuple | None = None  # from the first delta, when asked (prompt_logprobs)

    @property
    def completion_tokens(self) -> int:
        return len(self.generated)

    @property
    def usage(self) -> UsageInfo:
        return UsageInfo.of(self.prompt_tokens, self.completion_tokens, self.cached_tokens)

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

    def _params(self, body, max_tokens: int, logprobs: int | None) -> SamplingParams:
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
            logprobs=logprobs,
        )
        params.check_token_ids(self.cfg.vocab_size or len(self.tokenizer))
        return params

    async def start_generation(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> Generation:
        seed = params.seed if params.seed is not None else self._rng.randrange(2**63)
        req = GenerateRequest(request_id, tuple(prompt_ids), params, seed, time.time(),
                              reply_to=self.token_stream.address)
        mailbox = self.token_stream.register(request_id)  # before the router places it
        gen = Generation(self, req, mailbox)
        self.active[request_id] = gen
        try:
            await self.client.submit(req)
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
        """Both endpoints: checks, tokenize, admit and place, then stream SSE events or collect."""
        self._check_accepting()
        self._check_model(body.model)
        body.check_unsupported()
        ids = api.prompt_ids(self, body)
        max_tokens = api.max_tokens(self, body, ids)
        params = self._params(body, max_tokens, api.num_logprobs(body))
        rid = f"{api.id_prefix}-{uuid.uuid4().hex}"
        gen = await _unless_gone(request, self.start_generation(rid, ids, params), lambda g: self.end(g, abort=True))
        if gen is None:
            return Response(status_code=499)  # the client left while its request waited for a worker
        if body.stream:
            # The request is let go however the stream ends, even when the client left before the
            # body iterator ever started (then Generation.pieces() never runs its cleanup).
            return _sse(self._events(api, gen, rid, body), on_close=lambda: self.end(gen, abort=True))

        async def collect():
            text, positions = [], []
            async for t, _, lp in gen.pieces():
                text.append(t)
                if lp is not None:
                    positions.extend(lp.tokens)
            await gen.settle()
            return api.response(rid, body, "".join(text), gen, positions if params.logprobs is not None else None)
        return await _unless_disconnected(request, collect())

    async def _events(self, api: "_Endpoint", gen: Generation, rid: str, body) -> AsyncIterator[str]:
        fmt = api.chunks(rid, body, int(time.time()))
        try:
            for event in fmt.opening():
                yield event
            async for text, finish, logprobs in gen.pieces():
                yield fmt.piece(text, finish, logprobs.tokens if logprobs is not None else ())
            if body.include_usage:
                await gen.settle()
                yield fmt.usage(gen.usage)
        except GenerationError as e:
            yield _event(ErrorResponse.of(str(e), "internal_error", code=500).model_dump_json())
        yield "data: [DONE]\n\n"


class _Endpoint:
    """What differs between /v1/completions and /v1/chat/completions; everything else is shared."""

    id_prefix: str

    def prompt_ids(self, gw: Gateway, body) -> list[int]:
        raise NotImplementedError

    def max_tokens(self, gw: Gateway, body, ids: list[int]) -> int:
        raise NotImplementedError

    def num_logprobs(self, body) -> int | None:
        """SamplingParams.logprobs for this body (None: no logprobs)."""
        raise NotImplementedError

    def response(self, rid: str, body, text: str, gen: Generation, positions):
        """positions: every token's PositionLogprobs when logprobs were asked, else None."""
        raise NotImplementedError

    def chunks(self, rid: str, body, created: int) -> "_ChunkFormat":
        raise NotImplementedError


class _ChunkFormat:
    def opening(self) -> list[str]:
        return []

    def piece(self, text: str, finish: str | None, positions) -> str:
        """positions: the logprobs of this piece's tokens (empty unless asked)."""
        raise NotImplementedError

    def usage(self, usage: UsageInfo) -> str:
        raise NotImplementedError


class _CompletionsEndpoint(_Endpoint):
    id_prefix = "cmpl"

    def prompt_ids(self, gw, body: CompletionRequest) -> list[int]:
        return encode_prompt(gw.tokenizer, body.single_prompt())

    def max_tokens(self, gw, body: CompletionRequest, ids) -> int:
        return body.max_tokens if body.max_tokens is not None else gw.cfg.default_max_tokens

    def num_logprobs(self, body: CompletionRequest) -> int | None:
        return body.logprobs

    def response(self, rid, body, text, gen, positions):
        logprobs = None
        if positions is not None:
            logprobs = CompletionLogprobsBuilder(body.logprobs).add(positions)
        return CompletionResponse(id=rid, model=body.model, usage=gen.usage, choices=[
            CompletionChoice(text=text, logprobs=logprobs, finish_reason=gen.finish_reason)])

    def chunks(self, rid, body, created):
        return _CompletionChunks(rid, body, created)


class _CompletionChunks(_ChunkFormat):
    def __init__(self, rid: str, body: CompletionRequest, created: int):
        self.rid, self.body, self.created = rid, body, created
        # Hot path (one event per token per request): the chunk's fixed parts are encoded once and
        # only text and finish_reason are serialised per event (~1 us instead of ~12 through pydantic).
        self.head = (f'data: {{"id":{json.dumps(rid)},"object":"text_completion","created":{created},'
                     f'"model":{json.dumps(body.model)},"choices":[{{"index":0,"text":')
        self.tail = ',"usage":null}\n\n' if body.include_usage else '}\n\n'
        self.logprobs = CompletionLogprobsBuilder(body.logprobs) if body.logprobs is not None else None

    def piece(self, text, finish, positions):
        lp = "null" if self.logprobs is None else self.logprobs.add(positions).model_dump_json()
        return f'{self.head}{json.dumps(text)},"logprobs":{lp},"finish_reason":{json.dumps(finish)}}}]{self.tail}'

    def usage(self, usage):
        chunk = CompletionResponse(id=self.rid, created=self.created, model=self.body.model, choices=[], usage=usage)
        return _event(chunk.model_dump_json())


class _ChatEndpoint(_Endpoint):
    id_prefix = "chatcmpl"

    def prompt_ids(self, gw, body: ChatCompletionRequest) -> list[int]:
        return encode_chat(gw.tokenizer, [m.as_template_dict() for m in body.messages])

    def max_tokens(self, gw, body: ChatCompletionRequest, ids) -> int:
        max_tokens = body.requested_max_tokens
        if max_tokens is None:  # like vLLM: as much as the context (and the KV cache) leaves
            room = min(gw.cfg.max_model_len, gw._kv_capacity_tokens() or gw.cfg.max_model_len) - len(ids)
            max_tokens = max(1, room)
        return max_tokens

    def num_logprobs(self, body: ChatCompletionRequest) -> int | None:
        return body.num_logprobs

    def response(self, rid, body, text, gen, positions):
        logprobs = chat_logprobs(positions, body.num_logprobs) if positions is not None else None
        return ChatCompletionResponse(id=rid, model=body.model, usage=gen.usage, choices=[
            ChatChoice(message=ChatResponseMessage(content=text), logprobs=logprobs, finish_reason=gen.finish_reason)])

    def chunks(self, rid, body, created):
        return _ChatChunks(rid, body, created)


class _ChatChunks(_ChunkFormat):
    def __init__(self, rid: str, body: ChatCompletionRequest, created: int):
        self.rid, self.body, self.created = rid, body, created

    def _chunk(self, delta: DeltaMessage, finish: str | None, positions=()) -> str:
        logprobs = None
        if self.body.num_logprobs is not None and positions:
            logprobs = chat_logprobs(positions, self.body.num_logprobs)
        c = ChatCompletionChunk(id=self.rid, created=self.created, model=self.body.model,
                                choices=[ChatChunkChoice(delta=delta, logprobs=logprobs, finish_reason=finish)])
        d = c.model_dump(exclude_none=True)
        d["choices"][0]["finish_reason"] = finish  # always present, null until the end
        if self.body.include_usage:
            d["usage"] = None
        return _event(json.dumps(d, separators=(",", ":")))

    def opening(self):
        return [self._chunk(DeltaMessage(role="assistant", content=""), None)]

    def piece(self, text, finish, positions):
        return self._chunk(DeltaMessage(content=text) if text else DeltaMessage(), finish, positions)

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


class APIKeyAuth:
    """ASGI middleware: every /v1 request without the API key gets 401 before anything reads its
    body, so an unauthenticated client learns nothing from validation (not even that its JSON is
    invalid) and never costs a parse. The outermost middleware: before the body-size limit too."""

    def __init__(self, app, key: str | None, on_refused=lambda: None):
        self.app = app
        self.key = key
        self.on_refused = on_refused

    async def __call__(self, scope, receive, send):
        if self.key and scope["type"] == "http" and scope["path"].startswith("/v1"):
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


def build_app(gw: Gateway) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await gw.start()
        try:
            yield
        finally:
            await gw.stop()

    app = FastAPI(title="pdserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
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

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await gw.completion(body, request)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await gw.chat(body, request)

    app.include_router(v1)

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

    @app.get("/stats")
    async def stats(cursor: Annotated[int, Query(ge=0)] = 0, limit: Annotated[int, Query(ge=1, le=MAX_LIMIT)] = DEFAULT_LIMIT):
        """Decode steps (batch size, bucket, padding, step time) and request timings recorded since
        `cursor` (at most `limit`), with the cursor to ask from next: built by the router, so the
        poll costs this event loop one frame in and one out."""
        return Response(await gw.client.query("stats", cursor, limit), media_type="application/json")

    @app.get("/metrics")
    async def metrics():
        router_text = await gw.client.query("metrics")
        return Response(gw.metrics.render() + router_text, media_type=CONTENT_TYPE)

    return app
