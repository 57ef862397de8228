"""The OpenAI-compatible HTTP layer of a gateway process (FastAPI), one concept per file:

    routes.py               build_app: the routes, error handlers and middleware of the app
    gateway.py              Gateway: what the endpoints share; start, stop, drain; a request's start and end
    serving.py              OpenAIServing: one request from body to response, shared by both endpoints
    serving_completion.py   /v1/completions: its prompts, defaults, response and chunks
    serving_chat.py         /v1/chat/completions: likewise, through the chat template
    generation.py           Generation: one admitted request's text pieces, and its migration recovery
    streaming.py            SSE framing and the watchers of a client's disconnect
    middleware.py           APIKeyAuth, BodySizeLimit
    errors.py               APIError and the one mapping of an error class to HTTP (api_error)
    protocol.py             the request bodies (pydantic; the OpenAPI schema)
    protocol_responses.py   the response bodies (pydantic; the OpenAPI schema)
    logprobs.py             logprobs in the two endpoints' shapes (and vLLM's prompt_logprobs)
    structured_fields.py    response_format / guided_* / structured_outputs -> the request's one constraint
    tool_calling.py         ToolCalling: a chat request's tools, tool_choice, and its reply's calls
    tool_parsers/           the tool-call formats by --tool-call-parser name (llama3_json, hermes, mistral)

Per request the gateway tokenizes (the chat template for /v1/chat/completions), resolves the
sampling seed and submits a `GenerateRequest` naming its token sink (`reply_to`) to the one router
over its channel (router/channel/); admission and placement errors become HTTP statuses before any
byte of the response is sent. Text then arrives straight from the decode worker, already
detokenized with stop strings applied there (decode_worker/token_publisher.py): this event loop
only frames SSE events. A client that goes away, or an error, ends the request with
`finish(abort=True)`, which frees its KV blocks on every worker; a worker's death migrates it.
"""
