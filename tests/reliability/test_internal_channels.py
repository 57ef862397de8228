"""Internal channels admit only the cluster (issue 29 item 4), on a real cluster (1 prefill + 1 decode
worker, KV over gloo, the API server a separate process): a process on the cluster's network without
the cluster's secret sends well-formed frames to the token stream of a request in flight, to the
router's stats sink, to the decode worker's KV control inbox, to the prefill worker's dispatch
socket and to the router's answer socket. Each is dropped (the stream's text
is the reference's, no step record or transfer appears) and counted in /metrics
(`pdserve:frames_rejected_total{channel=...}`), and the cluster serves on. (The sockets bind the
loopback in a one-node cluster: test_disconnects.py::test_internal_sockets_listen_on_loopback_only;
the frame checks themselves: test_security.py.) A client of the KV rendezvous store forges its
entries and fills it. The store's warden sweeps every 50 ms throughout the module (every test's
transfers go on under it); the last test kills the store's process, which stops the cluster."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import msgspec
import pytest
import zmq

from cluster.sampling.sampling_params import SamplingParams
from cluster.wire.messages import GenerateRequest, PrefillResult, PrefillTask
from cluster.wire.prefill_dispatch import PrefillAnswer, PrefillDispatch, encode_answer, encode_dispatch
from cluster.wire.stream_messages import DecodeStepRecord, StepRecordBatch, StreamBatch, StreamDelta, encode
from cluster.transport.channel import Abort, Begin
from reliability_harness import MODEL, start_cluster, wait_clean

PROMPT = "Story 3: w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12"


@pytest.fixture(scope="module")
def cluster(ray_session, demo_model_dir):
    sc = start_cluster(demo_model_dir, prefill_workers=1, decode_workers=1, local_prefill_threshold=10,
                       kv_store_sweep_s=0.05)
    yield sc
    sc.shutdown()


def _rejected(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^pdserve:frames_rejected_total\{channel="([a-z_]+)",model_name="[^"]+"\} (\S+)$', text, re.M)}


def _push(endpoint: str, frames) -> None:
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(endpoint)
    for f in frames:
        sock.send_multipart(f) if isinstance(f, list) else sock.send(f)
    sock.close()


def test_frames_without_the_clusters_secret_are_dropped_and_counted(cluster, reference_engine):
    sc, router = cluster, cluster.router
    ref = reference_engine.generate([PROMPT], [SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)])[0]
    store = sc.workers.kv_group.store.client()
    # (the value is sealed: 16 bytes of MAC, then the entry; cluster/transport/authenticated_store.py)
    inbox = msgspec.msgpack.decode(store.get(f"{sc.tag}/ctl/decode-0")[16:])["endpoint"]
    sink = next(iter(sc.router_server.gateways.values())).sink
    before = _rejected(sc.url)

    async def main():
        async with httpx.AsyncClient(base_url=sc.url, timeout=120) as c:
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 120, "temperature": 0, "ignore_eos": True,
                    "stream": True}
            text = ""
            forged = False
            async with c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    ev = json.loads(line[6:])
                    assert "error" not in ev, ev
                    text += ev["choices"][0]["text"] or ""
                    if not forged and router.inflight:
                        forged = True
                        rs = next(iter(router.inflight.values()))
                        wrid = rs.worker_request_id
                        # Someone else's text into this stream, its end, and a bogus transfer and step.
                        fake = encode(StreamBatch("decode-0", 10**6, (StreamDelta(wrid, (7,), " INJECTED"),
                                                                      StreamDelta(wrid, (), "", "stop"))))
                        _push(sink, [fake, [b"\x00" * 32, fake], [fake, fake]])
                        _push(sc.router_server.stats_sink, [encode(StepRecordBatch(
                            (DecodeStepRecord("decode-0", 1, time.time(), 999, 1024, 9.0),)))])
                        begin = msgspec.msgpack.encode(Begin("prefill-0", 999, False, 0, [(10**6, wrid, 16, b"\0" * 4)]))
                        _push(inbox, [begin, [b"\x01" * 32, msgspec.msgpack.encode(Abort("prefill-0", 0, wrid))]])
                        # ... and a prompt into the prefill worker's dispatch socket.
                        task = encode_dispatch(PrefillDispatch(1, PrefillTask(GenerateRequest(
                            "forged", (1, 2, 3), SamplingParams(max_tokens=4), 0, time.time()))))
                        _push(router.view("prefill-0").stats.extra["dispatch"], [task, [b"\x02" * 32, task]])
                        # ... and its answer into the router's answer socket.
                        answer = encode_answer(PrefillAnswer("prefill-0", "?", 1, PrefillResult(wrid, 7, 0, 0, 0, 0)))
                        _push(sc.prefill_answers.endpoint, [answer, [b"\x03" * 32, answer]])
            return text, forged

    text, forged = asyncio.run(main())
    assert forged and text == ref.text and "INJECTED" not in text
    deadline = time.monotonic() + 10
    want = {"token_stream": 3.0, "stats_sink": 1.0, "kv_control": 2.0, "prefill_dispatch": 2.0, "prefill_answer": 2.0}
    while True:  # the workers' counts reach /metrics with the router's next stats poll
        got = _rejected(sc.url)
        delta = {k: got.get(k, 0.0) - before.get(k, 0.0) for k in ("token_stream", "stats_sink", "kv_control", "prefill_dispatch",
                                                          "prefill_answer")}
        if delta == want or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    print(f"\nforged frames dropped and counted: {delta}")
    assert delta == want
    steps = json.loads(httpx.get(f"{sc.url}/stats", params={"limit": 1000}).text)["decode_steps"]
    assert not any(s["batch_size"] == 999 for s in steps)
    # The cluster serves on: a remote prefill (through the KV control inbox) and a local one.
    for prompt in (PROMPT, "Story 4: w1"):
        r = httpx.post(f"{sc.url}/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    wait_clean(sc)


def test_store_forgeries_change_nothing_in_a_serving_cluster(cluster, reference_engine):
    """Issue 37 item 1 on the real cluster: a client of the KV rendezvous store without the secret
    rewrites the decode worker's control endpoint, marks both workers' heartbeats shut down (what the
    raw counters said before) and sets the decode worker's incarnation counter back, while requests
    go through the prefill worker. Every forgery is rejected: each stream is the reference's, no
    worker is declared dead, and the decode worker's real entry is back within a heartbeat."""
    import datetime

    import ray
    import torch.distributed as dist

    sc = cluster

    def transfers() -> tuple[int, int]:
        extra = ray.get(sc.workers.prefill["prefill-0"].stats.remote()).extra
        return extra["transfers"], extra["failures"]
    sent_before, failed_before = transfers()
    store = sc.workers.kv_group.store.client()
    rogue = dist.TCPStore("127.0.0.1", sc.workers.kv_group.store.port, is_master=False, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10), use_libuv=True)
    ns = sc.tag
    real_ctl = store.get(f"{ns}/ctl/decode-0")
    prompts = [f"Story {k}: w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 w13" for k in (5, 6, 7)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    refs = reference_engine.generate(prompts, [params] * len(prompts))
    sink = zmq.Context.instance().socket(zmq.PULL)
    port = sink.bind_to_random_port("tcp://127.0.0.1")
    forged_ctl = msgspec.msgpack.encode({"endpoint": f"tcp://127.0.0.1:{port}", "incarnation": 99})
    for prompt, ref in zip(prompts, refs):
        rogue.set(f"{ns}/ctl/decode-0", b"\0" * 16 + forged_ctl)
        rogue.set(f"{ns}/hb/decode-0", b"-1000000000")
        rogue.set(f"{ns}/hb/prefill-0", b"-1000000000")
        rogue.add(f"{ns}/inc/decode-0", -100)
        r = httpx.post(f"{sc.url}/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0,
                             "ignore_eos": True})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref.text, r.text
    assert sink.poll(100) == 0  # nothing was redirected to the forged endpoint
    sink.close(0)
    deadline = time.monotonic() + 10
    while store.get(f"{ns}/ctl/decode-0") != real_ctl and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.get(f"{ns}/ctl/decode-0") == real_ctl  # put back by the decode worker
    # The prefill worker counts a transfer once its send returned, which may be after the decode side
    # already streamed the whole reply (a loaded host): wait for the count, bounded.
    deadline = time.monotonic() + 30
    while (sent := transfers()[0]) - sent_before < len(prompts) and time.monotonic() < deadline:
        time.sleep(0.05)
    sent, failed = transfers()
    assert sent - sent_before == len(prompts) and failed == failed_before  # each through the KV path, none lost
    wait_clean(sc)


