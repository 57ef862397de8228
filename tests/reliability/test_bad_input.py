"""Bad input never reaches a worker and never costs a 5xx: each named case is a 4xx with an OpenAI
error body, a property-based fuzz of both request schemas (hypothesis) gets no 5xx, and the cluster
serves normally afterwards with nothing leaked."""

from __future__ import annotations

import json
import math
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reliability_harness import MODEL, is_openai_error, start_cluster, wait_clean

MAX_MODEL_LEN = 512
MAX_BODY = 64 << 10
FUZZ_EXAMPLES = 300
KEY = "sk-reliability-0123456789"


@pytest.fixture(scope="module")
def cluster(ray_session, demo_model_dir):
    # With a tool-call parser: the fuzz's tools reach the parser and the forced-call grammars.
    sc = start_cluster(demo_model_dir, max_model_len=MAX_MODEL_LEN, max_body_bytes=MAX_BODY, api_key=KEY,
                       tool_call_parser="hermes", enable_auto_tool_choice=True)
    yield sc
    sc.shutdown()


@pytest.fixture(scope="module")
def client(cluster):
    with httpx.Client(base_url=cluster.url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


def ok_completion(**kw):
    return {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, **kw}


def ok_chat(**kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kw}


NAMED_CASES = {
    "prompt over the context length": ("/v1/completions", ok_completion(prompt="word " * 2000), 400),
    "chat over the context length": ("/v1/chat/completions", ok_chat(messages=[{"role": "user", "content": "word " * 2000}]), 400),
    "max_tokens 0": ("/v1/completions", ok_completion(max_tokens=0), 400),
    "max_tokens negative": ("/v1/completions", ok_completion(max_tokens=-5), 400),
    "max_tokens huge": ("/v1/completions", ok_completion(max_tokens=10**12), 400),
    "max_tokens 2**80": ("/v1/chat/completions", ok_chat(max_tokens=2**80), 400),
    "max_completion_tokens 0": ("/v1/chat/completions", ok_chat(max_completion_tokens=0), 400),
    "temperature a string": ("/v1/completions", ok_completion(temperature="hot"), 400),
    "temperature numeric string": ("/v1/chat/completions", ok_chat(temperature="0.5"), 400),
    "temperature NaN": ("/v1/completions", ok_completion(temperature=math.nan), 400),
    "temperature negative": ("/v1/completions", ok_completion(temperature=-1.0), 400),
    "top_k huge": ("/v1/completions", ok_completion(top_k=2**70, temperature=1.0), 400),
    "stop_token_ids huge": ("/v1/completions", ok_completion(stop_token_ids=[2**70]), 400),
    "unknown model": ("/v1/completions", ok_completion(model="gpt-17"), 404),
    "empty messages": ("/v1/chat/completions", ok_chat(messages=[]), 400),
    "bad role": ("/v1/chat/completions", ok_chat(messages=[{"role": "wizard", "content": "hi"}]), 400),
    "empty prompt": ("/v1/completions", ok_completion(prompt=""), 400),
    "token id out of vocab": ("/v1/completions", ok_completion(prompt=[1, 2, 10**6]), 400),
    "batched prompts over the choice limit": ("/v1/completions", ok_completion(prompt=["a", "b", "c"], n=50), 400),
    "a lone surrogate in the prompt": ("/v1/completions", ok_completion(prompt="a\ud800"), 400),
    "a lone surrogate in the model": ("/v1/completions", ok_completion(model="\udfff"), 400),
    "a lone surrogate in a message": ("/v1/chat/completions", ok_chat(messages=[{"role": "user", "content": "\ud800"}]), 400),
    "tool_choice naming no tool": ("/v1/chat/completions", ok_chat(tool_choice={"type": "function", "function": {
        "name": "g"}}, tools=[{"type": "function", "function": {"name": "f"}}]), 400),
    "tool_choice without tools": ("/v1/chat/completions", ok_chat(tool_choice="required"), 400),
    "a tool schema the engine refuses": ("/v1/chat/completions", ok_chat(tool_choice="required", tools=[
        {"type": "function", "function": {"name": "f", "parameters": {"type": "string", "minLength": 9,
                                                                      "maxLength": 2}}}]), 400),
    "tools on completions": ("/v1/completions", ok_completion(tools=[{"type": "function", "function": {"name": "f"}}]),
                             400),
    "a tool named twice": ("/v1/chat/completions", ok_chat(tool_choice="none", tools=[
        {"type": "function", "function": {"name": "f"}}] * 2), 400),
    "response_format json_schema without a schema object": (
        "/v1/chat/completions", ok_chat(response_format={"type": "json_schema"}), 400),
    "a JSON schema the engine refuses": ("/v1/completions", ok_completion(
        guided_json={"type": "integer", "minimum": 3, "maximum": 1}), 400),
    "a bad regex": ("/v1/completions", ok_completion(guided_regex="(a"), 400),
    "a bad grammar": ("/v1/completions", ok_completion(guided_grammar="root ::= nothing"), 400),
    "two constraints": ("/v1/completions", ok_completion(guided_regex="a", guided_choice=["a"]), 400),
    "an empty choice list": ("/v1/completions", ok_completion(guided_choice=[]), 400),
    "prompt_logprobs streamed": ("/v1/completions", ok_completion(prompt_logprobs=1, stream=True), 400),
    "prompt_logprobs out of range": ("/v1/completions", ok_completion(prompt_logprobs=1000), 400),
    "thousands of stop strings": ("/v1/completions", ok_completion(stop=[f"s{i}" for i in range(5000)]), 400),
    "a very long stop string": ("/v1/completions", ok_completion(stop=["x" * 5000]), 400),
    "n=0": ("/v1/completions", ok_completion(n=0), 400),
    "n=129": ("/v1/completions", ok_completion(n=129), 400),
    "missing model": ("/v1/completions", {"prompt": "hi"}, 400),
    "body is a list": ("/v1/completions", [1, 2, 3], 400),
}


@pytest.mark.parametrize("name", list(NAMED_CASES))
def test_named_bad_input_is_4xx_with_openai_error(client, name):
    path, body, status = NAMED_CASES[name]
    t0 = time.monotonic()
    r = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code == status, (name, r.status_code, r.text[:300])
    assert is_openai_error(r), r.text[:300]
    assert time.monotonic() - t0 < 5.0  # refused up front, never queued


@pytest.mark.parametrize("raw", [b'{"model": "\xff\xfe\xfd", "prompt": "hi"}', b"\xc3\x28\xa0\xa1", b"{not json",
                                 b"", b"null", b'{"model": "pdserve-demo", "prompt": "hi", "max_tokens": 1e999}'])
def test_malformed_bodies(client, raw):
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = client.post(path, content=raw, headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 500 and is_openai_error(r), (raw, r.status_code, r.text[:200])


def test_body_over_the_payload_limit(client):
    body = ok_completion(prompt="a" * (MAX_BODY + 10))
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 413 and is_openai_error(r)
    assert r.json()["error"]["code"] == "request_too_large"

    # Chunked (no Content-Length): the limit is enforced while reading.
    def chunks():
        yield b'{"model": "pdserve-demo", "prompt": "'
        for _ in range(20):
            yield b"a" * 8192
        yield b'"}'
    r = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and is_openai_error(r)


# -- property-based fuzz of both request schemas --------------------------------------------------
anything = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70), st.floats(),
              st.text(max_size=12)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=8)
