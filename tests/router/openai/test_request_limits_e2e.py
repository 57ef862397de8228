"""Attacks on one API server over real HTTP (the real decode worker, with an API key), each refused
with a 4xx in OpenAI's error shape while the cluster keeps serving and loses nothing:

- the costliest bodies the size limit lets through (a 4 MB chat message, /tokenize of 4 MB, 64 bad
  words of 256 characters) while another request streams: the stream ends complete and the router
  sees this process's heartbeats all along (they come from a thread; the work runs off the loop);
- lists past their caps (bad_words, allowed_token_ids, stop_token_ids, logit_bias, n x ids): a 400
  before any of it is tokenized or copied into choices;
- grammars past the spec-size and repetition bounds: a 400 before the grammar engine sees them;
- a request head past 64 KiB: 431 from the HTTP server.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest

from router.openai.protocol import MAX_ALLOWED_TOKEN_IDS, MAX_REQUEST_TOKEN_ID_ENTRIES
from serving_harness import wait_idle

MODEL = "pdserve-demo"
AUTH = {"Authorization": "Bearer sekret"}


def _is_openai_400(r: httpx.Response, param: str | None = None) -> bool:
    err = r.json().get("error", {})
    return (r.status_code == 400 and err.get("type") == "invalid_request_error" and isinstance(err.get("message"), str)
            and (param is None or err.get("param") == param))


class HeartbeatWatch:
    """Samples the router's view of every gateway (on the router's own thread's objects) every 50 ms:
    the longest time it went without a heartbeat, and whether any gateway was retired."""

    def __init__(self, sc):
        self.sc, self.longest_gap, self.retired = sc, 0.0, False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(0.05):
            now = time.monotonic()
            for g in list(self.sc.router_server.gateways.values()):
                self.retired |= not g.up
                self.longest_gap = max(self.longest_gap, now - g.last_seen)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def test_costliest_requests_never_starve_the_loop(real_decode_cluster):
    """While the worst bodies run, a stream on the same API server finishes complete and heartbeats
    never pause past a fraction of the router's 5 s timeout."""
    sc = real_decode_cluster
    huge = "word " * 800_000  # 4 MB: just under the default body limit
    worst = [
        ("/v1/chat/completions", {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": huge}]},
         "messages"),
        ("/tokenize", {"model": MODEL, "prompt": huge}, "prompt"),
        ("/v1/completions", {"model": MODEL, "max_tokens": 4, "prompt": huge[:1_000_000]}, "prompt"),
    ]

    async def run():
        async with httpx.AsyncClient(base_url=sc.url, headers=AUTH, timeout=300) as c:
            body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 300, "ignore_eos": True,
                    "temperature": 0, "stream": True}
            async with c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                lines = r.aiter_lines()
                first = await anext(lines)
                assert first.startswith("data: ")
                attacks = [asyncio.ensure_future(c.post(path, json=b)) for path, b, _ in worst]
                events = [first] + [line async for line in lines if line.startswith("data: ")]
            answers = await asyncio.gather(*attacks)
            return events, answers

    with HeartbeatWatch(sc) as watch:
        events, answers = asyncio.run(run())
    for (path, _, param), r in zip(worst, answers):
        assert _is_openai_400(r), (path, r.status_code, r.text[:200])
        assert "context length" in r.json()["error"]["message"] or "tokens" in r.json()["error"]["message"], path
    chunks = [json.loads(e[6:]) for e in events if e != "data: [DONE]"]
    assert events[-1] == "data: [DONE]" and not any("error" in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert not watch.retired and watch.longest_gap < 2.5, watch.longest_gap
    wait_idle(sc)


def _completion(**kw):
    return {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2, **kw}


LIST_ATTACKS = {
    "100k bad words (tokenized before the cap was checked)": (_completion(bad_words=["w"] * 100_000), "bad_words"),
    "a 10k-character bad word": (_completion(bad_words=["w" * 10_000]), "bad_words"),
    "1M allowed_token_ids": (_completion(allowed_token_ids=[1] * 1_000_000), "allowed_token_ids"),
    "stop_token_ids without end": (_completion(stop_token_ids=[1] * 100_000), "stop_token_ids"),
    "logit_bias past 300": (_completion(logit_bias={str(i): 1.0 for i in range(400)}), "logit_bias"),
    "128 choices x 4096 allowed ids": (_completion(n=128, allowed_token_ids=list(range(2, 258)) * 16),
                                       "allowed_token_ids"),
}


@pytest.mark.parametrize("name", list(LIST_ATTACKS))
def test_list_amplification_is_400_before_any_work(real_decode_cluster, name):
    body, param = LIST_ATTACKS[name]
    t0 = time.monotonic()
    r = httpx.post(f"{real_decode_cluster.url}/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text[:300]
    # pydantic names the field in its location; our own checks name it as `param`
    err = r.json()["error"]
    assert err.get("param") == param or param in err["message"], err
    assert time.monotonic() - t0 < 30


def test_token_id_budget_numbers():
    assert 128 * 4096 > MAX_REQUEST_TOKEN_ID_ENTRIES >= MAX_ALLOWED_TOKEN_IDS


GRAMMAR_ATTACKS = {
    "a string of maxLength 5000 (75 s of xgrammar parse)": {"guided_json": {"type": "string", "maxLength": 5000}},
    "a regex {0,100000}": {"guided_regex": "a{0,100000}"},
    "a regex count of 5000 digits": {"guided_regex": "a{1," + "9" * 5000 + "}"},
    "bounded repetitions adding up past 2048": {"guided_regex": "a{0,1000}b{0,1000}c{0,1000}"},
    "an array of 10^9 items": {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "minItems": 10**9}}}},
    "a grammar past 128 KiB": {"guided_grammar": "root ::= " + " | ".join(f'"{i}"' for i in range(30_000))},
}


@pytest.mark.parametrize("name", list(GRAMMAR_ATTACKS))
def test_costly_grammar_is_400_before_the_engine(real_decode_cluster, name):
    r = httpx.post(f"{real_decode_cluster.url}/v1/completions", json=_completion(**GRAMMAR_ATTACKS[name]),
                   headers=AUTH, timeout=60)
    assert _is_openai_400(r), r.text[:300]
    assert "repetition" in r.json()["error"]["message"] or "characters" in r.json()["error"]["message"]


def test_tokenizer_endpoints_are_bounded(real_decode_cluster):
    url = real_decode_cluster.url
    r = httpx.post(f"{url}/detokenize", json={"model": MODEL, "tokens": [5] * 100_000}, headers=AUTH, timeout=60)
    assert _is_openai_400(r, "tokens"), r.text[:300]
    r = httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": "word " * 100_000}, headers=AUTH, timeout=60)
    assert _is_openai_400(r, "prompt"), r.text[:300]
    assert httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": "hi"}, headers=AUTH).status_code == 200


def test_request_head_past_the_limit_is_431_and_the_server_serves_on(real_decode_cluster):
    url = real_decode_cluster.url
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-Pad-%d: %s\r\n" % (i, b"a" * 1000)
                                                                     for i in range(100)) + b"\r\n")
        head = s.recv(4096)
    assert head.startswith(b"HTTP/1.1 431"), head[:100]
    r = httpx.post(f"{url}/v1/completions", json=_completion(), headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    wait_idle(real_decode_cluster)
