"""Router with in-process worker doubles (no Ray): placement, reserve retries, aborts, health, and
the membership API the application layer uses (role switches, the planner's request mix, drain).
Its parts on their own: test_placement_walk.py, test_worker_health.py, test_migrator.py."""

from __future__ import annotations

import asyncio

import pytest

from cluster.wire.messages import GenerateRequest
from cluster.sampling.sampling_params import SamplingParams
from cluster.worker.worker_config import WorkerConfig
from router.requests.admission import AdmissionController, AdmissionLimits
from router.errors import NoHealthyWorkerError
from router.router import Router
from router.router_config import RouterConfig
from router.streams.token_stream import TokenStreamReceiver
from router.workers.worker_client import WorkerClient
from router_fakes import FakeDecodeWorker, FakePrefillWorker, StubWorker


@pytest.fixture(scope="module")
def workers(demo_model_dir):
    cfg = WorkerConfig(model_dir=str(demo_model_dir), num_blocks=12, max_num_seqs=8)
    d0, d1 = FakeDecodeWorker("decode-0", cfg, None), FakeDecodeWorker("decode-1", cfg, None)
    p = FakePrefillWorker("prefill-0", cfg, prefill_delay_s=0.0)
    p.init_transport({"decode": {"decode-0": d0, "decode-1": d1}})
    yield p, d0, d1
    d0.shutdown()
    d1.shutdown()


def req(rid, n=5, max_tokens=4):
    return GenerateRequest(rid, tuple(range(5, 5 + n)), SamplingParams(max_tokens=max_tokens, temperature=0.0), 0, 0.0)


def make_router(workers, **kw):
    p, d0, d1 = workers
    admission = AdmissionController(AdmissionLimits(max_model_len=4096, block_size=16))
    return Router([WorkerClient("prefill-0", "prefill", p)],
                  [WorkerClient("decode-0", "decode", d0), WorkerClient("decode-1", "decode", d1)],
                  admission, RouterConfig(stats_interval_s=0.01, reserve_wait_s=0.1, **kw))