small_ints = st.one_of(st.integers(-3, 12), st.integers(min_value=-2**64, max_value=2**64))
floats = st.one_of(st.floats(-2, 3), st.floats(), st.integers(-2, 3))
token_ids = st.lists(st.one_of(st.integers(0, 511), st.integers(-2**40, 2**40)), max_size=20)


def schemas(wild: bool):
    """Completion and chat bodies: `wild` mixes anything at all into every field; otherwise each field
    has a plausible type (often a valid value, often an out-of-range one)."""
    def field(strategy):
        return st.one_of(strategy, anything) if wild else strategy

    sampling = {
        "max_tokens": field(small_ints), "temperature": field(floats), "top_p": field(floats),
        "top_k": field(small_ints), "n": field(st.integers(-1, 3)), "stream": field(st.booleans()),
        "seed": field(small_ints),
        "stream_options": field(st.fixed_dictionaries({}, optional={"include_usage": field(st.booleans())})),
        "stop": field(st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=20))),
        "stop_token_ids": field(token_ids), "ignore_eos": field(st.booleans()), "min_tokens": field(small_ints),
        "presence_penalty": field(floats), "frequency_penalty": field(floats),
        "logprobs": field(st.one_of(st.none(), st.booleans())), "user": field(st.text(max_size=8)),
        # Structured output: random regexes, choices and schemas reach the grammar engine's check.
        "response_format": field(st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "json_object", "json_schema"])},
            optional={"json_schema": st.fixed_dictionaries({"name": st.text(max_size=4)},
                                                           optional={"schema": anything})})),
        "guided_regex": field(st.text(max_size=8)), "guided_choice": field(st.lists(st.text(max_size=4), max_size=3)),
        "guided_json": field(anything), "guided_grammar": field(st.text(max_size=12)),
        "skip_special_tokens": field(st.booleans()), "prompt_logprobs": field(small_ints),
    }
    model = st.one_of(st.just(MODEL), st.just(MODEL), st.just(MODEL), field(st.text(max_size=8)))
    completion = st.fixed_dictionaries({"model": model, "prompt": field(st.one_of(
        st.text(max_size=40), token_ids, st.lists(st.text(max_size=10), max_size=2), st.lists(token_ids, max_size=2)))},
        optional={**sampling, "echo": field(st.booleans()), "suffix": field(st.text(max_size=4)),
                  "best_of": field(st.integers(-1, 3))})
    message = st.fixed_dictionaries(
        {"role": field(st.sampled_from(["system", "developer", "user", "assistant", "tool", "x"]))},
        optional={"content": field(st.one_of(st.none(), st.text(max_size=30), st.lists(
            st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=8)}), max_size=2))),
            "name": field(st.text(max_size=4)), "tool_call_id": field(st.text(max_size=4)),
            "tool_calls": field(st.lists(st.fixed_dictionaries({"id": st.text(max_size=4), "function": st.fixed_dictionaries(
                {"name": st.text(max_size=4), "arguments": st.text(max_size=10)})}), max_size=2))})
    tool = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": st.text(max_size=6)}, optional={"parameters": anything, "description": st.text(max_size=6)})})
    chat = st.fixed_dictionaries({"model": model, "messages": field(st.lists(message, max_size=3))},
                                 optional={**sampling, "max_completion_tokens": field(small_ints),
                                           "tools": field(st.lists(tool, max_size=2)),
                                           "tool_choice": field(st.one_of(st.sampled_from(["none", "auto", "required"]),
                                                                          st.fixed_dictionaries({"type": st.just("function"),
                                                                          "function": st.fixed_dictionaries(
                                                                              {"name": st.text(max_size=6)})}))),
                                           "parallel_tool_calls": field(st.booleans())})
    return [st.tuples(st.just("/v1/completions"), completion), st.tuples(st.just("/v1/chat/completions"), chat)]


