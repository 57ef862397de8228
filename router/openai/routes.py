"""build_app: the FastAPI app of one gateway process, its routes, error handlers and middleware.

    /v1/models, /v1/models/{id}                    the one served model
    /v1/completions, /v1/chat/completions          router/openai/serving_completion.py, serving_chat.py
    /tokenize, /detokenize                         vLLM's tokenizer endpoints (at the root, as vLLM)
    /stats                                         decode steps and request timings, from the router
    /metrics                                       Prometheus text (the gateways' and the router's)
    /version, /health, /ready                      open to probes (no API key)

/v1, /tokenize, /detokenize, /stats and /metrics are behind the API key when one is set
(middleware.KEYED_PATHS; Prometheus scrapes with `authorization: {credentials_file: ...}`).
/tokenize and /detokenize work on the tokenizer threads (Gateway.off_loop) and take at most
max_model_len tokens (a text longer than that is refused after tokenizing, off the loop). Every error
answers in OpenAI's shape through router/openai/errors.py; a refusal of the cluster (a 4xx or 5xx
other than 404) is counted in the metrics by status. The app's lifespan starts and stops the Gateway.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.errors import InvalidRequestError, PdserveError
from cluster.text.tokenizer import encode_chat
from router.stats.metrics import CONTENT_TYPE
from router.openai.errors import APIError, api_error, error_response, http_error, invalid_body, unexpected_error
from router.openai.gateway import Gateway
from router.openai.json_body import JSONBodyRoute
from router.openai.middleware import APIKeyAuth, BodySizeLimit, ReceivedStamp
from router.openai.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from router.openai.protocol_responses import (DetokenizeResponse, ModelCard, ModelList, TokenizeResponse,
                                              VersionResponse)
from router.openai.serving_chat import OpenAIServingChat
from router.openai.serving_completion import OpenAIServingCompletion
from router.stats.step_stats import DEFAULT_LIMIT, MAX_LIMIT

log = logging.getLogger(__name__)


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("pdserve")
    except Exception:  # noqa: BLE001 - not installed (a source checkout): the package's own
        return "0.1.0+source"


def _model_card(gw: Gateway) -> ModelCard:
    c = gw.cfg
    return ModelCard(id=c.model_name, max_model_len=c.max_model_len, dtype=c.dtype, quantization=c.quantization,
                     kv_cache_dtype=c.kv_cache_dtype)


def build_app(gw: Gateway) -> FastAPI:
    serving_completion, serving_chat = OpenAIServingCompletion(gw), OpenAIServingChat(gw)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await gw.start()
        try:
            yield
        finally:
            await gw.stop()

    # /openapi.json is generated from the request and response models (router/openai/protocol.py,
    # protocol_responses.py); /docs renders it.
    app = FastAPI(title="pdserve", version=_version(), lifespan=lifespan, docs_url="/docs", redoc_url=None,
                  openapi_url="/openapi.json")
    app.add_middleware(BodySizeLimit, max_bytes=gw.cfg.max_body_bytes)
    app.add_middleware(APIKeyAuth, key=gw.cfg.api_key, on_refused=lambda: gw.metrics.rejected(401))
    app.add_middleware(ReceivedStamp)  # outermost: the server's TTFT starts here

    @app.exception_handler(APIError)
    async def _api(request: Request, e: APIError):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        gw.metrics.rejected(400)
        return error_response(invalid_body(e))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        return error_response(http_error(e))

    async def _known(request: Request, e: Exception):
        err = api_error(e)
        if err.status >= 400 and err.status != 404:
            gw.metrics.rejected(err.status)
        return error_response(err)

    # The error classes go through Starlette's ExceptionMiddleware (answered, not re-raised);
    # the catch-all below is the last resort for bugs: a 500 with an OpenAI body, and a log line.
    app.add_exception_handler(PdserveError, _known)

    @app.exception_handler(Exception)
    async def _other(request: Request, e: Exception):
        log.error("request failed", exc_info=e)
        return error_response(unexpected_error(e))

    # The API key is checked before routing (APIKeyAuth); bodies are parsed by msgspec (json_body.py).
    v1 = APIRouter(prefix="/v1", route_class=JSONBodyRoute)

    @v1.get("/models")
    async def models() -> ModelList:
        return ModelList(data=[_model_card(gw)])

    @v1.get("/models/{model_id:path}")  # a served name may contain '/'
    async def model(model_id: str) -> ModelCard:
        gw.check_model(model_id)
        return _model_card(gw)

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await serving_completion.serve(body, request)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await serving_chat.serve(body, request)

    app.include_router(v1)

    # vLLM's tokenizer endpoints (at the root, as vLLM serves them), behind the key (KEYED_PATHS).
    keyed = APIRouter(route_class=JSONBodyRoute)

    @keyed.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        if body.model is not None:
            gw.check_model(body.model)
        body.check()

        def encode() -> list[int]:
            if body.messages is not None:
                return encode_chat(gw.tokenizer, [m.as_template_dict() for m in body.messages])
            return list(gw.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens).input_ids)
        ids = await gw.off_loop(encode)
        # As for a prompt: nothing longer than the context is tokenized for a client (and echoed back).
        if len(ids) > gw.cfg.max_model_len:
            raise InvalidRequestError(f"the text is {len(ids)} tokens, more than the context length "
                                      f"({gw.cfg.max_model_len})", "messages" if body.messages is not None else "prompt")
        return TokenizeResponse(count=len(ids), max_model_len=gw.cfg.max_model_len, tokens=ids)

    @keyed.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        if body.model is not None:
            gw.check_model(body.model)
        if len(body.tokens) > gw.cfg.max_model_len:
            raise InvalidRequestError(f"at most {gw.cfg.max_model_len} tokens (the context length), got "
                                      f"{len(body.tokens)}", "tokens")
        vocab = gw.cfg.vocab_size or len(gw.tokenizer)
        if not all(0 <= t < vocab for t in body.tokens):
            raise InvalidRequestError(f"tokens must be token ids in [0, {vocab})", "tokens")
        return DetokenizeResponse(prompt=await gw.off_loop(gw.tokenizer.decode, body.tokens))

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
        if st is not None and st.workers_gone:
            body["workers_gone"] = list(st.workers_gone)
        return JSONResponse(body, status_code=200 if healthy else 503)

    @app.get("/ready")
    async def ready():
        # Ready while a decode worker serves; workers dead past their restart limit are named (the
        # cluster serves without them).
        ok = gw.ready
        body = {"ready": ok, "draining": True} if gw.draining else {"ready": ok}
        st = gw.client.state
        if st is not None and st.workers_gone:
            body["workers_gone"] = list(st.workers_gone)
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        router_text = await gw.client.query("metrics")
        return Response(gw.metrics.render() + router_text, media_type=CONTENT_TYPE)

    return app
