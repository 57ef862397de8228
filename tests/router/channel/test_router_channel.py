"""The gateways' channel to the one router, in process (no Ray, no HTTP): message round trips, typed
refusals, two gateways each getting only their own requests' text from a decode worker's publisher,
/stats by cursor, and a gateway that goes away having its requests aborted (KV back in the pool)."""

from __future__ import annotations

import asyncio
import json
import tempfile
import time

import msgspec
import pytest

from cluster.errors import CapacityError, InvalidRequestError
from cluster.wire.messages import GenerateRequest
from cluster.sampling.sampling_params import SamplingParams
from cluster.wire.stream_messages import StreamDelta
from cluster.worker.worker_config import WorkerConfig
from router.requests.admission import AdmissionController, AdmissionLimits
from router.channel.client import RouterClient
from router.channel.messages import (ClusterState, Drain, FirstToken, Finish, Goodbye, Heartbeat, Hello, Migrate, Query,
                                     Reply, RequestFailed, Submit, WireError, decode_to_gateway, decode_to_router,
                                     encode, error_from_wire, error_to_wire)
from router.channel.server import RouterServer
from router.errors import DrainingError, NoHealthyWorkerError, OverloadedError
from router.stats.metrics import RouterMetrics
from router.router import Router, RouterConfig, WorkerClient
from router.streams.token_stream import TokenStreamReceiver
from router_fakes import FakeDecodeWorker

REQ = GenerateRequest("cmpl-1", (5, 6, 7), SamplingParams(max_tokens=9, temperature=0.5, top_k=3, seed=4,
                                                           stop=("x", "yz"), stop_token_ids=(2,), min_tokens=1),
                      11, 1700000000.5, reply_to="tcp://127.0.0.1:5555", resumed_tokens=2, resumed_chars=3)


@pytest.mark.parametrize("msg", [
    Hello("api-0", 123, "tcp://127.0.0.1:1"), Heartbeat("api-1", 3, 17, True), Submit(7, REQ),
    FirstToken("cmpl-1", 1.25), Finish("cmpl-1", True, None, 2.5, 0), Finish("cmpl-1", False, 1.0, 2.0, 9),
    Migrate(8, "cmpl-1", "cmpl-1.m1", (1, 2, 3), 5, "decode worker decode-0 died"), Query(9, "stats", 100, 50),
    Goodbye("api-0"),
])
def test_gateway_to_router_round_trip(msg):
    assert decode_to_router(encode(msg)) == msg


@pytest.mark.parametrize("msg", [
    Reply(1), Reply(2, WireError("overloaded", "busy", None, 3)), Reply(3, body=b'{"a": 1}'),
    Reply(4, end=StreamDelta("cmpl-1.m2", (), "", "error", "gone")), RequestFailed("cmpl-1", "cmpl-1.m1", "died"),
    ClusterState(True, 2, 1, 4096, 2, 2, False), Drain(6.0),
])
def test_router_to_gateway_round_trip(msg):
    assert decode_to_gateway(encode(msg)) == msg


def test_a_bad_request_is_refused_when_decoded_and_nothing_unpickles():
    bad = msgspec.msgpack.encode({"type": "Submit", "call_id": 1, "request": {
        "request_id": "a", "prompt_token_ids": [1], "params": {"max_tokens": 0}, "seed": 1, "arrival_time": 0.0}})
    with pytest.raises(InvalidRequestError):  # SamplingParams' own validation runs on decode
        decode_to_router(bad)
    with pytest.raises(msgspec.DecodeError):
        decode_to_router(b"\x80\x04\x95garbage-pickle")


@pytest.mark.parametrize("error", [
    InvalidRequestError("too long", "max_tokens"), OverloadedError("busy", 7), CapacityError("full"),
    DrainingError("shutting down"), NoHealthyWorkerError("none"),
])
def test_refusals_come_back_as_the_same_error(error):
    reply = decode_to_gateway(encode(Reply(3, error_to_wire(error))))
    got = error_from_wire(reply.error)
    assert type(got) is type(error) and str(got) == str(error)
    assert getattr(got, "param", None) == getattr(error, "param", None)
    assert getattr(got, "retry_after_s", None) == getattr(error, "retry_after_s", None)


def test_an_error_that_is_none_of_ours_comes_back_as_a_runtime_error():
    """A bug on the router's side crosses as "internal", named by its class (the gateway's catch-all
    answers it with a 500 that does not quote it)."""
    got = error_from_wire(decode_to_gateway(encode(Reply(4, error_to_wire(KeyError("x"))))).error)
    assert type(got) is RuntimeError and str(got) == "KeyError: 'x'"
    assert type(error_from_wire(WireError("no-such-kind", "m"))) is RuntimeError  # a kind this side lacks


@pytest.fixture(scope="module")
def decode_worker(demo_model_dir):
    cfg = WorkerConfig(model_dir=str(demo_model_dir), num_blocks=64, max_num_seqs=16)
    d = FakeDecodeWorker("decode-0", cfg, None)
    yield d
    d.shutdown()


