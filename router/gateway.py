"""The OpenAI-compatible HTTP gateway (FastAPI): tokenize, hand to the router, detokenize, stream.

`build_app(gateway)` returns the FastAPI app; `Gateway` holds what the endpoints share (tokenizer,
router, token stream, metrics) and owns their start/stop through the app's lifespan.

Per request the gateway tokenizes (chat template for /v1/chat/completions), resolves the sampling
seed, and submits a `GenerateRequest` to the router; admission and placement errors become HTTP
status codes before any byte of the response is sent. Token ids then arrive from the decode worker
over the token stream; the gateway detokenizes them incrementally and applies stop strings (a
decode worker only knows token-level stops). A stop string, a client that goes away, or an error
ends the request with `router.finish(abort=True)`, which frees its KV blocks on every worker.
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
from dataclasses import dataclass, replace
from typing import AsyncIterator

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.detokenizer import IncrementalDetokenizer
from cluster.errors import CapacityError, InvalidRequestError, PdserveError
from cluster.messages import GenerateRequest, TokenDelta
from cluster.sampling_params import SamplingParams
from cluster.tokenizer import encode_chat, encode_prompt
from router.admission import NoHealthyWorkerError, OverloadedError
from router.metrics import CONTENT_TYPE, ServingMetrics
from router.openai_protocol import (
    ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
    ChatResponseMessage, CompletionChoice, CompletionRequest, CompletionResponse, DeltaMessage, ErrorResponse,
    ModelCard, ModelList, UsageInfo,
)
from router.router import RequestStream, Router
from router.step_stats import StepStats
from router.token_stream import TokenStreamReceiver

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GatewayConfig:
    model_name: str
    max_model_len: int
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    token_timeout_s: float = 600.0  # no token for this long: the request fails (a stuck worker)
    default_max_tokens: int = 16  # /v1/completions without max_tokens (OpenAI's default)


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
    if isinstance(e, NoHealthyWorkerError):
        return APIError(503, str(e), "service_unavailable", code="no_healthy_worker")
    if isinstance(e, GenerationError):
        return APIError(500, str(e), "internal_error")
    return APIError(500, f"internal error: {e.__class__.__name__}: {e}", "internal_error")


class Generation:
    """One admitted request from the gateway's side: token ids in, text pieces out."""

    def __init__(self, gw: "Gateway", stream: RequestStream, stop: tuple[str, ...]):
        self.gw = gw
        self.stream = stream
        self.prompt_tokens = len(stream.request.prompt_token_ids)
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.detok = IncrementalDetokenizer(gw.tokenizer, list(stream.request.prompt_token_ids), stop)

    @property
    def usage(self) -> UsageInfo:
        return UsageInfo.of(self.prompt_tokens, self.completion_tokens)

    async def pieces(self) -> AsyncIterator[tuple[str, str | None]]:
        """Yields (new text, finish reason or None); the last piece carries the finish reason."""
        rid, m = self.stream.request_id, self.gw.metrics
        arrival = self.stream.request.arrival_time
        last = None
        abort = True  # unless a worker itself finished the request
        try:
            while True:
                try:
                    delta = await self.stream.get(self.gw.cfg.token_timeout_s)
                except asyncio.TimeoutError:
                    raise GenerationError(f"no token for {self.gw.cfg.token_timeout_s:g}s") from None
                if delta.finish_reason == "error" or delta.error:
                    raise GenerationError(delta.error or "the decode worker failed the request")
                now = time.time()
                if delta.token_ids:
                    if last is None:
                        m.ttft.observe(now - arrival)
                    else:
                        m.itl.observe(now - last)
                    last = now
                finish = None
                for tok in delta.token_ids:
                    self.completion_tokens += 1
                    self.detok.add(tok)
                    if self.detok.stopped:
                        finish = "stop"  # a stop string: the decode worker doesn't know, abort there
                        break
                if finish is None and delta.finish_reason is not None:
                    finish = delta.finish_reason
                    abort = False
                text = self.detok.take_new_text(final=finish is not None)
                if text or finish is not None:
                    self.finish_reason = finish
                    yield text, finish
                if finish is not None:
                    rs = self.stream
                    self.gw.step_stats.record_request(rid, arrival, rs.placed_time or arrival, rs.first_token_time,
                                                      time.time(), self.completion_tokens, rs.prefill_result,
                                                      rs.local_prefill)
                    m.e2e.observe(time.time() - arrival)
                    m.generation_tokens.inc(self.completion_tokens)
                    m.finished(finish)
                    return
        finally:
            # Also on cancellation (the client went away): frees the request's KV blocks everywhere.
            self.gw.router.finish(rid, abort=abort)