async def _drain(d, rid, timeout=10.0):
    """Requests without a reply_to stay with the double's publisher; wait for the request's final delta."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        for b in d.poll_token_batches():
            for delta in b.deltas:
                if delta.request_id == rid and delta.finish_reason:
                    return delta
        await asyncio.sleep(0.01)
    raise TimeoutError(rid)


def test_place_run_and_release(workers):
    async def main():
        router = make_router(workers)
        await router.start()
        rs = await router.submit(req("a"))
        assert rs.prefill_worker_id == "prefill-0" and rs.decode_worker_id in ("decode-0", "decode-1")
        d = workers[1] if rs.decode_worker_id == "decode-0" else workers[2]
        await _drain(d, "a")
        router.finish("a")
        assert router.admission.num_admitted == 0 and not router.inflight
        rs2 = await router.submit(req("b"))
        assert rs2.decode_worker_id != rs.decode_worker_id  # idle equals alternate
        await _drain(workers[1] if rs2.decode_worker_id == "decode-0" else workers[2], "b")
        router.finish("b")
        await router.stop()
    asyncio.run(main())


def test_local_prefill_below_threshold(workers):
    async def main():
        router = make_router(workers, local_prefill_threshold=8)
        await router.start()
        before = workers[0].submitted
        rs = await router.submit(req("short", n=6))
        assert rs.local_prefill and rs.prefill_worker_id is None and workers[0].submitted == before
        router.finish("short", abort=True)
        await router.stop()
    asyncio.run(main())


def test_full_decode_workers_give_429_and_abort_frees(workers):
    async def main():
        router = make_router(workers)
        await router.start()
        # 11 usable blocks per worker; a 150-token prompt needs 10: one per worker.
        a = await router.submit(req("big-a", n=150, max_tokens=2))
        await asyncio.sleep(0.05)
        b = await router.submit(req("big-b", n=150, max_tokens=2))
        assert {a.decode_worker_id, b.decode_worker_id} == {"decode-0", "decode-1"}
        router.finish("big-a", abort=True)
        router.finish("big-b", abort=True)
        await asyncio.sleep(0.1)
        await router.poll_once()
        assert all(v.free_blocks == v.total_blocks for v in router.decode_views())
        await router.stop()
    asyncio.run(main())


def test_dead_worker_fails_its_requests_and_503_when_none_left(workers):
    class Dead:
        def stats(self):
            raise ConnectionError("gone")

        def abort(self, rid):
            raise ConnectionError("gone")

    async def main():
        failed = asyncio.Queue()
        router = Router([], [WorkerClient("decode-x", "decode", workers[1])],
                        AdmissionController(AdmissionLimits(max_model_len=4096, block_size=16)),
                        RouterConfig(stats_interval_s=0.01, unhealthy_after_failures=2),
                        notify=lambda rs, error: failed.put_nowait((rs.request_id, error)))
        await router.start()
        rs = await router.submit(req("doomed"))
        assert rs.local_prefill  # no prefill worker: prefill on the decode worker
        router.clients["decode-x"].handle = Dead()
        rid, error = await asyncio.wait_for(failed.get(), 5)  # the gateway is told
        assert rid == "doomed" and "decode-x" in error and rs.lost
        # Nowhere left to migrate it: the gateway's Migrate ends it with an error.
        end = await router.migrate("doomed", "doomed.m1", (), 0, error)
        assert end[0] == "error" and "no healthy decode worker" in end[1]
        router.finish("doomed", abort=True)
        with pytest.raises(NoHealthyWorkerError):
            await router.submit(req("next"))
        assert not router.ready
        await router.stop()
        workers[1].abort("doomed")
    asyncio.run(main())


def test_token_stream_dispatch_over_zmq():
    import zmq

    from cluster.wire.frame_auth import TOKEN_STREAM, FrameSigner
    from cluster.wire.stream_messages import StreamBatch, StreamDelta, encode

    async def main():
        stream = TokenStreamReceiver(secret=b"k" * 32)
        stream.start()
        mailbox = stream.register("r1")
        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.connect(stream.address)
        signer = FrameSigner(b"k" * 32, TOKEN_STREAM)
        sock.send_multipart(signer.sign(b"not msgpack"))  # dropped, the stream survives
        for batch in (StreamBatch("d0", 1, (StreamDelta("r1", (5,), "a"), StreamDelta("gone", (1,), "x"))),
                      StreamBatch("d0", 2, (StreamDelta("r1", (6,), "b"),)),
                      StreamBatch("d0", 3, (StreamDelta("r1", (7,), "c", "length"), StreamDelta("r1", (8,))))):
            sock.send_multipart(signer.sign(encode(batch)))
        await asyncio.sleep(0.5)
        # Everything queued comes out merged, up to the delta that ends the request.
        assert await asyncio.wait_for(mailbox.next(), 5) == StreamDelta("r1", (5, 6, 7), "abc", "length")
        assert stream.open_streams == 1 and stream.batches_received == 3
        sock.close(linger=0)
        await stream.stop()
    asyncio.run(main())


def test_token_stream_deadline_without_a_task_per_read():
    """A reader that waits longer than token_timeout_s gets an error delta from the one watchdog."""
    async def main():
        stream = TokenStreamReceiver(token_timeout_s=0.2)
        stream.start()
        mailbox = stream.register("slow")
        delta = await asyncio.wait_for(mailbox.next(), 5)
        assert delta.finish_reason == "error" and "no token for 0.2s" in delta.error
        await stream.stop()
    asyncio.run(main())


def test_router_learns_graph_buckets_from_the_decode_worker(demo_model_dir):
    """The router pads-aware placement reads the buckets the worker really captured: for explicit
    buckets 3,5 that is [3, 5] (a policy recomputed in the router once assumed (3, 5, 128))."""
    from decode_worker.decode_worker import DecodeWorker

    cfg = WorkerConfig(model_dir=str(demo_model_dir), dtype="float32", num_blocks=16, max_num_seqs=128,
                       graph_buckets=(3, 5))
    worker = DecodeWorker("decode-0", cfg)
    try:
        router = Router([], [WorkerClient("decode-0", "decode", worker)],
                        AdmissionController(AdmissionLimits(max_model_len=4096, block_size=16)))
        asyncio.run(router.poll_once())
        stats = router.views["decode-0"].stats
        assert stats.graph_buckets == tuple(worker.graph_runner.buckets) == (3, 5)
        assert stats.max_num_seqs == 128
        assert worker.graph_runner.padded_size(4) == 5 and worker.graph_runner.padded_size(6) == 6
    finally:
        worker.shutdown()


def _stub_router(prefill=(), decode=(), **kw) -> Router:
    return Router([WorkerClient(w.worker_id, "prefill", w) for w in prefill],
                  [WorkerClient(w.worker_id, "decode", w) for w in decode],
                  AdmissionController(AdmissionLimits(max_model_len=4096, block_size=16)),
                  RouterConfig(stats_interval_s=0.01, reserve_wait_s=0.1, **kw))


def test_membership_a_worker_joins_drains_and_leaves():
    async def main():
        d0, d1, p0 = StubWorker("d0", "decode"), StubWorker("d1", "decode"), StubWorker("p0", "prefill")
        router = _stub_router(decode=[d0])
        await router.start()
        await router.add_worker(WorkerClient("d1", "decode", d1))
        assert router.view("d1").healthy and router.decode_ids == ["d0", "d1"]  # polled as it joined
        await router.add_worker(WorkerClient("p0", "prefill", p0))
        assert [v.worker_id for v in router.prefill_views()] == ["p0"]
        rs = await router.submit(req("a"))
        held = rs.decode_worker_id
        router.drain_worker(held)
        assert await router.wait_drained(held, 0.05) == 1  # still running it
        rs2 = await router.submit(req("b"))
        assert rs2.decode_worker_id != held  # a draining worker takes nothing new
        router.finish("a")
        assert await router.wait_drained(held, 1.0) == 0
        router.remove_worker(held)
        assert held not in router.views and held not in router.decode_ids and router.incarnation(held) is None
        with pytest.raises(ValueError, match="at least one decode worker"):
            router.remove_worker(router.decode_ids[0])
        with pytest.raises(KeyError):
            router.view(held)
        router.finish("b", abort=True)
        await router.stop()
    asyncio.run(main())


def test_removing_a_worker_fails_over_what_it_still_holds():
    async def main():
        failed = []
        d0, d1 = StubWorker("d0", "decode", free_blocks=100), StubWorker("d1", "decode", free_blocks=90)
        router = _stub_router(decode=[d0, d1])
        router.notify = lambda rs, error: failed.append((rs.request_id, error))  # set late, as RouterServer does
        await router.start()
        rs = await router.submit(req("a"))
        assert rs.decode_worker_id == "d0"
        router.remove_worker("d0")
        assert failed == [("a", "decode worker d0 was taken out of service")] and rs.lost
        router.finish("a", abort=True)
        await router.stop()
    asyncio.run(main())


def test_the_request_mix_is_the_arrival_stats_given():
    from router.stats.arrival_stats import ArrivalStats

    async def main():
        arrivals = ArrivalStats(window_s=5.0)
        d0 = StubWorker("d0", "decode")
        router = Router([], [WorkerClient("d0", "decode", d0)],
                        AdmissionController(AdmissionLimits(max_model_len=4096, block_size=16)),
                        RouterConfig(stats_interval_s=0.01), arrivals=arrivals)
        assert router.arrivals is arrivals
        await router.start()
        await router.submit(req("a", n=7, max_tokens=3))
        router.finish("a", generated=2)
        mix = arrivals.mix()
        assert (mix.arrivals, mix.mean_prompt_tokens, mix.mean_output_tokens) == (1, 7.0, 2.0)
        assert mix.window_s <= 5.0  # the window it was given
        await router.stop()
    asyncio.run(main())


def test_draining_refuses_new_requests_with_503_and_a_new_config_reaches_every_part():
    from dataclasses import replace

    from router.requests.admission import DrainingError

    async def main():
        router = _stub_router(decode=[StubWorker("d0", "decode")])
        await router.start()
        router.draining = True  # what RouterServer.drain does
        assert router.admission.draining
        with pytest.raises(DrainingError):
            await router.submit(req("a"))
        assert router.arrivals.mix().arrivals == 0  # a refusal while draining is no demand
        router.cfg = replace(router.cfg, migrate_on_worker_death=False)
        assert router.health.cfg is router.walk.cfg is router.migrator.cfg is router.cfg
        await router.stop()
    asyncio.run(main())


def test_a_request_every_worker_refuses_waits_in_the_queue_again(workers):
    """Admission saw room but every decode worker refused (a view a poll behind them): the request
    waits in the admission queue again and is placed once a worker takes it, instead of a 429 after
    reserve_wait_s."""
    _, d0, d1 = workers

    async def main():
        router = make_router(workers)
        await router.start()
        d0.refuse_placements(True)
        d1.refuse_placements(True)
        try:
            task = asyncio.ensure_future(router.submit(req("refused-then-placed")))
            await asyncio.sleep(0.5)  # five reserve_wait_s: each refused walk sent it back to the queue
            assert not task.done()
            d1.refuse_placements(False)
            rs = await asyncio.wait_for(task, 5)
            assert rs.decode_worker_id == "decode-1"
            assert (await _drain(d1, rs.worker_request_id)).finish_reason == "length"
            router.finish("refused-then-placed")
        finally:
            d0.refuse_placements(False)
            d1.refuse_placements(False)
            await router.stop()
    asyncio.run(main())


def test_refusals_past_the_queue_timeout_end_in_a_429(workers):
    from router.errors import OverloadedError

    _, d0, d1 = workers

    async def main():
        p, _, _ = workers
        admission = AdmissionController(AdmissionLimits(max_model_len=4096, block_size=16, queue_timeout_s=0.6))
        router = Router([WorkerClient("prefill-0", "prefill", p)],
                        [WorkerClient("decode-0", "decode", d0), WorkerClient("decode-1", "decode", d1)],
                        admission, RouterConfig(stats_interval_s=0.01, reserve_wait_s=0.1))
        await router.start()
        d0.refuse_placements(True)
        d1.refuse_placements(True)
        try:
            t0 = asyncio.get_running_loop().time()
            with pytest.raises(OverloadedError, match="could take the request within 0.1s"):
                await router.submit(req("always-refused"))
            assert 0.5 <= asyncio.get_running_loop().time() - t0 < 2.0
            assert not router.inflight and admission.num_waiting == 0 and not admission._tickets
        finally:
            d0.refuse_placements(False)
            d1.refuse_placements(False)
            await router.stop()
    asyncio.run(main())


class _LateSubmits:
    """A prefill double whose submit reaches it `delay_s` after the calls sent after it: Ray runs an
    async actor's calls in no fixed order (prefill_worker/calls_ahead.py)."""

    def __init__(self, inner: FakePrefillWorker, delay_s: float):
        self.inner, self.delay_s = inner, delay_s

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def submit(self, task):
        await asyncio.sleep(self.delay_s)
        return await self.inner.submit(task)