requests = st.one_of(*schemas(wild=False), *schemas(wild=True),
                     st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), anything))

FUZZ_STATS = {"tried": 0, "by_status": {}}


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(req=requests)
def _fuzz_one(client, req):
    path, body = req
    FUZZ_STATS["tried"] += 1
    # Keep every accepted request short: the fuzz is about the edge, not about generating text.
    if isinstance(body, dict):
        for k in ("max_tokens", "max_completion_tokens"):
            if type(body.get(k)) is int:
                body[k] = min(body[k], 8)
        if path.endswith("chat/completions") and "max_completion_tokens" not in body:
            body.setdefault("max_tokens", 8)
    r = client.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
    FUZZ_STATS["by_status"][r.status_code] = FUZZ_STATS["by_status"].get(r.status_code, 0) + 1
    assert r.status_code < 500, (body, r.status_code, r.text[:300])
    if r.status_code != 200:
        assert is_openai_error(r), (body, r.text[:300])


def test_fuzz_request_schemas_no_5xx(cluster, client):
    t0 = time.monotonic()
    _fuzz_one(client)
    elapsed = time.monotonic() - t0
    print(f"\nfuzz: {FUZZ_STATS['tried']} requests in {elapsed:.1f}s, by status {sorted(FUZZ_STATS['by_status'].items())}")
    assert FUZZ_STATS["tried"] >= FUZZ_EXAMPLES
    assert FUZZ_STATS["by_status"].get(200, 0) > 0  # the fuzz also reached the workers
    # Still healthy, still correct, nothing leaked.
    assert client.get("/health").status_code == 200 and client.get("/ready").status_code == 200
    r = client.post("/v1/completions", json=ok_completion(temperature=0))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    wait_clean(cluster)