class Gateway:
    def __init__(self, cfg: GatewayConfig, tokenizer, router: Router, token_stream: TokenStreamReceiver,
                 metrics: ServingMetrics):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.router = router
        self.token_stream = token_stream
        self.metrics = metrics
        self.step_stats = StepStats()

        def on_batch(batch) -> None:
            metrics.observe_batch(batch)
            self.step_stats.record_batch(batch)

        token_stream.on_batch = on_batch
        self._rng = random.Random()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.draining = False  # set by drain(): new requests get 503, /ready is false

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()  # tests and the drain look at the loop's tasks
        self.token_stream.start()
        await self.router.start()

    async def drain(self, timeout_s: float) -> int:
        """Stops admission, then waits up to `timeout_s` for the in-flight requests to finish;
        returns how many are still running (the router aborts those when the gateway stops)."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.router.inflight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        left = list(self.router.inflight)
        for rid in left:  # each ends with a clear error event (or a 500) and is aborted on its workers
            self.token_stream.push(TokenDelta(rid, (), "error", f"the server shut down (drain timeout "
                                                                f"{timeout_s:g}s) before the request finished"))
        return len(left)

    async def stop(self) -> None:
        await self.router.stop()
        await self.token_stream.stop()

    # -- request building -------------------------------------------------------------------------
    def _check_accepting(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down; retry on another replica", "service_unavailable",
                           code="draining", headers={"Retry-After": "1", "Connection": "close"})

    def _check_model(self, name: str) -> None:
        if name != self.cfg.model_name:
            raise APIError(404, f"The model `{name}` does not exist.", "invalid_request_error", "model",
                           "model_not_found")

    def _kv_capacity_tokens(self) -> int:
        views = [v for v in self.router.decode_views() if v.healthy]
        return max((v.total_blocks for v in views), default=0) * self.router.admission.limits.block_size

    def _params(self, body, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=0 if body.top_k is None else body.top_k,
            seed=body.seed, stop=body.stop_strings, stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos, min_tokens=body.min_tokens,
        )

    async def start_generation(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> Generation:
        seed = params.seed if params.seed is not None else self._rng.randrange(2**63)
        # Stop strings stay here (the gateway applies them); workers see token-level stops only.
        req = GenerateRequest(request_id, tuple(prompt_ids), replace(params, stop=()), seed, time.time())
        stream = await self.router.submit(req)
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        return Generation(self, stream, params.stop)

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
        params = self._params(body, max_tokens)
        self.router.admission.check_request(len(ids), max_tokens)
        rid = f"{api.id_prefix}-{uuid.uuid4().hex}"
        gen = await self.start_generation(rid, ids, params)
        if body.stream:
            return _sse(self._events(api, gen, rid, body))

        async def collect():
            text = "".join([t async for t, _ in gen.pieces()])
            return api.response(rid, body, text, gen)
        return await _unless_disconnected(request, collect())

    async def _events(self, api: "_Endpoint", gen: Generation, rid: str, body) -> AsyncIterator[str]:
        fmt = api.chunks(rid, body, int(time.time()))
        try:
            for event in fmt.opening():
                yield event
            async for text, finish in gen.pieces():
                yield fmt.piece(text, finish)
            if body.include_usage:
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

    def response(self, rid: str, body, text: str, gen: Generation):
        raise NotImplementedError

    def chunks(self, rid: str, body, created: int) -> "_ChunkFormat":
        raise NotImplementedError


class _ChunkFormat:
    def opening(self) -> list[str]:
        return []

    def piece(self, text: str, finish: str | None) -> str:
        raise NotImplementedError

    def usage(self, usage: UsageInfo) -> str:
        raise NotImplementedError


class _CompletionsEndpoint(_Endpoint):
    id_prefix = "cmpl"

    def prompt_ids(self, gw, body: CompletionRequest) -> list[int]:
        return encode_prompt(gw.tokenizer, body.single_prompt())

    def max_tokens(self, gw, body: CompletionRequest, ids) -> int:
        return body.max_tokens if body.max_tokens is not None else gw.cfg.default_max_tokens

    def response(self, rid, body, text, gen):
        return CompletionResponse(id=rid, model=body.model, usage=gen.usage, choices=[
            CompletionChoice(text=text, finish_reason=gen.finish_reason)])

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

    def piece(self, text, finish):
        return f'{self.head}{json.dumps(text)},"logprobs":null,"finish_reason":{json.dumps(finish)}}}]{self.tail}'

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

    def response(self, rid, body, text, gen):
        return ChatCompletionResponse(id=rid, model=body.model, usage=gen.usage, choices=[
            ChatChoice(message=ChatResponseMessage(content=text), finish_reason=gen.finish_reason)])

    def chunks(self, rid, body, created):
        return _ChatChunks(rid, body, created)


class _ChatChunks(_ChunkFormat):
    def __init__(self, rid: str, body: ChatCompletionRequest, created: int):
        self.rid, self.body, self.created = rid, body, created

    def _chunk(self, delta: DeltaMessage, finish: str | None) -> str:
        c = ChatCompletionChunk(id=self.rid, created=self.created, model=self.body.model,
                                choices=[ChatChunkChoice(delta=delta, finish_reason=finish)])
        d = c.model_dump(exclude_none=True)
        d["choices"][0]["finish_reason"] = finish  # always present, null until the end
        if self.body.include_usage:
            d["usage"] = None
        return _event(json.dumps(d, separators=(",", ":")))

    def opening(self):
        return [self._chunk(DeltaMessage(role="assistant", content=""), None)]

    def piece(self, text, finish):
        return self._chunk(DeltaMessage(content=text) if text else DeltaMessage(), finish)

    def usage(self, usage):
        c = ChatCompletionChunk(id=self.rid, created=self.created, model=self.body.model, choices=[], usage=usage)
        return _event(c.model_dump_json())


_COMPLETIONS, _CHAT = _CompletionsEndpoint(), _ChatEndpoint()


def _event(data: str) -> str:
    return f"data: {data}\n\n"


def _sse(chunks: AsyncIterator[str]) -> StreamingResponse:
    # Starlette cancels the iterator when the client disconnects; Generation.pieces() then aborts.
    return StreamingResponse(chunks, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _unless_disconnected(request: Request, work) -> Response:
    """Runs a non-streaming request while watching its connection: a client that hangs up cancels
    the work (whose cleanup aborts the request on the workers)."""
    task = asyncio.ensure_future(work)

    async def disconnected():
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(disconnected())
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

    def check_api_key(request: Request) -> None:
        key = gw.cfg.api_key
        if not key:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, given = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
            raise APIError(401, "Incorrect API key provided.", "authentication_error", code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

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
        healthy = sum(v.healthy for v in gw.router.decode_views())
        body = {"status": "ok" if healthy else "unhealthy", "healthy_decode_workers": healthy,
                "healthy_prefill_workers": sum(v.healthy for v in gw.router.prefill_views())}
        return JSONResponse(body, status_code=200 if healthy else 503)

    @app.get("/ready")
    async def ready():
        ok = gw.router.ready and not gw.draining
        body = {"ready": ok, "draining": True} if gw.draining else {"ready": ok}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/stats")
    async def stats(since: float = 0.0):
        """Recent decode steps (batch size, bucket, padding, step time) and request timings."""
        return JSONResponse(gw.step_stats.snapshot(since))

    @app.get("/metrics")
    async def metrics():
        gw.metrics.waiting.set(gw.router.admission.num_waiting)
        return Response(gw.metrics.render(), media_type=CONTENT_TYPE)

    return app