def test_calls_that_overtake_their_submit_lose_nothing(workers, demo_model_dir):
    """The reservation reaching the prefill worker before its prompt is kept for it: the request
    completes (it hung once: CI, a streamed request on the fake cluster). An abort that overtakes
    the prompt ends it unrun when it comes, nothing held."""
    from router.errors import OverloadedError

    _, d0, d1 = workers

    async def main():
        p = FakePrefillWorker("prefill-late", WorkerConfig(model_dir=str(demo_model_dir)), prefill_delay_s=0.0)
        p.init_transport({"decode": {"decode-0": d0, "decode-1": d1}})
        admission = AdmissionController(AdmissionLimits(max_model_len=4096, block_size=16, queue_timeout_s=0.3))
        router = Router([WorkerClient("prefill-late", "prefill", _LateSubmits(p, 0.2))],
                        [WorkerClient("decode-0", "decode", d0), WorkerClient("decode-1", "decode", d1)],
                        admission, RouterConfig(stats_interval_s=0.01, reserve_wait_s=0.1))
        await router.start()
        try:
            rs = await router.submit(req("late-submit", max_tokens=4))
            end = await _drain(d0 if rs.decode_worker_id == "decode-0" else d1, "late-submit")
            assert end.finish_reason == "length" and end.error is None
            router.finish("late-submit")
            d0.refuse_placements(True)
            d1.refuse_placements(True)
            with pytest.raises(OverloadedError):
                await router.submit(req("late-abort"))  # given up, its abort sent before the submit lands
            await asyncio.sleep(0.4)
            assert p.submitted >= 2 and p.stats().waiting == 0 and len(p._ahead) == 0  # (re-walked: submitted again)
            await router.poll_once()
            assert all(v.free_blocks == v.total_blocks for v in router.decode_views())
        finally:
            d0.refuse_placements(False)
            d1.refuse_placements(False)
            await router.stop()
    asyncio.run(main())