def _through_prefill(sc, prompts, refs) -> None:
    """Each prompt served through the prefill worker (a KV transfer each), its text the reference's."""
    import ray

    def transfers() -> tuple[int, int]:
        extra = ray.get(sc.workers.prefill["prefill-0"].stats.remote()).extra
        return extra["transfers"], extra["failures"]
    sent_before, failed_before = transfers()
    for prompt, ref in zip(prompts, refs):
        r = httpx.post(f"{sc.url}/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref.text, r.text
    deadline = time.monotonic() + 30  # (counted once the send returned: may be after the reply streamed)
    while transfers()[0] - sent_before < len(prompts) and time.monotonic() < deadline:
        time.sleep(0.05)
    sent, failed = transfers()
    assert sent - sent_before == len(prompts) and failed == failed_before


def test_a_store_fill_grows_neither_the_launcher_nor_the_store_and_serving_goes_on(cluster, reference_engine):
    """Issue 37 item 1's last attack: a store client without the secret writes 64 values of 8 MiB
    (half under keys the cluster never writes, half under claim keys of the real pair), overwrites the
    decode worker's control entry with 8 MiB, and floods 20 000 small unsealed keys. The store runs in
    its own process (cluster/transport/store_process.py): the launcher (this process) does not grow;
    the warden removes the junk (tombstones in the cluster's key shapes), the store's process stays
    under its cap, and requests through the prefill worker are the reference's, none lost."""
    import psutil

    sc = cluster
    sp = sc.workers.kv_group.store
    ns, MiB = sc.tag, 1 << 20
    me = psutil.Process()
    reader = sp.client()
    real_ctl = reader.get(f"{ns}/ctl/decode-0")
    prompts = [f"Story {k}: w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 w13" for k in (8, 9, 10)]
    refs = reference_engine.generate(prompts, [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)] * 3)
    print(f"\nthe cluster's own store entries: {len(reader.list_keys())}; the store's start {sp.startup}, "
          f"of which the cluster's start waited {sc.workers.kv_group.store_wait_s:.3f} s")
    rss_before = me.memory_info().rss
    rogue, big = sp.client(), b"x" * (8 * MiB)
    t0 = time.monotonic()
    for i in range(64):
        rogue.set(f"{ns}/x/prefill-0/decode-0.1/{10**6 + i}" if i % 2 else f"fill/{i}", big)
    rogue.set(f"{ns}/ctl/decode-0", big)
    for i in range(20000):
        rogue.set(f"flood/{i}", b"1")
    rogue.num_keys()  # (sets are not answered: this round trip says all of them were applied)
    written = time.monotonic() - t0
    peak_child = psutil.Process(sp.pid).memory_info().rss

    def junk_left() -> int:
        keys = reader.list_keys()
        return sum(k.startswith(("fill/", "flood/")) for k in keys) + sum(
            len(reader.get(k)) > 0 for k in keys if k.startswith(f"{ns}/x/prefill-0/decode-0.1/1000"))
    deadline = time.monotonic() + 60
    while junk_left() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert junk_left() == 0
    cleaned = time.monotonic() - t0
    deadline = time.monotonic() + 10  # the decode worker puts its entry back at its next heartbeat
    while reader.get(f"{ns}/ctl/decode-0") != real_ctl and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reader.get(f"{ns}/ctl/decode-0") == real_ctl
    _through_prefill(sc, prompts, refs)
    grown = me.memory_info().rss - rss_before
    stats = sp.stats()
    print(f"attack written in {written:.1f} s, junk gone {cleaned:.1f} s after its start; launcher RSS "
          f"{grown / MiB:+.1f} MiB; store process RSS at the attack's end {peak_child / MiB:.0f} MiB, "
          f"VmData {stats['vm_data'] / MiB:.0f} MiB (cap {sp.startup['data_limit'] / MiB:.0f} MiB); warden {stats}")
    assert grown < 64 * MiB  # (the attack wrote 520 MiB; in the launcher's own store it all stayed here)
    assert sp.exited() is None and stats["vm_data"] <= sp.startup["data_limit"]
    assert stats["deleted"] >= 20032 and stats["tombstoned"] >= 32
    wait_clean(sc)


def test_a_dead_store_process_stops_the_cluster(cluster):
    """The store's process killed (its cap, a crash): the launcher logs it, drains and stops, and says
    why (the CLI exits 2 with it), as for a dead API server. Last in the module: it ends the cluster."""
    import os
    import signal

    sc = cluster
    os.kill(sc.workers.kv_group.store.pid, signal.SIGKILL)
    sc._thread.join(60)
    assert not sc._thread.is_alive()
    assert sc.failure == "the KV rendezvous store's process exited with code -9"
