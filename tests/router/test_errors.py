"""The error classes and their one mapping (a single-source rule, as tests/cluster/test_single_source_rules.py).

Each error class carries its HTTP answer (cluster/errors.py, router/errors.py); the router's channel
carries an error by its registered kind (router/channel/messages.py) and the gateway answers any of
them through router/openai/errors.py::api_error. Here every registered class crosses the channel,
comes back as itself, and reaches an HTTP client as the status its class states, through the real
app; and an AST check finds any second mapping: an APIError built elsewhere, an error class tested
with isinstance, its HTTP attributes or the kind registry read anywhere but in those modules."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import router.channel.messages  # noqa: F401 - every error kind is registered once the channel is imported
from cluster.errors import ERROR_KINDS, CapacityError, InvalidRequestError, ModelLoadError, PdserveError
from router.channel.messages import Reply, decode_to_gateway, encode, error_from_wire, error_to_wire
from router.errors import (CapacityShortError, DrainingError, GenerationError, NoHealthyWorkerError, OverloadedError,
                           RouterUnavailableError)
from router.openai.errors import api_error
from python_source import parse

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("cluster", "prefill_worker", "decode_worker", "router", "deploy", "loadtest", "benchmarks")

# What a client gets for each error class: (status, type, code, headers). A new class needs a row.
ANSWERS = {
    InvalidRequestError: (400, "invalid_request_error", None, None),
    CapacityError: (429, "rate_limit_error", "rate_limit_exceeded", {"Retry-After": "1"}),
    OverloadedError: (429, "rate_limit_error", "rate_limit_exceeded", {"Retry-After": "7"}),
    NoHealthyWorkerError: (503, "service_unavailable", "no_healthy_worker", None),
    DrainingError: (503, "service_unavailable", "draining", {"Retry-After": "1", "Connection": "close"}),
    RouterUnavailableError: (503, "service_unavailable", "no_healthy_worker", None),
    GenerationError: (500, "internal_error", None, None),
}


def instance(cls: type[PdserveError]) -> PdserveError:
    if cls is InvalidRequestError:
        return cls("prompt is too long", "max_tokens")
    if cls is OverloadedError:
        return cls("too many waiting requests", 7)
    return cls(f"a {cls.__name__}")


def across_the_channel(e: BaseException) -> Exception:
    """What the gateway raises for `e` raised on the router's side (RouterServer -> RouterClient)."""
    return error_from_wire(decode_to_gateway(encode(Reply(1, error_to_wire(e)))).error)


def test_every_registered_class_has_an_answer():
    assert set(ERROR_KINDS.values()) == set(ANSWERS)
    assert all(ERROR_KINDS[cls.kind] is cls for cls in ANSWERS)


@pytest.mark.parametrize("cls", list(ANSWERS), ids=lambda c: c.__name__)
def test_each_class_crosses_the_channel_as_itself_and_maps_to_its_status(cls):
    e = instance(cls)
    got = across_the_channel(e)
    assert type(got) is cls and str(got) == str(e)
    assert (got.param, got.retry_after_s) == (e.param, e.retry_after_s)
    status, type_, code, headers = ANSWERS[cls]
    for err in (api_error(e), api_error(got)):
        assert (err.status, err.type, err.code, err.headers) == (status, type_, code, headers)
        assert err.message == str(e) and err.param == e.param and err.status == cls.http_status


def test_a_subclass_without_a_kind_crosses_as_its_registered_ancestor():
    got = across_the_channel(CapacityShortError("no decode worker has 3 free KV blocks", 2))
    assert type(got) is OverloadedError and got.retry_after_s == 2
    assert api_error(got).headers == {"Retry-After": "2"}


def test_errors_not_meant_for_a_client_are_500s():
    got = across_the_channel(ValueError("boom"))
    assert type(got) is RuntimeError  # the gateway's catch-all answers it without quoting it
    err = api_error(ModelLoadError("no config.json"))
    assert (err.status, err.type, err.message) == (500, "internal_error", "internal error: ModelLoadError: no config.json")
    assert type(across_the_channel(ModelLoadError("x"))) is RuntimeError


def test_a_kind_is_registered_once():
    with pytest.raises(TypeError, match="'overloaded' is taken"):
        type("Another", (PdserveError,), {"kind": "overloaded"})
    assert ERROR_KINDS["overloaded"] is OverloadedError


class _Client:
    """The gateway's channel, in process: a Submit raises what the router raised, as RouterClient
    does once the error crossed the channel."""

    def __init__(self, error: BaseException):
        self.error, self.state, self.connected = error, None, True
        self.on_failed = self.on_prefilled = self.on_drain = self.status = None

    async def start(self):
        pass

    async def stop(self):
        pass

    async def submit(self, req):
        raise across_the_channel(self.error)

    def finish(self, *args):
        pass