def _app_routes():
    """The routes of the gateway's app, as every API-server process builds it (enumerated here)."""
    from router.channel.client import RouterClient
    from router.stats.metrics import GatewayMetrics
    from router.openai.gateway import Gateway, GatewayConfig
    from router.openai.routes import build_app
    from router.streams.token_stream import TokenStreamReceiver

    tokens = TokenStreamReceiver()
    try:
        gw = Gateway(GatewayConfig(MODEL, MAX_MODEL_LEN, api_key=KEY), None, RouterClient("inproc://none", "probe",
                     tokens.address), tokens, GatewayMetrics(MODEL))
        return build_app(gw).routes
    finally:
        tokens.close()


def test_every_v1_route_needs_the_key(cluster):
    """Every /v1 route of the app and the tokenizer and stats routes (enumerated, so a new one can't
    slip through) answer 401 with an OpenAI error body without the key, with a wrong one (same
    length, one character off) or with a non-Bearer scheme; so does /metrics (it names the load and
    the workers); /health, /ready, /version and the schema stay open."""
    from fastapi.routing import APIRoute

    def api_routes(routes):
        for r in routes:
            if isinstance(r, APIRoute):
                yield r
            inner = getattr(r, "original_router", None)  # FastAPI >= 0.16x keeps included routers whole
            if inner is not None:
                yield from api_routes(inner.routes)

    keyed = ("/v1", "/tokenize", "/detokenize", "/stats", "/metrics")
    routes = [(m, r.path.replace("{model_id:path}", MODEL).replace("{model_id}", MODEL))
              for r in api_routes(_app_routes()) if r.path.startswith(keyed) for m in r.methods]
    assert {p for _, p in routes} >= {"/v1/models", f"/v1/models/{MODEL}", "/v1/completions", "/v1/chat/completions",
                                      "/tokenize", "/detokenize", "/stats", "/metrics"}
    bodies = {"/v1/completions": ok_completion(), "/v1/chat/completions": ok_chat(),
              "/tokenize": {"prompt": "hi"}, "/detokenize": {"tokens": [1, 2]}}
    wrong = KEY[:-1] + ("x" if KEY[-1] != "x" else "y")
    for method, path in routes:
        for headers in ({}, {"Authorization": f"Bearer {wrong}"}, {"Authorization": f"Basic {KEY}"},
                        {"Authorization": KEY}, {"Authorization": "Bearer"}):
            r = httpx.request(method, f"{cluster.url}{path}", json=bodies.get(path), headers=headers, timeout=30)
            assert r.status_code == 401 and is_openai_error(r), (method, path, headers, r.status_code)
            assert r.json()["error"]["type"] == "authentication_error"
        r = httpx.request(method, f"{cluster.url}{path}", json=bodies.get(path), timeout=30,
                          headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200, (method, path, r.text[:200])
    for path in ("/health", "/ready", "/version", "/openapi.json"):
        assert httpx.get(f"{cluster.url}{path}", timeout=30).status_code == 200


@pytest.mark.parametrize("raw", [b"{not json", b"", b"null", b'{"model": 1}', b"x" * (MAX_BODY + 10)])
def test_no_key_is_401_before_any_body_validation(cluster, raw):
    """Without the key, whatever the body (invalid JSON, empty, wrong schema, over the size limit), the
    answer is 401: nothing about the body is validated for an unauthenticated client."""
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = httpx.post(f"{cluster.url}{path}", content=raw, timeout=30, headers={"Content-Type": "application/json"})
        assert r.status_code == 401 and is_openai_error(r), (path, raw[:20], r.status_code, r.text[:200])
        assert r.json()["error"]["type"] == "authentication_error"


# -- fuzz from the served OpenAPI schema ----------------------------------------------------------
OPENAPI_EXAMPLES = 120


def from_schema(schema: dict, components: dict, depth: int = 0):
    """A hypothesis strategy of JSON values valid for `schema`, the subset of JSON Schema FastAPI
    writes from pydantic models ($ref, anyOf, type, properties/required, items, enum/const, bounds),
    mixed at every level with `anything` (a wrong value for that field) a quarter of the time."""
    if "$ref" in schema:
        return from_schema(components[schema["$ref"].rsplit("/", 1)[1]], components, depth)
    if "anyOf" in schema:
        return st.one_of(*(from_schema(s, components, depth) for s in schema["anyOf"]))
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    t = schema.get("type")
    if t == "object" and "properties" in schema and depth < 4:
        props = {k: st.one_of(from_schema(v, components, depth + 1), anything) if depth == 0 else
                 from_schema(v, components, depth + 1) for k, v in schema["properties"].items()}
        required = set(schema.get("required", ()))
        return st.fixed_dictionaries({k: v for k, v in props.items() if k in required},
                                     optional={k: v for k, v in props.items() if k not in required})
    if t == "object":
        extra = schema.get("additionalProperties")  # a schema, or true (any value)
        values = from_schema(extra if isinstance(extra, dict) else {}, components, depth + 1)
        return st.dictionaries(st.one_of(st.text(max_size=4), st.integers(0, 600).map(str)), values, max_size=3)
    if t == "array":
        return st.lists(from_schema(schema.get("items", {}), components, depth + 1), max_size=4)
    if t == "integer":
        lo, hi = schema.get("minimum"), schema.get("maximum", schema.get("exclusiveMaximum"))
        return st.one_of(st.integers(-3, 600), st.integers(min_value=lo, max_value=hi))
    if t == "number":
        return st.one_of(st.floats(-3, 3), st.floats(allow_nan=False), st.integers(-3, 3))
    if t == "string":
        # Any Unicode, lone surrogates included (the JSON encoder writes them as \udXXX escapes).
        return st.one_of(st.text(max_size=12), st.text(st.characters(codec=None, categories=["Cs", "Ll"]), max_size=3),
                         st.just(MODEL))
    if t == "boolean":
        return st.booleans()
    if t == "null":
        return st.none()
    return anything


def _openapi_bodies(spec: dict):
    """(path, body) strategies for every POST operation with a JSON body, built from /openapi.json
    itself: neither what the schema says is valid nor a schema-shaped body with a wrong field may
    ever be a 5xx."""
    out = {}
    for path, ops in sorted(spec["paths"].items()):
        body = ops.get("post", {}).get("requestBody", {}).get("content", {}).get("application/json")
        if body is not None:
            out[path] = st.tuples(st.just(path), from_schema(body["schema"], spec["components"]["schemas"]))
    return out


def test_fuzz_from_openapi_no_5xx(cluster, client):
    spec = client.get("/openapi.json").json()
    strategies = _openapi_bodies(spec)
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"} <= set(strategies)
    seen: dict[int, int] = {}

    @settings(max_examples=OPENAPI_EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(req=st.one_of(*strategies.values()))
    def one(req):
        path, body = req
        if isinstance(body, dict):  # short generations: the fuzz is about the edge
            for k in ("max_tokens", "max_completion_tokens"):
                if type(body.get(k)) is int:
                    body[k] = min(body[k], 4)
            if type(body.get("n")) is int:
                body["n"] = min(body["n"], 2)
            if path.endswith("completions"):
                body.setdefault("max_tokens", 4)
                if "prompt" in body and isinstance(body["prompt"], list) and len(body["prompt"]) > 2:
                    body["prompt"] = body["prompt"][:2]
        r = client.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, (path, body, r.status_code, r.text[:300])
        if r.status_code != 200:
            assert is_openai_error(r), (path, body, r.text[:300])

    one()
    print(f"\nopenapi fuzz: by status {sorted(seen.items())}")
    assert sum(seen.values()) >= OPENAPI_EXAMPLES and seen.get(200, 0) > 0
    wait_clean(cluster)
