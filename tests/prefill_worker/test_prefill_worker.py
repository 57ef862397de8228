"""PrefillWorker over the in-process local transport: packing, chunking, sampling, aborts, stats."""

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "cluster" / "transport"))
import harness  # noqa: E402

from cluster.engine.engine import LLMEngine  # noqa: E402
from cluster.sampling.sampling_params import SamplingParams  # noqa: E402
from cluster.transport.factory import TransportSpec, create_transport  # noqa: E402
from cluster.worker.worker_config import WorkerConfig  # noqa: E402
from prefill_worker.pass_launcher import PassLauncher  # noqa: E402
from prefill_worker.prefill_worker import PrefillWorker  # noqa: E402


@pytest.fixture(params=["sequential", "overlap"])
def setup(demo_model_dir, request, monkeypatch):
    """Every test runs twice: passes one after the other, and with overlap (the next pass launches before
    the one ahead is read: launched_pass.py). On CPU no pass replays a graph, and only such a pass may
    overlap, so here every pass without prompt logprobs counts as one."""
    if request.param == "overlap":
        monkeypatch.setattr(PassLauncher, "replays_graph", lambda self, chunks, wants: not any(wants))
    spec = TransportSpec("local", namespace=f"{request.node.name}-{request.param}", heartbeat_s=0.05)
    dec = harness.DecodeSide("d0", demo_model_dir, spec)
    w = PrefillWorker("p0", WorkerConfig(model_dir=str(demo_model_dir), num_blocks=64, max_prefill_tokens=40,
                                         prefill_overlap="on" if request.param == "overlap" else "off"))
    w.set_transport(create_transport(spec, w.kv_cache, "p0", "prefill"), send_timeout_s=5.0)
    yield dec, w
    w.shutdown()
    w.transport.close()
    dec.transport.close()


def test_packed_and_chunked_prefill_matches_engine(setup, demo_model_dir):
    dec, w = setup
    prompts = [list(range(5, 5 + n)) for n in (10, 90, 33, 3)]  # 90 > budget: chunked
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=1, temperature=0.8, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)]
    reqs = [harness.request(p, seed=3) for p in prompts]
    reqs = [type(r)(r.request_id, r.prompt_token_ids, sp, 3, r.arrival_time) for r, sp in zip(reqs, params)]
    tasks = [dec.reserve(r, "p0") for r in reqs]
    w.start()
    futs = [w.submit(t) for t in tasks]
    results = [f.result(timeout=30) for f in futs]
    assert all(r.ok and r.transfer_bytes > 0 and r.prefill_s > 0 for r in results), results
    eng = LLMEngine(demo_model_dir)
    ref = [eng.generate([p], sp)[0] for p, sp in zip(prompts, params)]
    arrivals = {a.reservation.request_id: a for a in dec.wait_arrivals(4)}
    for req, res, out in zip(reqs, results, ref):
        assert res.first_token == out.token_ids[0]  # sampled token sits at position len(prompt)
        a = arrivals[req.request_id]
        if req.params.greedy:
            assert dec.greedy_decode(req, a.reservation.block_ids, a.header.first_token) == list(out.token_ids)
    assert w.allocator.num_free == w.allocator.capacity  # own blocks freed after the sends
    st = w.stats()
    assert st.role == "prefill" and st.outstanding_prefill_tokens == 0 and st.extra["transfers"] == 4


def test_overlap_launches_the_next_pass_before_reading_the_one_ahead(setup, monkeypatch):
    """A long prompt over three passes (the budget is 40 tokens) and a short one behind it: with overlap each
    pass launches while the one ahead is unread, and the chunks still continue exactly (the results: the
    test above); without it, never."""
    dec, w = setup
    events, launch, complete = [], PassLauncher.launch, PrefillWorker._complete

    def launching(self, chunks, *a, **kw):
        events.append(("launch", tuple(len(c.token_ids) for _, c in chunks)))
        return launch(self, chunks, *a, **kw)

    def completing(self, p):
        events.append(("complete", tuple(len(c.token_ids) for _, c in p.chunks)))
        return complete(self, p)
    monkeypatch.setattr(PassLauncher, "launch", launching)
    monkeypatch.setattr(PrefillWorker, "_complete", completing)
    tasks = [dec.reserve(harness.request(list(range(5, 5 + n))), "p0") for n in (100, 12)]
    futs = [w.submit(t) for t in tasks]
    w.start()
    results = [f.result(timeout=30) for f in futs]
    assert all(r.ok for r in results), results
    assert [e for e in events if e[0] == "launch"] == [("launch", (40,)), ("launch", (40,)), ("launch", (20, 12))]
    unread = overlapped = 0
    for kind, _ in events:  # launches made while a pass was still unread
        overlapped += kind == "launch" and unread > 0
        unread += 1 if kind == "launch" else -1
    assert overlapped == (2 if w.overlap else 0), events
    assert w.stats().extra["prefill_passes"] == {"launched": 3, "overlapped": overlapped}


