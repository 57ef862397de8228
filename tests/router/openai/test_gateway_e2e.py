"""End to end through real HTTP: uvicorn + gateway + router + Ray actors (the worker doubles)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from cluster.sampling.sampling_params import SamplingParams
from serving_harness import completion_text, wait_idle

MODEL = "pdserve-demo"
PROMPTS = [
    "Once upon a time",
    "The quick brown fox jumps over the lazy dog and then",
    "In the beginning",
    "A B C D E F G",
    "She opened the door and saw",
    "It was a dark and stormy night; the rain fell in torrents, except at occasional intervals",
]


def _sse(lines) -> list:
    events = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        payload = line[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def _greedy(engine, prompt, max_tokens, **kw):
    return engine.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw))[0]


def test_completion_matches_engine(fake_cluster, reference_engine):
    ref = _greedy(reference_engine, PROMPTS[0], 24, ignore_eos=True)
    r = httpx.post(f"{fake_cluster.url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"][0]["text"] == ref.text
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(ref.prompt_token_ids), "completion_tokens": 24,
                             "total_tokens": len(ref.prompt_token_ids) + 24,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_streaming_completion_with_usage(fake_cluster, reference_engine):
    ref = _greedy(reference_engine, PROMPTS[1], 20)
    with httpx.stream("POST", f"{fake_cluster.url}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": PROMPTS[1], "max_tokens": 20, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = _sse(r.iter_lines())
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(ref.token_ids)
    chunks = events[:-2]
    assert all(c["usage"] is None for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == ref.text
    assert chunks[-1]["choices"][0]["finish_reason"] == ref.finish_reason


def test_continuous_usage_counts_every_chunks_tokens(fake_cluster, reference_engine):
    """stream_options.continuous_usage_stats (vLLM's): each chunk carries its choice's usage so far, so
    a client knows how many tokens each chunk brought; completions and chat alike."""
    ref = _greedy(reference_engine, PROMPTS[3], 18, ignore_eos=True)
    for path, body in (("/v1/completions", {"prompt": PROMPTS[3]}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPTS[3]}]})):
        with httpx.stream("POST", f"{fake_cluster.url}{path}", timeout=60, json={
                "model": MODEL, "max_tokens": 18, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}, **body}) as r:
            assert r.status_code == 200, r.read()
            events = _sse(r.iter_lines())
        assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 18
        chunks = [e for e in events[:-2] if e["choices"] and e.get("usage")]
        counts = [c["usage"]["completion_tokens"] for c in chunks]
        assert counts == sorted(counts) and counts[-1] == 18 and counts[0] >= 1
        assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]
                   for c in chunks)
        if path == "/v1/completions":
            assert "".join(c["choices"][0]["text"] for c in chunks) == ref.text
            assert chunks[0]["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)


def test_chat_plain_http_and_streaming(fake_cluster, reference_engine):
    from cluster.text.tokenizer import encode_chat

    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me a story."}]
    ids = encode_chat(reference_engine.tokenizer, msgs)
    ref = _greedy(reference_engine, ids, 16)
    r = httpx.post(f"{fake_cluster.url}/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": msgs, "max_tokens": 16, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": ref.text}
    assert body["usage"]["prompt_tokens"] == len(ids)
    with httpx.stream("POST", f"{fake_cluster.url}/v1/chat/completions", timeout=60,
                      json={"model": MODEL, "messages": msgs, "max_tokens": 16, "temperature": 0, "stream": True}) as r:
        events = _sse(r.iter_lines())
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "usage" not in events[1]
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert text == ref.text


def test_openai_client(fake_cluster, reference_engine):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{fake_cluster.url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL]
    ref = _greedy(reference_engine, PROMPTS[2], 12)
    out = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=12, temperature=0)
    assert out.choices[0].text == ref.text and out.usage.completion_tokens == len(ref.token_ids)
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert chunks[-1].usage.total_tokens == len(ref.prompt_token_ids) + len(ref.token_ids)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}],
                                          max_tokens=10, temperature=0, seed=7)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=10, temperature=0, stream=True)]
    assert "".join(pieces) == chat.choices[0].message.content
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=1_000_000)


def test_concurrent_greedy_equals_engine(fake_cluster, reference_engine):
    cases = [(PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)), 8 + (i * 5) % 25) for i in range(32)]
    refs = reference_engine.generate([p for p, _ in cases],
                                     [SamplingParams(max_tokens=m, temperature=0.0) for _, m in cases])

    async def one(client, prompt, max_tokens, stream):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
        return await completion_text(client, body)

    async def main():
        async with httpx.AsyncClient(base_url=fake_cluster.url, timeout=120) as client:
            return await asyncio.gather(*(one(client, p, m, i % 2 == 0) for i, (p, m) in enumerate(cases)))

    texts = asyncio.run(main())
    assert texts == [r.text for r in refs]
    # Both decode workers took a share (placement spreads load), and all blocks came back.
    import ray
    counters = ray.get([h.counters.remote() for h in fake_cluster.workers.decode.values()])
    assert all(c["reserve_calls"] > 0 for c in counters), counters
    wait_idle(fake_cluster)


def test_stop_string_finishes_and_frees_blocks(fake_cluster, reference_engine):
    ref = _greedy(reference_engine, PROMPTS[3], 40, ignore_eos=True)
    text = ref.text
    cut = next((i for i in range(4, len(text)) if text[i].strip() and text.find(text[i:i + 2]) == i), None)
    if cut is None:
        pytest.skip("reference output too uniform to pick a stop string")
    stop = text[cut:cut + 2]
    r = httpx.post(f"{fake_cluster.url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": PROMPTS[3], "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stop": [stop]})
    body = r.json()
    assert body["choices"][0]["text"] == text[:cut]
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] < 40
    wait_idle(fake_cluster)  # the decode worker was told to abort the rest


def test_disconnect_frees_blocks(fake_cluster):
    import ray

    url = fake_cluster.url
    before = ray.get([h.stats.remote() for h in fake_cluster.workers.decode.values()])
    with httpx.stream("POST", f"{url}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": PROMPTS[5] * 4, "max_tokens": 3000, "ignore_eos": True,
            "temperature": 0, "stream": True}) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        during = ray.get([h.stats.remote() for h in fake_cluster.workers.decode.values()])
        assert sum(s.free_blocks for s in during) < sum(s.free_blocks for s in before)
    # Closed mid-stream: the request must be aborted on its decode worker and its blocks freed.
    wait_idle(fake_cluster)
    deadline = time.monotonic() + 5
    while fake_cluster.router.inflight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not fake_cluster.router.inflight
    assert fake_cluster.router.admission.inflight_tokens == 0


def test_non_streaming_disconnect_aborts(fake_cluster):
    async def main():
        async with httpx.AsyncClient(base_url=fake_cluster.url, timeout=60) as client:
            task = asyncio.ensure_future(client.post("/v1/completions", json={
                "model": MODEL, "prompt": PROMPTS[0], "max_tokens": 3000, "ignore_eos": True}))
            await asyncio.sleep(1.0)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    asyncio.run(main())
    wait_idle(fake_cluster)
    assert not fake_cluster.router.inflight


@pytest.mark.parametrize("body,status,param", [
    ({"model": MODEL, "prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 5000}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "n": 0}, 400, "n"),
    ({"model": MODEL, "prompt": ""}, 400, "prompt"),
    ({"model": MODEL, "prompt": [1, 2, 10**9]}, 400, "prompt"),
    ({"model": MODEL, "prompt": ["a", ""]}, 400, "prompt"),
    ({"model": MODEL, "prompt": []}, 400, "prompt"),
    ({"model": MODEL}, 400, "prompt"),
    ({"model": MODEL, "prompt": "hi", "seed": -3}, 400, "seed"),
    ({"model": MODEL, "prompt": "hi", "stop": ["x"] * 17}, 400, "stop"),
    ({"model": MODEL, "prompt": "hi", "logprobs": 6}, 400, "logprobs"),
    ({"model": MODEL, "prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"model": MODEL, "prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"model": MODEL, "prompt": "hi", "min_p": 1.5}, 400, "min_p"),
    ({"model": MODEL, "prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ({"model": MODEL, "prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ({"model": MODEL, "prompt": "hi", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ({"model": MODEL, "prompt": "hi", "logit_bias": {str(i): 1 for i in range(301)}}, 400, "logit_bias"),
    ({"model": MODEL, "prompt": "hi", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    ({"model": MODEL, "prompt": "hi", "allowed_token_ids": [10**7]}, 400, "allowed_token_ids"),
    ({"model": MODEL, "prompt": "hi", "bad_words": [" "]}, 400, "bad_words"),
    ({"model": MODEL, "prompt": [5, 10**7]}, 400, "prompt"),  # token ids: checked on the loop, no tokenizer
    ({"model": MODEL, "prompt": [[5, 6], [10**7]]}, 400, "prompt"),
    ({"model": "gpt-4", "prompt": "hi"}, 404, "model"),
])
def test_bad_completion_requests(fake_cluster, body, status, param):
    r = httpx.post(f"{fake_cluster.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    if status == 404:
        assert err["code"] == "model_not_found"


def test_stats_time_a_request_from_its_receipt_to_its_first_event_written(fake_cluster):
    """/stats: a request's TTFT starts when the HTTP app got it (`received`; `intake` is the routing,
    parse, validation and tokenization up to its arrival) and, streamed, ends when the event carrying
    its first token went to the socket (`write`); the parts add up to it, in order. A token-id prompt
    (no tokenizer) and a text prompt both; not streamed: no `write`."""
    url = fake_cluster.url
    cursor = httpx.get(f"{url}/stats", params={"cursor": 10**12}).json()["cursor"]
    ids = {}
    for prompt, stream in (([11, 12, 13, 14], True), (PROMPTS[0], True), (PROMPTS[0], False)):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0, "stream": stream}
        if stream:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                assert r.status_code == 200
                rid = _sse(r.iter_lines())[0]["id"]
        else:
            rid = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["id"]
        ids[rid] = stream
    deadline = time.monotonic() + 10
    recs = {}
    while len(recs) < len(ids) and time.monotonic() < deadline:  # the Finish reaches the router's stats
        recs.update({r["request_id"]: r for r in httpx.get(f"{url}/stats", params={"cursor": cursor}).json()["requests"]
                     if r["request_id"] in ids})
        time.sleep(0.05)
    assert set(recs) == set(ids)
    for rid, stream in ids.items():
        r = recs[rid]
        parts, points = r["ttft_parts_ms"], r["ttft_points"]
        assert list(points)[0] == "received" and list(parts)[0] == "intake"
        assert (list(parts)[-1] == "write") == stream, parts
        assert all(v >= 0 for v in parts.values()) and list(points.values()) == sorted(points.values())
        assert sum(parts.values()) == pytest.approx(r["ttft_ms"], abs=1e-3)
        assert r["ttft_ms"] == pytest.approx((list(points.values())[-1] - points["received"]) * 1e3, abs=1e-3)
        assert r["e2e_ms"] >= r["ttft_ms"]


def test_bad_http_bodies(fake_cluster):
    url = fake_cluster.url
    cases = [
        (httpx.post(f"{url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"}), 400),
        (httpx.post(f"{url}/v1/completions", content=b"[1, 2]", headers={"content-type": "application/json"}), 400),
        (httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": []}), 400),
        (httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}), 400),
        (httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": "hi"}), 400),
        (httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x" * (5 << 20)}), 413),
        (httpx.get(f"{url}/v1/nope"), 404),
        (httpx.get(f"{url}/v1/completions"), 405),
    ]
    for r, status in cases:
        assert r.status_code == status, (r.status_code, r.text)
        err = r.json()["error"]
        assert err["message"] and err["type"]


def test_health_ready_models_metrics(fake_cluster, demo_model_dir):
    url = fake_cluster.url
    assert httpx.get(f"{url}/health").json()["healthy_decode_workers"] == 2
    assert httpx.get(f"{url}/ready").status_code == 200
    models = httpx.get(f"{url}/v1/models").json()
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == 4096
    httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4}, timeout=60)
    text = httpx.get(f"{url}/metrics").text
    for name in ["vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds", "pdserve:kv_transfer_seconds",
                 "pdserve:kv_transfer_bytes_total", "pdserve:decode_batch_size", "pdserve:graph_padding_ratio",
                 "vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting"]:
        assert name in text, name
    assert 'vllm:request_success_total{finished_reason="length",model_name="pdserve-demo"}' in text
    # Per finished request: its prompt and generated token counts (vLLM's request_*_tokens histograms).
    from cluster.text.tokenizer import encode_prompt, load_tokenizer

    prompt_len = len(encode_prompt(load_tokenizer(demo_model_dir), "hi"))
    before = _hist_count(text, "request_prompt_tokens")
    assert before >= 1 and _hist_count(text, "request_generation_tokens") == before
    httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3}, timeout=60)
    text = httpx.get(f"{url}/metrics").text
    assert _hist_count(text, "request_prompt_tokens") == before + 1
    assert _hist_sum(text, "request_generation_tokens") >= 4 + 3
    assert _hist_sum(text, "request_prompt_tokens") >= 2 * prompt_len


def _hist_count(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(f"vllm:{name}_count"))


def _hist_sum(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(f"vllm:{name}_sum"))
