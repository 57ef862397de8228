"""router/openai/json_body.py: a body parses to what json.loads gives (msgspec where it can, json.loads
otherwise), and the API routes answer exactly as FastAPI's own parse does."""

from __future__ import annotations

import json
import random

import pytest
from fastapi import APIRouter, FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel

from router.openai.json_body import JSONBodyRoute, parse_json_body

BODIES = [b'{"a": 1}', b'{"a":1,"a":2}', b'123456789012345678901234567890', b'-9223372036854775809', b'1e400', b'NaN',
          b'-Infinity', b'"\\ud800"', b'"\\udc00"', b'"\\ud83d\\ude00"', b'"\xed\xa0\x80"', b'[1.0, -0.0, 1e-400]',
          b'\xef\xbb\xbf{"a": 1}', '{"a": "\u00e9"}'.encode("utf-16"), b' {"a" : [ ] } ', b'"\\u0000"', b'-0']
BAD = [b'"\xff"', b"{'a': 1}", b'[1,]', b'01', b'"a\x01b"', b'{"a":1}x', b'   ', b'-NaN', b'"\xf4\x90\x80\x80"']


def _same(a, b) -> bool:
    return type(a) is type(b) and repr(a) == repr(b)


@pytest.mark.parametrize("body", BODIES)
def test_a_body_parses_to_what_json_loads_gives(body):
    assert _same(parse_json_body(body), json.loads(body))


@pytest.mark.parametrize("body", BAD)
def test_a_bad_body_raises_what_json_loads_raises(body):
    with pytest.raises(Exception) as want:
        json.loads(body)
    with pytest.raises(type(want.value)):
        parse_json_body(body)


def test_numbers_parse_to_the_same_floats_and_ints():
    rng = random.Random(0)
    for _ in range(20_000):
        s = rng.choice([repr(rng.uniform(-1e6, 1e6)), f"{rng.randrange(-10**18, 10**18)}e{rng.randrange(-330, 310)}",
                        f"{rng.randrange(10**rng.randrange(1, 25))}.{rng.randrange(10**5)}e{rng.randrange(-340, 320)}",
                        str(rng.randrange(-2**70, 2**70))]).encode()
        assert _same(parse_json_body(s), json.loads(s)), s


class _Body(BaseModel):
    prompt: list[int] | str
    n: float | None = None


def _client(route_class) -> TestClient:
    app, router = FastAPI(), APIRouter(route_class=route_class) if route_class else APIRouter()

    @router.post("/echo")
    async def echo(body: _Body):
        return {"prompt": body.prompt, "n": repr(body.n)}

    app.include_router(router)
    return TestClient(app)


@pytest.mark.parametrize("body", [b'{"prompt": [1, 2, 3]}', b'{"prompt": "x", "n": NaN}', b'{"prompt": "x", "n": 1e400}',
                                  b'{"prompt": [1, 2,]}', b'{"prompt": "\\u00e9"}', b'{"prompt": 5}', b'', b'\xff',
                                  b'{"prompt": "x"} trailing'])
def test_the_route_answers_as_fastapis_own_parse(body):
    ours, theirs = _client(JSONBodyRoute), _client(None)
    headers = {"content-type": "application/json"}
    a, b = ours.post("/echo", content=body, headers=headers), theirs.post("/echo", content=body, headers=headers)
    assert (a.status_code, a.json()) == (b.status_code, b.json())