def test_abort_queued_request_tells_decode_side(setup):
    dec, w = setup
    task = dec.reserve(harness.request(list(range(5, 40))), "p0")
    fut = w.submit(task)  # loop not started: still queued
    assert w.stats().outstanding_prefill_tokens == 35
    assert w.abort(task.request.request_id)
    assert fut.result(timeout=5).ok is False
    (a,) = dec.wait_arrivals(1)
    assert a.header is not None and not a.header.ok
    assert not w.abort(task.request.request_id)


def test_a_cached_prefix_is_not_computed_again_and_the_decode_side_gets_every_block(setup, demo_model_dir):
    dec, w = setup
    shared = list(range(5, 5 + 70))  # 4 full blocks
    prompts = [shared + [200, 201], shared + list(range(300, 330))]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    w.start()
    results = []
    for p in prompts:  # one after the other: the second finds the first's blocks
        req = harness.request(p)
        req = type(req)(req.request_id, req.prompt_token_ids, params, req.seed, req.arrival_time)
        results.append((req, w.submit(dec.reserve(req, "p0")).result(timeout=30)))
    arrivals = {a.reservation.request_id: a for a in dec.wait_arrivals(2)}
    eng = LLMEngine(demo_model_dir, enable_prefix_caching=False)
    for req, res in results:
        out = eng.generate([list(req.prompt_token_ids)], params)[0]
        a = arrivals[req.request_id]
        assert res.ok and res.first_token == out.token_ids[0]
        assert dec.greedy_decode(req, a.reservation.block_ids, a.header.first_token) == list(out.token_ids)
    ex = w.stats().extra
    assert ex["computed_prompt_tokens"] == len(prompts[0]) + len(prompts[1]) - 64
    assert (ex["prefix_cache_queries"], ex["prefix_cache_hits"]) == (sum(map(len, prompts)), 64)
    assert w.allocator.num_free == w.allocator.capacity and w.allocator.num_cached == 100 // 16  # prompt 1 holds every full block
    w.allocator.check([])


def test_only_the_blocks_the_decode_worker_lacks_are_sent(setup, demo_model_dir):
    """The reservation says the decode side holds the prompt's first k blocks (here: those an earlier
    transfer landed); the prefill worker sends the rest into the reservation's blocks, and decoding
    from cached + landed blocks gives the engine's output."""
    from cluster.wire.messages import PrefillTask, Reservation

    dec, w = setup
    shared = list(range(5, 5 + 64))  # 4 full blocks
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    w.start()
    r1 = harness.request(shared + [7, 8, 9], max_tokens=6)
    t1 = dec.reserve(r1, "p0")
    full = w.submit(t1).result(timeout=30)
    (a1,) = dec.wait_arrivals(1)
    r2 = harness.request(shared + list(range(200, 240)), max_tokens=6)  # 104 tokens: 7 blocks
    k = 4
    landing = dec.allocator.allocate(dec.kvspec.blocks_for_tokens(len(r2.prompt_token_ids) + 1) - k)
    res = Reservation(r2.request_id, "d0", tuple(landing), t1.reservation.transfer_seq + 1, num_cached_blocks=k)
    dec.transport.expect(res, "p0")
    part = w.submit(PrefillTask(r2, res)).result(timeout=30)
    (a2,) = dec.wait_arrivals(1)
    assert full.ok and part.ok and part.cached_tokens == 64  # the prefill worker's own hit
    bpb = dec.kvspec.bytes_per_block
    assert full.transfer_bytes == 5 * bpb and part.transfer_bytes == 3 * bpb
    assert a2.header.num_tokens == len(r2.prompt_token_ids) - k * 16
    table = list(a1.reservation.block_ids[:k]) + list(landing)
    eng = LLMEngine(demo_model_dir, enable_prefix_caching=False)
    for req, blocks, first in ((r1, a1.reservation.block_ids, a1.header.first_token), (r2, table, a2.header.first_token)):
        out = eng.generate([list(req.prompt_token_ids)], params)[0]
        assert dec.greedy_decode(req, blocks, first) == list(out.token_ids)
    w.allocator.check([])


