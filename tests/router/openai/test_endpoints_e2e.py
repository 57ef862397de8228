"""The gateway's other endpoints through real HTTP: /openapi.json and /docs (the schema is the
request models'), /v1/models/{id}, /tokenize, /detokenize, /version; and /metrics counting cancelled
requests, preemptions and the cluster's KV usage."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from cluster.text.tokenizer import encode_chat

openai = pytest.importorskip("openai")

MODEL = "pdserve-demo"


def test_openapi_schema_is_the_request_models(fake_cluster):
    from router.openai.protocol import ChatCompletionRequest, CompletionRequest

    spec = httpx.get(f"{fake_cluster.url}/openapi.json", timeout=30).json()
    paths = spec["paths"]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{model_id}", "/tokenize",
            "/detokenize", "/version"} <= set(paths)
    schemas = spec["components"]["schemas"]
    for model in (CompletionRequest, ChatCompletionRequest):
        assert set(schemas[model.__name__]["properties"]) == set(model.model_fields)
    ref = paths["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert ref.endswith("/CompletionRequest")
    docs = httpx.get(f"{fake_cluster.url}/docs", timeout=30)
    assert docs.status_code == 200 and "/openapi.json" in docs.text


def test_model_by_id(fake_cluster):
    client = openai.OpenAI(base_url=f"{fake_cluster.url}/v1", api_key="unused", max_retries=0)
    m = client.models.retrieve(MODEL)
    assert m.id == MODEL and m.object == "model"
    # What it is served with (issue 36): the demo checkpoint's float32, unquantized; /v1/models, the
    # router's /metrics info gauge.
    listed = httpx.get(f"{fake_cluster.url}/v1/models", timeout=30).json()["data"][0]
    assert (m.dtype, m.quantization, m.kv_cache_dtype) == ("float32", "none", "float32") == (
        listed["dtype"], listed["quantization"], listed["kv_cache_dtype"])
    metrics = httpx.get(f"{fake_cluster.url}/metrics", timeout=30).text
    assert ('pdserve:model_info{dtype="float32",kv_cache_dtype="float32",model_name="pdserve-demo",'
            'quantization="none"} 1.0') in metrics
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert e.value.body["code"] == "model_not_found"


def test_tokenize_detokenize_version(fake_cluster, reference_engine):
    tok = reference_engine.tokenizer
    url = fake_cluster.url
    text = "Once upon a time"
    r = httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": text}, timeout=30).json()
    assert r["tokens"] == list(tok(text).input_ids) and r["count"] == len(r["tokens"]) and r["max_model_len"] > 0
    r2 = httpx.post(f"{url}/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=30).json()
    assert r2["tokens"] == list(tok(text, add_special_tokens=False).input_ids)
    msgs = [{"role": "user", "content": "hi"}]
    r3 = httpx.post(f"{url}/tokenize", json={"model": MODEL, "messages": msgs}, timeout=30).json()
    assert r3["tokens"] == encode_chat(tok, msgs)
    d = httpx.post(f"{url}/detokenize", json={"model": MODEL, "tokens": r2["tokens"]}, timeout=30).json()
    assert d["prompt"] == tok.decode(r2["tokens"])
    for path, body, param in [("/tokenize", {"prompt": "x", "messages": msgs}, "prompt"), ("/tokenize", {}, "prompt"),
                              ("/detokenize", {"tokens": [10**9]}, "tokens"), ("/detokenize", {"tokens": [-1]}, "tokens"),
                              ("/tokenize", {"prompt": "\ud800"}, "prompt")]:
        r = httpx.post(f"{url}{path}", content=__import__("json").dumps(body), timeout=30,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, body, r.text)
    r = httpx.post(f"{url}/tokenize", json={"model": "other", "prompt": "x"}, timeout=30)
    assert r.status_code == 404
    v = httpx.get(f"{url}/version", timeout=30).json()
    assert re.match(r"\d+\.\d+", v["version"])


def _metric(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            head = line.split(" ")[0]
            if head == name or head.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
    return total


def test_cancelled_requests_are_counted(fake_cluster):
    """A client that leaves mid-stream: finished_reason="abort" counts it and the tokens it got."""
    url = fake_cluster.url

    def scrape():
        return httpx.get(f"{url}/metrics", timeout=30).text

    before = scrape()
    aborts0 = _metric(before, "vllm:request_success_total", finished_reason="abort")
    tokens0 = _metric(before, "vllm:generation_tokens_total")

    async def leave_after(n: int) -> int:
        got = 0
        async with httpx.AsyncClient(timeout=60) as c:
            async with c.stream("POST", f"{url}/v1/completions", json={
                    "model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "stream": True,
                    "ignore_eos": True, "temperature": 0}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        got += 1
                        if got == n:
                            break
        return got

    asyncio.run(leave_after(5))
    from serving_harness import wait_clean

    wait_clean(fake_cluster)
    after = scrape()
    # Several API servers share the port: the sum over every gateway process is what /metrics shows.
    assert _metric(after, "vllm:request_success_total", finished_reason="abort") == aborts0 + 1
    streamed = _metric(after, "vllm:generation_tokens_total") - tokens0
    assert 5 <= streamed < 400
    assert "vllm:num_preemptions_total" in after
    assert "pdserve:kv_cache_usage_perc_cluster" in after