def test_two_gateways_each_get_only_their_requests(decode_worker, reference_engine):
    prompts = [[0] + list(range(20 + i, 30 + i)) for i in range(6)]
    refs = reference_engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))

    async def main():
        tmp = tempfile.mkdtemp()
        rs = RouterServer(f"ipc://{tmp}/router", "127.0.0.1", RouterMetrics("m"), gateways_expected=2)
        decode_worker.publisher.stats_sink = rs.stats_sink
        rs.attach(Router([], [WorkerClient("decode-0", "decode", decode_worker)],
                         AdmissionController(AdmissionLimits(max_model_len=4096, block_size=16)),
                         RouterConfig(stats_interval_s=0.02)))
        await rs.start()
        gws = []
        for i in range(2):
            ts = TokenStreamReceiver()
            ts.start()
            client = RouterClient(rs.address, f"api-{i}", ts.address, heartbeat_s=0.05)
            client.status = lambda ts=ts: (ts.open_streams, 0, False)
            await client.start()
            gws.append((ts, client))
        # The router pushes its state on change: both gateways hear both are up. Within a minute, not 5 s:
        # this module runs in the test run's other stream (nice 10), which may get a tenth of a core.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if rs.ready and all(c.state is not None and c.state.gateways_up == 2 and c.state.ready for _, c in gws):
                break
            await asyncio.sleep(0.02)
        assert all(c.state is not None and c.state.gateways_up == 2 and c.state.ready for _, c in gws)

        async def run(i: int) -> tuple[list[int], str, str | None]:
            ts, client = gws[i % 2]
            rid = f"r{i}"
            req = GenerateRequest(rid, tuple(prompts[i]), SamplingParams(max_tokens=12, temperature=0.0,
                                                                         ignore_eos=True), 0, 0.0, reply_to=ts.address)
            mailbox = ts.register(rid)
            await client.submit(req)
            tokens, text = [], ""
            while True:
                d = await asyncio.wait_for(mailbox.next(), 30)
                tokens += d.token_ids
                text += d.text
                if d.finish_reason:
                    ts.unregister(rid)
                    client.finish(rid, False, 1.0, len(tokens))
                    return tokens, text, d.finish_reason
        out = await asyncio.gather(*(run(i) for i in range(len(prompts))))
        for (tokens, text, finish), ref in zip(out, refs):
            assert tokens == list(ref.token_ids) and text == ref.text and finish == "length"
        # Each gateway's receiver got frames only for its own requests: nothing was dropped as unknown.
        assert all(ts.batches_received > 0 for ts, _ in gws)

        # /stats from a cursor: the steps the worker ran and the requests the gateways finished (their
        # finish reports reach the router after the last token: look until all have).
        deadline = time.monotonic() + 60
        while True:
            body = json.loads(await gws[0][1].query("stats", 0, 20_000))
            if len(body["requests"]) >= len(prompts) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        assert body["missed"] == 0 and body["cursor"] >= len(body["decode_steps"]) + len(body["requests"])
        assert len(body["requests"]) == len(prompts) and body["decode_steps"]
        again = json.loads(await gws[1][1].query("stats", body["cursor"], 100))
        assert not again["decode_steps"] and not again["requests"] and again["cursor"] == body["cursor"]
        assert b"pdserve:decode_step_seconds" in await gws[1][1].query("metrics")

        # A gateway that goes away: its in-flight request is aborted on the worker (blocks come back).
        ts, client = gws[1]
        long_req = GenerateRequest("long", tuple(prompts[0]), SamplingParams(max_tokens=900, ignore_eos=True), 0, 0.0,
                                   reply_to=ts.address)
        ts.register("long")
        await client.submit(long_req)
        assert "long" in rs.router.inflight
        await client.stop()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if "long" not in rs.router.inflight and decode_worker.stats().running == 0:
                break
            await asyncio.sleep(0.05)
        assert "long" not in rs.router.inflight and decode_worker.stats().running == 0
        assert not rs.gateways["api-1"].up and rs.gateways_up == 1
        await gws[0][1].stop()
        for ts, _ in gws:
            await ts.stop()
        await rs.stop()
    asyncio.run(main())


# A dropped owner of a ZMQ context, collected in a reference cycle, must not hang the process.
_DROPPED_OWNER = """
import gc, sys
from router.channel.client import RouterClient
from router.channel.server import RouterServer
from router.stats.metrics import RouterMetrics
from router.streams.token_stream import TokenStreamReceiver
tmp = sys.argv[1]
rs = RouterServer(f"ipc://{tmp}/router", "127.0.0.1", RouterMetrics("m"))
ts = TokenStreamReceiver()
rc = RouterClient(rs.address, "api-0", ts.address)
for owner in (rs, ts, rc):
    owner.cycle = owner  # dropped without close(), in a cycle: only the garbage collector takes it
del rs, ts, rc, owner
gc.collect()
print("collected")
"""


def test_a_dropped_socket_owner_is_collected_without_hanging(tmp_path):
    """HAZARD (cluster/wire/socket_bounds.py close_on_collect): before, Context.__del__ blocked in term()
    on sockets it could no longer see (a test stuck 600 s in a GC pass)."""
    import subprocess
    import sys

    try:
        # A hang is for ever; the child's start and imports are seconds of CPU, which the other test
        # stream (nice 10) may get a tenth of a core for: generous.
        out = subprocess.run([sys.executable, "-c", _DROPPED_OWNER, str(tmp_path)], capture_output=True, text=True,
                             timeout=240)
    except subprocess.TimeoutExpired:
        raise AssertionError("collecting a dropped socket owner hung the process") from None
    assert out.returncode == 0 and out.stdout.split() == ["collected"], out.stderr[-2000:]
