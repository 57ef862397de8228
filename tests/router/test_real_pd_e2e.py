"""The whole disaggregated path with the real workers: gateway -> router -> PrefillWorkerActor ->
KV over the real transport -> DecodeWorkerActor -> token stream -> HTTP."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import ray

from cluster.sampling.sampling_params import SamplingParams
from serving_harness import completion_text, wait_idle

MODEL = "pdserve-demo"


def test_disaggregated_greedy_equals_engine(real_pd_cluster, reference_engine):
    prompts = [("Tell me a story about a dragon who lived in the mountains" + " again" * i) if i % 3 else "Hi there"
               for i in range(12)]
    lens = [5 + (i * 3) % 17 for i in range(12)]
    refs = reference_engine.generate(prompts, [SamplingParams(max_tokens=m, temperature=0.0) for m in lens])

    async def one(client, i):
        body = {"model": MODEL, "prompt": prompts[i], "max_tokens": lens[i], "temperature": 0, "stream": i % 2 == 0}
        return await completion_text(client, body)

    async def main():
        async with httpx.AsyncClient(base_url=real_pd_cluster.url, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(len(prompts))))

    # Only this test's records: the session's cluster served other tests' requests before.
    cursor = httpx.get(f"{real_pd_cluster.url}/stats", params={"cursor": 10**12}).json()["cursor"]
    assert asyncio.run(main()) == [r.text for r in refs]
    wait_idle(real_pd_cluster)
    text = httpx.get(f"{real_pd_cluster.url}/metrics").text
    transferred = [line for line in text.splitlines() if line.startswith("pdserve:kv_transfer_bytes_total")]
    assert transferred and float(transferred[0].split()[-1]) > 0, transferred
    local = [line for line in text.splitlines() if line.startswith("pdserve:local_prefill_requests_total")]
    assert float(local[0].split()[-1]) >= 4  # the "Hi there" prompts (<= 12 tokens) stayed on the decode worker
    prefill = next(iter(real_pd_cluster.workers.prefill.values()))
    p_stats = ray.get(prefill.stats.remote())
    assert p_stats.outstanding_prefill_tokens == 0
    assert p_stats.extra["dispatch_received"] > 0  # the prompts came as frames (prefill_dispatch "zmq")

    # /stats: the decode steps that ran and each request's TTFT split into its parts. A request whose
    # stream ended before its prefill worker's answer reached the router is recorded once the answer is
    # in (router/stats/request_records.py): look until all 8 are.
    deadline = time.monotonic() + 30
    while True:
        stats = httpx.get(f"{real_pd_cluster.url}/stats", params={"cursor": cursor}).json()
        if sum(not r["local_prefill"] for r in stats["requests"]) >= 8 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    steps = stats["decode_steps"]
    assert steps and all(s["batch_size"] >= 1 and s["step_ms"] > 0 for s in steps)
    assert all(s["padded_rows"] == (s["bucket"] - s["batch_size"] if s["bucket"] else 0) for s in steps)
    remote = [r for r in stats["requests"] if not r["local_prefill"]]
    assert len(remote) == 8
    for r in remote:
        # The parts follow the request gateway -> router -> prefill worker -> gateway, in order, and
        # add up to its TTFT (router.stats.step_stats.TTFTPoints).
        parts = r["ttft_parts_ms"]
        # From the HTTP app's receipt (intake: up to the gateway's submit) to, streamed, the first
        # token's event written (write).
        assert list(parts)[:8] == ["intake", "admission", "placement", "dispatch", "prefill_queue", "forward",
                                   "sample", "delivery"] and list(parts)[8:] in ([], ["write"])
        assert all(v >= 0 for v in parts.values()), (parts, r["ttft_points"])
        assert abs(sum(parts.values()) - r["ttft_ms"]) < 1e-3 and parts["forward"] > 0 and r["transfer_ms"] > 0
        assert r["forward_device_ms"] > 0 and r["forward_host_ms"] > 0 and r["pass_tokens"] > 0
        points = list(r["ttft_points"].values())
        assert points == sorted(points), r["ttft_points"]
    assert sum("write" in r["ttft_parts_ms"] for r in remote) == 4  # the streamed ones (even i, i % 3 != 0)


def test_the_first_token_from_the_prefill_worker_keeps_its_logprobs_and_counts_once(real_pd_cluster,
                                                                                      reference_engine):
    """The first token reaches the client from the prefill worker (prefill_worker/first_token_sender.py),
    the rest from the decode worker: streamed and not, the token ids' logprobs and top entries are the
    engine's, each token once (usage), the first chunk carries the first token."""
    prompt = "Tell me a story about a dragon who lived in the mountains and guarded gold"  # > 12 tokens
    n = 6
    (ref,) = reference_engine.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0, logprobs=2,
                                                                ignore_eos=True))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 2, "ignore_eos": True}
    whole = httpx.post(f"{real_pd_cluster.url}/v1/completions", json=body, timeout=60).json()
    chunks = []
    with httpx.stream("POST", f"{real_pd_cluster.url}/v1/completions", json={**body, "stream": True},
                      timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    streamed = [c["choices"][0] for c in chunks if c["choices"]]
    assert streamed[0]["logprobs"]["token_logprobs"], streamed[0]  # the first chunk: the first token
    for lps, text in ((whole["choices"][0]["logprobs"], whole["choices"][0]["text"]),
                      ({"token_logprobs": [x for c in streamed for x in c["logprobs"]["token_logprobs"]],
                        "top_logprobs": [x for c in streamed for x in c["logprobs"]["top_logprobs"]]},
                       "".join(c["text"] for c in streamed))):
        assert text == ref.text and len(lps["token_logprobs"]) == n
        for got, want, top in zip(lps["token_logprobs"], ref.logprobs, lps["top_logprobs"]):
            assert abs(got - want.logprob) < 1e-4 and len(top) == 2
    assert whole["usage"]["completion_tokens"] == n


def test_disaggregated_disconnect_frees_blocks(real_pd_cluster):
    with httpx.stream("POST", f"{real_pd_cluster.url}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "A long story about the sea, the wind and the sailors " * 3,
            "max_tokens": 3000, "ignore_eos": True, "stream": True}) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
    wait_idle(real_pd_cluster)
    assert not real_pd_cluster.router.inflight


