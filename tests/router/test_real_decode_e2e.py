"""The gateway and router against the real DecodeWorkerActor (prefill on the decode worker itself:
prefill_workers=0, so no KV transport is needed), over real HTTP, with an API key."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from cluster.sampling.sampling_params import SamplingParams
from serving_harness import wait_idle

MODEL = "pdserve-demo"
AUTH = {"Authorization": "Bearer sekret"}


def test_api_key_required(real_decode_cluster):
    url = real_decode_cluster.url
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
        r = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{url}/v1/models").status_code == 401
    assert httpx.get(f"{url}/health").status_code == 200  # only /v1 is protected
    assert httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=30).status_code == 200


def test_concurrent_greedy_equals_engine(real_decode_cluster, reference_engine):
    prompts = [f"Story number {i}: once upon a time" + " and then" * (i % 5) for i in range(16)]
    lens = [6 + (i * 7) % 20 for i in range(16)]
    refs = reference_engine.generate(prompts, [SamplingParams(max_tokens=m, temperature=0.0) for m in lens])

    async def one(client, i):
        body = {"model": MODEL, "prompt": prompts[i], "max_tokens": lens[i], "temperature": 0, "stream": i % 2 == 1}
        if not body["stream"]:
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]
        text = ""
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async def main():
        async with httpx.AsyncClient(base_url=real_decode_cluster.url, timeout=120, headers=AUTH) as client:
            return await asyncio.gather(*(one(client, i) for i in range(len(prompts))))

    assert asyncio.run(main()) == [r.text for r in refs]
    wait_idle(real_decode_cluster)


def test_openai_chat_stream(real_decode_cluster):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{real_decode_cluster.url}/v1", api_key="sekret", max_retries=0)
    full = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=12, temperature=0)
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=12, temperature=0, stream=True)]
    assert "".join(parts) == full.choices[0].message.content


def test_disconnect_frees_blocks(real_decode_cluster):
    with httpx.stream("POST", f"{real_decode_cluster.url}/v1/completions", headers=AUTH, timeout=60, json={
            "model": MODEL, "prompt": "A long one", "max_tokens": 3000, "ignore_eos": True, "stream": True}) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
    wait_idle(real_decode_cluster)
    assert not real_decode_cluster.router.inflight