@pytest.mark.parametrize("fails", ["forward", "draw"])
def test_a_failed_pass_fails_its_prompts_and_the_worker_serves_on(setup, monkeypatch, fails):
    """The second of three passes raises (its forward, or the read of its draw, where a device error shows):
    its prompts fail and free every block, the passes around it (overlapped or not) finish."""
    dec, w = setup
    calls = []
    if fails == "forward":
        forward = w.runner.prefill_with_prompt_logprobs

        def flaky(chunks, wants):
            calls.append(len(chunks))
            if len(calls) == 2:
                raise RuntimeError("device lost")
            return forward(chunks, wants)
        monkeypatch.setattr(w.runner, "prefill_with_prompt_logprobs", flaky)
    else:
        from cluster.sampling.sampler import SampledTokens
        result = SampledTokens.result

        def flaky(self):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("device lost")
            return result(self)
        monkeypatch.setattr(SampledTokens, "result", flaky)
    tasks = [dec.reserve(harness.request(list(range(5 + n, 45 + n))), "p0") for n in range(3)]  # a pass each (budget 40)
    futs = [w.submit(t) for t in tasks]
    w.start()
    results = [f.result(timeout=30) for f in futs]
    assert [r.ok for r in results] == [True, False, True] and "device lost" in results[1].error, results
    after = w.submit(dec.reserve(harness.request(list(range(7, 27))), "p0")).result(timeout=30)
    assert after.ok
    deadline = time.monotonic() + 10
    while w.allocator.num_free != w.allocator.capacity and time.monotonic() < deadline:
        time.sleep(0.01)
    w.check_blocks()
    assert w.allocator.num_free == w.allocator.capacity


def test_a_reservation_that_skips_the_last_token_is_refused(setup):
    """The cache-hit rule always leaves the prompt's last token to compute (its logits give the first
    token), so a reservation claiming every block is a bug upstream: a clear failure, no transfer."""
    from cluster.wire.messages import PrefillTask, Reservation

    dec, w = setup
    req = harness.request(list(range(5, 37)))  # 32 tokens: 2 full blocks
    task = dec.reserve(req, "p0")
    bad = Reservation(req.request_id, "d0", task.reservation.block_ids, task.reservation.transfer_seq,
                      num_cached_blocks=2)
    res = w.submit(PrefillTask(req, bad)).result(timeout=10)
    assert not res.ok and "skips 2 blocks of a 32-token prompt" in res.error
    (a,) = dec.wait_arrivals(1)
    assert a.header is not None and not a.header.ok  # the decode side frees its blocks


def test_prompts_submitted_before_their_reservations_ship_whenever_they_come(setup, demo_model_dir):
    """The router dispatches a prompt before its decode worker reserved for it (PrefillTask without a
    reservation). A reservation attached before the prompt's last pass is claimed by that pass; one
    attached after it ships the computed KV at once; either way the decode side gets the engine's
    first token and KV. A computed prompt holds its blocks while it waits, and nothing else."""
    from cluster.wire.messages import PrefillTask

    dec, w = setup
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [list(range(5, 35)), list(range(40, 60))]
    reqs = [harness.request(p) for p in prompts]
    reqs = [type(r)(r.request_id, r.prompt_token_ids, params, r.seed, r.arrival_time) for r in reqs]
    early = w.submit(PrefillTask(reqs[0]))
    w.attach(reqs[0].request_id, dec.reserve(reqs[0], "p0").reservation)  # before its pass
    late = w.submit(PrefillTask(reqs[1]))
    w.start()
    assert early.result(timeout=30).ok
    deadline = time.monotonic() + 30
    while w.stats().outstanding_prefill_tokens and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not late.done() and w.stats().outstanding_prefill_tokens == 0  # computed; its KV has nowhere to go
    assert w.allocator.num_free == w.allocator.capacity - 2  # its two blocks, held
    w.attach(reqs[1].request_id, dec.reserve(reqs[1], "p0").reservation)
    assert late.result(timeout=30).ok
    arrivals = {a.reservation.request_id: a for a in dec.wait_arrivals(2)}
    eng = LLMEngine(demo_model_dir)
    for req in reqs:
        out = eng.generate([list(req.prompt_token_ids)], params)[0]
        a = arrivals[req.request_id]
        assert a.header.ok and dec.greedy_decode(req, a.reservation.block_ids, a.header.first_token) == list(out.token_ids)
    assert w.allocator.num_free == w.allocator.capacity
    w.allocator.check([])