def test_a_repeated_prefix_is_reported_cached_and_not_transferred_again(real_pd_cluster, reference_engine):
    """Two requests sharing a long prefix, one after the other: the second's usage says how much of
    its prompt the prefill worker found cached, its text is still the engine's, and the decode worker
    (which holds the first request's blocks) receives fewer KV bytes for it."""
    system = "You are a careful assistant. " + " ".join(f"rule {k} says w{k % 7}." for k in range(30))
    prompts = [system + " Question: the sea?", system + " Question: the wind and the sailors?"]
    sent = []
    for p in prompts:
        before = _transfer_bytes(real_pd_cluster.url)
        with httpx.stream("POST", f"{real_pd_cluster.url}/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": p, "max_tokens": 6, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        wait_idle(real_pd_cluster)
        text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
        assert text == reference_engine.generate([p], SamplingParams(max_tokens=6, temperature=0.0))[0].text
        sent.append((events[-1]["usage"], _transfer_bytes(real_pd_cluster.url) - before))
    (u1, b1), (u2, b2) = sent
    shared = len(reference_engine.tokenizer.encode(system)) // 16 * 16  # whole blocks of the shared part
    assert u2["prompt_tokens_details"]["cached_tokens"] >= shared - 16 > 0
    assert u1["prompt_tokens"] - u1["prompt_tokens_details"]["cached_tokens"] > u2["prompt_tokens"] - u2["prompt_tokens_details"]["cached_tokens"]
    assert 0 < b2 < b1  # the decode worker held the shared blocks: only the rest moved


def _transfer_bytes(url: str) -> float:
    lines = [x for x in httpx.get(f"{url}/metrics").text.splitlines() if x.startswith("pdserve:kv_transfer_bytes_total")]
    return float(lines[0].split()[-1])


def test_short_replies_wait_for_nothing_and_report_their_cached_tokens(real_pd_cluster, reference_engine):
    """`max_tokens: 1`, prefilled remotely: the last token reaches the gateway before the prefill
    worker's answer reaches the router (issue 36: the reply waited 5 s for a PrefillDone the gateway
    had dropped). Non-streamed, streamed with usage, and lm-eval's scoring shape (token-id prompt,
    echo, logprobs): each answers in well under a second, its cached_tokens right on a repeat."""
    system = "You are a terse assistant. " + " ".join(f"fact {k} is v{k % 5}." for k in range(24))
    ids = reference_engine.tokenizer.encode(system + " Score this.")
    shared = len(reference_engine.tokenizer.encode(system)) // 16 * 16
    bodies = [{"prompt": system + " Q1?"}, {"prompt": system + " Q2?", "stream": True,
                                            "stream_options": {"include_usage": True}},
              {"prompt": ids, "echo": True, "logprobs": 1}]
    with httpx.Client(base_url=real_pd_cluster.url, timeout=30) as client:
        for body in bodies:
            for attempt in range(2):  # the second finds the shared prefix in the prefill worker's cache
                t0 = time.perf_counter()
                r = client.post("/v1/completions", json={"model": MODEL, "max_tokens": 1, "temperature": 0, **body})
                took = time.perf_counter() - t0
                assert r.status_code == 200, r.text
                if body.get("stream"):
                    usage = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")][-1]["usage"]
                else:
                    usage = r.json()["usage"]
                assert took < 1.0, (body, took)
                assert usage["completion_tokens"] == 1
                if "echo" in body:  # prompt logprobs compute the whole prompt (as vLLM): nothing read from a cache
                    assert usage["prompt_tokens_details"]["cached_tokens"] == 0, usage
                elif attempt:
                    assert usage["prompt_tokens_details"]["cached_tokens"] >= shared - 16 > 0, usage
    wait_idle(real_pd_cluster)
    assert not real_pd_cluster.router.inflight