class _Tokenizer:
    def __len__(self):
        return 1000


@pytest.mark.parametrize("cls", list(ANSWERS), ids=lambda c: c.__name__)
def test_the_gateway_answers_each_refusal_through_the_one_mapping(cls):
    """A request the router refuses with `cls`: the HTTP status, headers and OpenAI body the client
    gets are api_error's, from either endpoint."""
    from fastapi.testclient import TestClient

    from router.stats.metrics import GatewayMetrics
    from router.openai.gateway import Gateway, GatewayConfig
    from router.openai.routes import build_app
    from router.streams.token_stream import TokenStreamReceiver

    e = instance(cls)
    want = api_error(e)
    gw = Gateway(GatewayConfig("m", 4096, vocab_size=1000), _Tokenizer(), _Client(e), TokenStreamReceiver(),
                 GatewayMetrics(f"errors-{cls.__name__}"))
    with TestClient(build_app(gw)) as http:
        for stream in (False, True):
            r = http.post("/v1/completions", json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "stream": stream})
            assert r.status_code == want.status, r.text
            assert r.json() == {"error": {"message": want.message, "type": want.type, "param": want.param,
                                          "code": want.code}}
            for k, v in (want.headers or {}).items():
                assert r.headers[k.lower()] == v
        assert not gw.active
    assert f'status="{want.status}"' in gw.metrics.render().decode()


# -- no second mapping -------------------------------------------------------------------------------
# The modules allowed to read what an error class says about HTTP and the channel.
MAPPING = "router/openai/errors.py"
CODEC = "router/channel/messages.py"
REGISTRY = "cluster/errors.py"
HTTP_ATTRS = {"http_status", "openai_type", "openai_code", "close_connection"}


def error_class_names() -> set[str]:
    seen, todo = set(), [PdserveError]
    while todo:
        c = todo.pop()
        seen.add(c.__name__)
        todo += c.__subclasses__()
    return seen


def second_mappings(root: Path) -> list[str]:
    names = error_class_names()
    bad = []
    for top in PACKAGES:
        for path in sorted((root / top).rglob("*.py")):
            rel = str(path.relative_to(root))
            for node in ast.walk(parse(path.read_text(), rel)):
                where = f"{rel}:{getattr(node, 'lineno', 0)}"
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                    if node.func.id == "APIError" and rel != MAPPING:
                        bad.append(f"{where}: builds an APIError (only {MAPPING} does)")
                    if node.func.id == "isinstance" and len(node.args) == 2 and rel not in (MAPPING, CODEC):
                        tested = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
                        hit = [t.id for t in tested if isinstance(t, ast.Name) and t.id in names]
                        if hit:
                            bad.append(f"{where}: maps by isinstance(..., {', '.join(hit)})")
                if isinstance(node, ast.Attribute) and node.attr in HTTP_ATTRS and rel != MAPPING:
                    bad.append(f"{where}: reads .{node.attr} (only {MAPPING} does)")
                if isinstance(node, ast.Name) and node.id == "ERROR_KINDS" and rel not in (REGISTRY, CODEC):
                    bad.append(f"{where}: uses ERROR_KINDS (only {CODEC} does)")
    return bad


def test_no_second_mapping_of_errors():
    bad = second_mappings(ROOT)
    assert not bad, "a second mapping of the error classes:\n" + "\n".join(bad)


def test_the_checker_finds_a_second_mapping(tmp_path):
    """The shapes of the three mappings this replaced: the gateway's, the router's refusal, the client's."""
    fake = tmp_path / "router"
    fake.mkdir()
    (fake / "gateway.py").write_text(
        "def _api_error(e):\n"
        "    if isinstance(e, (InvalidRequestError, ValueError)):\n"
        "        return APIError(400, str(e), 'invalid_request_error', e.param)\n")
    (fake / "server.py").write_text(
        "def refusal(e):\n    if isinstance(e, DrainingError):\n        return e.http_status\n")
    (fake / "client.py").write_text("def raise_refusal(kind):\n    raise ERROR_KINDS[kind]('x')\n")
    found = second_mappings(tmp_path)
    assert any("gateway.py:2" in f and "InvalidRequestError" in f for f in found), found
    assert any("gateway.py:3" in f and "APIError" in f for f in found), found
    assert any("server.py:2" in f and "DrainingError" in f for f in found), found
    assert any("server.py:3" in f and ".http_status" in f for f in found), found
    assert any("client.py:2" in f and "ERROR_KINDS" in f for f in found), found