@pytest.mark.parametrize("computed", [False, True])
def test_a_reservation_for_a_prompt_the_worker_dropped_is_aborted(setup, computed):
    """Aborted before its reservation came (queued, or computed and waiting for it): the prompt's
    blocks go back at once, and the reservation that comes later is answered with an abort, so the
    decode side frees its blocks instead of waiting for its deadline."""
    from cluster.wire.messages import PrefillTask

    dec, w = setup
    req = harness.request(list(range(5, 40)))
    fut = w.submit(PrefillTask(req))
    if computed:
        w.start()
        deadline = time.monotonic() + 30
        while w.stats().outstanding_prefill_tokens and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not fut.done()
    assert w.abort(req.request_id)
    assert not fut.result(timeout=5).ok
    assert w.allocator.num_free == w.allocator.capacity
    w.attach(req.request_id, dec.reserve(req, "p0").reservation)
    (a,) = dec.wait_arrivals(1)
    assert a.reservation.request_id == req.request_id and a.header is not None and not a.header.ok


def test_an_attach_before_its_submit_is_kept_for_it(setup, demo_model_dir):
    """Ray runs the actor's calls in no fixed order: the reservation may come before the prompt
    (prefill_worker/calls_ahead.py). The prompt then ships into it as if it had come after."""
    from cluster.wire.messages import PrefillTask

    dec, w = setup
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    r = harness.request(list(range(5, 35)))
    req = type(r)(r.request_id, r.prompt_token_ids, params, r.seed, r.arrival_time)
    w.attach(req.request_id, dec.reserve(req, "p0").reservation)
    assert w.stats().extra["calls_ahead"] == 1
    w.start()
    assert dec.wait_arrivals(1, timeout=0.3) == []  # not aborted: held for its submit
    assert w.submit(PrefillTask(req)).result(timeout=30).ok
    (a,) = dec.wait_arrivals(1)
    out = LLMEngine(demo_model_dir).generate([list(req.prompt_token_ids)], params)[0]
    assert a.header.ok and dec.greedy_decode(req, a.reservation.block_ids, a.header.first_token) == list(out.token_ids)
    assert w.stats().extra["calls_ahead"] == 0 and w.allocator.num_free == w.allocator.capacity


def test_an_abort_before_its_submit_ends_it_unrun(setup):
    """The walk gave the prompt up before the prompt came: its submit answers at once, nothing
    computed or held, and a reservation that comes after is aborted at once."""
    from cluster.wire.messages import PrefillTask

    dec, w = setup
    req = harness.request(list(range(5, 40)))
    assert not w.abort(req.request_id)
    w.start()
    res = w.submit(PrefillTask(req)).result(timeout=5)
    assert not res.ok and res.error == "aborted"
    assert w.stats().outstanding_prefill_tokens == 0 and w.allocator.num_free == w.allocator.capacity
    assert w.stats().extra["computed_prompt_tokens"] == 0
    w.attach(req.request_id, dec.reserve(req, "p0").reservation)
    (a,) = dec.wait_arrivals(1)
    assert a.reservation.request_id == req.request_id and not a.header.ok


def test_a_reservation_whose_prompt_never_comes_is_aborted_after_the_wait(setup):
    """Held for its submit at most CallsAhead.wait_s; then its decode worker frees the blocks (the
    stats poll sweeps)."""
    dec, w = setup
    now = [1000.0]
    w._ahead.clock = lambda: now[0]
    stranger = harness.request(list(range(50, 60)))
    w.attach(stranger.request_id, dec.reserve(stranger, "p0").reservation)
    w.stats()
    assert dec.wait_arrivals(1, timeout=0.3) == []
    now[0] += w._ahead.wait_s
    assert w.stats().extra["calls_ahead"] == 0
    (a,) = dec.wait_arrivals(1)
    assert a.reservation.request_id == stranger.request_id and a.header is not None and not a.header.ok
