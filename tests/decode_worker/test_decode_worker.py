"""DecodeWorker end to end on CPU: KV arrives through a loopback transport (prefilled by a separate
ModelRunner, as a prefill worker would) or is prefilled locally; outputs must equal LLMEngine's."""

import random
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from loopback_transport import LoopbackTransport  # noqa: E402

from cluster.engine.engine import LLMEngine  # noqa: E402
from cluster.kv.kv_cache import KVCacheSpec  # noqa: E402
from cluster.wire.messages import GenerateRequest, KVHeader, ReserveRequest  # noqa: E402
from cluster.model.loader import load_model  # noqa: E402
from cluster.engine.model_runner import ModelRunner, PrefillChunk  # noqa: E402
from cluster.sampling.sampling_params import SamplingParams  # noqa: E402
from cluster.worker.worker_config import WorkerConfig  # noqa: E402
from decode_worker.decode_worker import DecodeWorker  # noqa: E402

GREEDY = dict(temperature=0.0, ignore_eos=True)


def prompts(seed, lengths):
    rng = random.Random(seed)
    return [[0] + [rng.randrange(5, 500) for _ in range(n - 1)] for n in lengths]


class FakePrefill:
    """A prefill worker in miniature: its own model and cache, ships KV through the loopback."""

    def __init__(self, model_dir, worker: DecodeWorker, worker_id="p0"):
        self.id = worker_id
        model = load_model(model_dir, dtype="float32")
        spec = KVCacheSpec.for_model(model.cfg, worker.cfg.block_size, 128, torch.float32)
        self.runner = ModelRunner(model, spec, "cpu")
        self.spec = spec
        self.transport = LoopbackTransport(self.runner.kv_cache, worker.kv_cache)
        worker.attach_transport(self.transport)

    def reserve(self, worker, rid, prompt, params):
        req = GenerateRequest(rid, tuple(prompt), params, seed=0, arrival_time=time.time())
        return worker.reserve(ReserveRequest(req, self.id))

    def prefill_and_send(self, res, prompt):
        """Prefills the whole prompt; sends the blocks the decode worker does not hold already."""
        blocks = list(range(1, 1 + self.spec.blocks_for_tokens(len(prompt))))
        logits = self.runner.prefill([PrefillChunk(prompt, 0, blocks)])
        first = int(logits.argmax(-1)[0])
        skip = res.num_cached_blocks
        header = KVHeader(res.request_id, res.transfer_seq, len(prompt) - skip * self.spec.block_size, first)
        return self.transport.send(res, header, blocks[skip:])


class Collector:
    """A decode worker's token deltas by request id: tokens, text, finish reason, error, prompt logprobs."""

    def __init__(self, worker):
        self.worker, self.tokens, self.text, self.finish, self.error, self.prompt_lps = worker, {}, {}, {}, {}, {}

    def poll(self, timeout=0.05):
        for b in self.worker.poll_token_batches(timeout):
            self.add(b)

    def add(self, b):
        for d in b.deltas:
            self.tokens.setdefault(d.request_id, []).extend(d.token_ids)
            self.text[d.request_id] = self.text.get(d.request_id, "") + d.text
            if d.logprobs is not None and d.logprobs.prompt is not None:
                self.prompt_lps[d.request_id] = d.logprobs.prompt
            if d.finish_reason:
                assert d.request_id not in self.finish, f"{d.request_id} finished twice"
                self.finish[d.request_id], self.error[d.request_id] = d.finish_reason, d.error

    def wait(self, cond, stall_s=60.0):
        """Polls until `cond()`. Fails after `stall_s` without a new token or finish, not after a
        deadline for the whole wait: these modules run in the test run's other stream, at nice 10
        (tests/stream_scheduling.py), where a live worker may get a tenth of a core for minutes."""
        seen, t0 = None, time.monotonic()
        while not cond():
            progress = (sum(map(len, self.tokens.values())), len(self.finish))
            if progress != seen:
                seen, t0 = progress, time.monotonic()
            assert time.monotonic() - t0 < stall_s, (f"no progress for {stall_s:g}s; tokens so far {self.tokens}, "
                                                     f"stats {self.worker.stats()}")
            self.poll()


def make_worker(model_dir, **kw):
    cfg = WorkerConfig(model_dir=str(model_dir), dtype="float32", max_num_seqs=kw.pop("max_num_seqs", 8),
                       graph_buckets=kw.pop("graph_buckets", "vllm"), **kw)
    return DecodeWorker("d0", cfg)


@pytest.fixture(scope="module")
def engine(demo_model_dir):
    return LLMEngine(demo_model_dir, dtype="float32", max_prefill_tokens=512)


def test_greedy_equals_engine_with_requests_joining_and_leaving(demo_model_dir, engine):
    ps = prompts(0, [3, 70, 18, 130, 9, 45, 250])
    max_toks = [20, 6, 14, 25, 3, 17, 9]
    params = [SamplingParams(max_tokens=m, **GREEDY) for m in max_toks]
    ref = engine.generate(ps, params)
    worker = make_worker(demo_model_dir)
    try:
        pre = FakePrefill(demo_model_dir, worker)
        col = Collector(worker)
        # Wave 1 through the transport, wave 2 joins mid-batch (transport + one local prefill).
        for i in (0, 1, 2):
            pre.prefill_and_send(pre.reserve(worker, f"r{i}", ps[i], params[i]), ps[i])
        col.wait(lambda: len(col.tokens.get("r1", [])) >= 3)
        for i in (3, 4):
            pre.prefill_and_send(pre.reserve(worker, f"r{i}", ps[i], params[i]), ps[i])
        assert worker.submit_local(GenerateRequest("r5", tuple(ps[5]), params[5], 0, 0.0)) is not None
        col.wait(lambda: "r1" in col.finish)  # a request left; one more joins after it
        pre.prefill_and_send(pre.reserve(worker, "r6", ps[6], params[6]), ps[6])
        col.wait(lambda: len(col.finish) == len(ps))
        for i, r in enumerate(ref):
            assert col.tokens[f"r{i}"] == list(r.token_ids), f"request {i} (prompt {len(ps[i])})"
            assert col.finish[f"r{i}"] == "length"
        m = worker.step_metrics()
        assert m["steps_total"] > 0 and m["eager_steps_total"] == m["steps_total"]  # CPU: eager
        assert len(set(m["bucket_steps"])) > 1 and m["padded_rows_total"] > 0  # the batch changed size
        assert pre.transport.expect_order == [("p0", i) for i in range(6)]  # transfer_seq per peer
        col.wait(lambda: worker.stats().free_blocks == worker.stats().total_blocks)
    finally:
        worker.shutdown()


def test_stop_tokens_eos_and_min_tokens(demo_model_dir, engine):
    ps = prompts(1, [12, 40])
    ref = engine.generate(ps, SamplingParams(max_tokens=30, **GREEDY))
    # Stop on the 5th token of each reference output; one request must ignore it until min_tokens.
    stop0, stop1 = ref[0].token_ids[4], ref[1].token_ids[4]
    p0 = SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=(stop0,))
    p1 = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop_token_ids=(stop1,), min_tokens=10)
    ref2 = engine.generate(ps, [p0, p1])
    worker = make_worker(demo_model_dir)
    try:
        col = Collector(worker)
        worker.submit_local(GenerateRequest("a", tuple(ps[0]), p0, 0, 0.0))
        worker.submit_local(GenerateRequest("b", tuple(ps[1]), p1, 0, 0.0))
        col.wait(lambda: len(col.finish) == 2)
        assert col.tokens["a"] == list(ref2[0].token_ids) and col.finish["a"] == ref2[0].finish_reason
        assert col.tokens["b"] == list(ref2[1].token_ids) and col.finish["b"] == ref2[1].finish_reason
    finally:
        worker.shutdown()


def test_abort_frees_blocks_and_defers_while_a_transfer_may_land(demo_model_dir):
    worker = make_worker(demo_model_dir)
    try:
        pre = FakePrefill(demo_model_dir, worker)
        col = Collector(worker)
        total = worker.stats().total_blocks
        ps = prompts(2, [30, 50])
        long = SamplingParams(max_tokens=200, **GREEDY)
        res_a = pre.reserve(worker, "a", ps[0], long)
        pre.prefill_and_send(res_a, ps[0])
        col.wait(lambda: len(col.tokens.get("a", [])) >= 3)
        res_b = pre.reserve(worker, "b", ps[1], long)  # reserved and claimed, payload not sent yet
        pre.transport.claim(res_b)
        worker.abort("a")
        worker.abort("b")
        col.wait(lambda: col.finish.get("a") == "abort" and col.finish.get("b") == "abort")
        # a's blocks come back; b's stay out of the pool until its transfer reports.
        col.wait(lambda: worker.stats().free_blocks == total - len(res_b.block_ids))
        assert worker.stats().extra["pending_free_blocks"] == len(res_b.block_ids)
        pre.prefill_and_send(res_b, ps[1])  # lands late: the blocks were never reused
        col.wait(lambda: worker.stats().free_blocks == total)
        assert "b" not in col.tokens or col.tokens["b"] == []
        # Not claimed yet: the abort cancels the transfer and its blocks come back with that arrival.
        res_c = pre.reserve(worker, "c", ps[1], long)
        worker.abort("c")
        col.wait(lambda: col.finish.get("c") == "abort")
        col.wait(lambda: worker.stats().free_blocks == total)
        assert pre.transport.cancelled == ["c"] and not pre.transport.is_expected("c")
        # With an error (the router failed the placement: DecodeWorkerAPI.fail), it ends with that
        # error, not an abort, so its gateway cannot take it for a complete stream.
        pre.reserve(worker, "d", ps[1], long)
        worker.abort("d", "prefill broke")
        col.wait(lambda: col.finish.get("d") == "error")
        col.wait(lambda: worker.stats().free_blocks == total)
        worker.abort("nobody")  # unknown ids are ignored
    finally:
        worker.shutdown()


def test_failed_transfer_publishes_error_and_frees(demo_model_dir):
    worker = make_worker(demo_model_dir)
    try:
        pre = FakePrefill(demo_model_dir, worker)
        col = Collector(worker)
        res = pre.reserve(worker, "a", prompts(3, [20])[0], SamplingParams(max_tokens=5, **GREEDY))
        pre.transport.fail(res, "prefill worker died")
        col.wait(lambda: "a" in col.finish)
        assert col.finish["a"] == "error" and col.tokens["a"] == []
        col.wait(lambda: worker.stats().free_blocks == worker.stats().total_blocks)
        # A first token that already ends the request: published with its finish reason, nothing runs.
        p = prompts(3, [20])[0]
        res = pre.reserve(worker, "b", p, SamplingParams(max_tokens=1, **GREEDY))
        pre.prefill_and_send(res, p)
        col.wait(lambda: "b" in col.finish)
        assert col.finish["b"] == "length" and len(col.tokens["b"]) == 1
    finally:
        worker.shutdown()


def test_reserve_returns_none_when_kv_does_not_fit(demo_model_dir):
    worker = make_worker(demo_model_dir, num_blocks=9)  # 8 usable blocks of 16 tokens
    try:
        pre = FakePrefill(demo_model_dir, worker)
        p = SamplingParams(max_tokens=4, **GREEDY)
        assert pre.reserve(worker, "a", prompts(4, [100])[0], p) is not None  # 7 blocks
        assert pre.reserve(worker, "b", prompts(4, [40])[0], p) is None
        with pytest.raises(Exception, match="does not fit in the KV cache of decode worker d0"):
            pre.reserve(worker, "c", prompts(4, [200])[0], p)
    finally:
        worker.shutdown()


def test_short_kv_pool_preempts_by_recompute_and_output_is_unchanged(demo_model_dir, engine):
    ps = prompts(5, [40, 33, 50, 20])
    params = SamplingParams(max_tokens=40, **GREEDY)
    ref = engine.generate(ps, params)
    worker = make_worker(demo_model_dir, num_blocks=17)  # 16 usable: all four can't finish together
    try:
        col = Collector(worker)
        for i, p in enumerate(ps):
            assert worker.submit_local(GenerateRequest(f"r{i}", tuple(p), params, 0, 0.0)) is not None
        col.wait(lambda: len(col.finish) == len(ps))
        assert worker.stats().extra["preemptions"] > 0
        for i, r in enumerate(ref):
            assert col.tokens[f"r{i}"] == list(r.token_ids)
    finally:
        worker.shutdown()


def test_each_gateway_gets_only_its_requests_text_over_zmq(demo_model_dir, engine):
    """Two gateways' token sinks and the router's step-record sink: each gateway sees exactly the
    deltas of the requests that name it (reply_to), as text equal to the engine's; every step's
    record goes to the stats sink once."""
    zmq = pytest.importorskip("zmq")
    from cluster.wire.frame_auth import STATS_SINK, TOKEN_STREAM, FrameVerifier
    from cluster.wire.stream_messages import decode_step_records, decode_stream_batch

    ctx = zmq.Context.instance()
    sinks, addrs = [], []
    for _ in range(3):
        s = ctx.socket(zmq.PULL)
        addrs.append(f"tcp://127.0.0.1:{s.bind_to_random_port('tcp://127.0.0.1')}")
        sinks.append(s)
    ps = prompts(6, [15, 60, 22, 9])
    params = SamplingParams(max_tokens=12, **GREEDY)
    ref = engine.generate(ps, params)
    secret = b"k" * 32  # every frame carries a MAC under the cluster's secret (cluster/wire/frame_auth.py)
    cfg = WorkerConfig(model_dir=str(demo_model_dir), dtype="float32", max_num_seqs=4, cluster_secret=secret)
    checks = [FrameVerifier(secret, TOKEN_STREAM), FrameVerifier(secret, TOKEN_STREAM), FrameVerifier(secret, STATS_SINK)]
    worker = DecodeWorker("d1", cfg, stats_sink=addrs[2])
    got = [Collector(worker), Collector(worker)]
    texts: dict[str, str] = {}
    try:
        for i, p in enumerate(ps):
            worker.submit_local(GenerateRequest(f"r{i}", tuple(p), params, 0, 0.0, reply_to=addrs[i % 2]))
        # Fails after 60 s without a new delta (as Collector.wait), not after 60 s in all: nice 10 here.
        t0, records, seen = time.monotonic(), [], None
        while sum(len(c.finish) for c in got) < len(ps):
            if (progress := sum(len(t) for c in got for t in c.tokens.values())) != seen:
                seen, t0 = progress, time.monotonic()
            assert time.monotonic() - t0 < 60, "no progress for 60s"
            for k in (0, 1):
                while sinks[k].poll(10):
                    b = decode_stream_batch(checks[k].open(sinks[k].recv_multipart()))
                    assert b.worker_id == "d1"
                    got[k].add(b)
                    for d in b.deltas:
                        texts[d.request_id] = texts.get(d.request_id, "") + d.text
        time.sleep(0.2)
        while sinks[2].poll(10):
            records += decode_step_records(checks[2].open(sinks[2].recv_multipart())).records
        for i, r in enumerate(ref):
            mine, other = got[i % 2], got[1 - i % 2]
            assert mine.tokens[f"r{i}"] == list(r.token_ids) and f"r{i}" not in other.tokens
            assert texts[f"r{i}"] == r.text
        steps = [r.step for r in records]
        assert not any(c.rejected for c in checks)
        assert steps and steps == sorted(set(steps)) and all(r.worker_id == "d1" and r.batch_size >= 1 for r in records)
    finally:
        worker.shutdown()
        for s in sinks:
            s.close()


def test_stop_string_ends_the_request_on_the_worker(demo_model_dir, engine):
    """The publisher matches the stop string: finish "stop", text cut before it, and the loop drops
    the request at once (its blocks back in the pool) instead of decoding to max_tokens."""
    p = prompts(7, [12])[0]
    ref = engine.generate([p], SamplingParams(max_tokens=60, **GREEDY))[0]
    text = ref.text
    cut = next((i for i in range(6, len(text) - 2) if text[i].strip() and text.find(text[i:i + 2]) == i), None)
    if cut is None:
        pytest.skip("reference output too uniform to pick a stop string")
    stop = text[cut:cut + 2]
    worker = make_worker(demo_model_dir, num_blocks=64)
    col = Collector(worker)
    out = []
    try:
        worker.submit_local(GenerateRequest("s", tuple(p), SamplingParams(max_tokens=60, stop=(stop,), **GREEDY), 0, 0.0))
        t0, seen = time.monotonic(), None  # fails after 60 s without a new token (as Collector.wait)
        while "s" not in col.finish:
            if len(out) != seen:
                seen, t0 = len(out), time.monotonic()
            assert time.monotonic() - t0 < 60, "no progress for 60s"
            for b in worker.poll_token_batches(0.05):
                col.add(b)
                out += [d.text for d in b.deltas]
        assert col.finish["s"] == "stop" and "".join(out) == text[:cut]
        assert len(col.tokens["s"]) < 60 and col.tokens["s"] == list(ref.token_ids[:len(col.tokens["s"])])
        t0 = time.time()
        while worker.stats().running or worker.stats().free_blocks != worker.stats().total_blocks:
            assert time.time() - t0 < 10, worker.stats()
            time.sleep(0.02)
    finally:
        worker.shutdown()


def test_prefix_cache_hits_on_the_decode_worker_keep_greedy_output_exact(demo_model_dir, engine):
    """Arrived prompts and decoded blocks are cached; a later reservation skips the blocks the worker
    holds (the transfer carries only the rest), and local prefills (new, and a multi-turn follow-up
    that resends prompt + answer) start after them. Output equals the engine's, and the block
    accounting holds throughout."""
    rng = random.Random(7)
    system = [0] + [rng.randrange(5, 500) for _ in range(80)]
    params = SamplingParams(max_tokens=20, **GREEDY)
    first = [system + [rng.randrange(5, 500) for _ in range(n)] for n in (5, 12, 30)]
    worker = make_worker(demo_model_dir)
    try:
        pre = FakePrefill(demo_model_dir, worker)
        col = Collector(worker)
        res1 = pre.reserve(worker, "t1", first[0], params)
        assert res1.num_cached_blocks == 0
        full = pre.prefill_and_send(res1, first[0])  # lands, gets cached
        col.wait(lambda: "t1" in col.finish)
        assert worker.submit_local(GenerateRequest("t2", tuple(first[1]), params, 0, 0.0)) == 5 * 16
        col.wait(lambda: "t2" in col.finish)
        res3 = pre.reserve(worker, "t3", first[2], params)  # the system prompt's 5 blocks are here
        assert res3.num_cached_blocks == 5 and len(res3.block_ids) == worker.spec.blocks_for_tokens(len(first[2]) + 1) - 5
        part = pre.prefill_and_send(res3, first[2])
        assert part.bytes == 2 * worker.spec.bytes_per_block and full.bytes == 6 * worker.spec.bytes_per_block
        col.wait(lambda: "t3" in col.finish)
        follow = first[0] + col.tokens["t1"] + [rng.randrange(5, 500) for _ in range(7)]  # turn 2 of t1
        assert worker.submit_local(GenerateRequest("t4", tuple(follow), params, 0, 0.0)) == (len(first[0]) + 20 - 1) // 16 * 16
        col.wait(lambda: "t4" in col.finish)
        ref = engine.generate([first[0], first[1], first[2], follow], params)
        assert [col.tokens[r] for r in ("t1", "t2", "t3", "t4")] == [list(o.token_ids) for o in ref]
        ex = worker.stats().extra
        # Reservations are lookups too. t2 and t3 find the system prompt's 5 full blocks; t4 finds
        # t1's prompt and most of its answer.
        assert ex["prefix_cache_queries"] == len(first[0]) + len(first[1]) + len(first[2]) + len(follow)
        assert ex["prefix_cache_hits"] == 2 * 5 * 16 + (len(first[0]) + 20 - 1) // 16 * 16
        col.wait(lambda: worker.stats().free_blocks == worker.stats().total_blocks)
        worker.check_blocks()
    finally:
        worker.shutdown()


@pytest.mark.parametrize("k", [1, 2, 5])
def test_a_fault_after_k_tokens_fires_right_after_the_kth_token_of_its_request(demo_model_dir, k):
    """inject_fault(kind, after_tokens=K, seed=S): the request sampled with seed S sends exactly K
    tokens (the other running requests' tokens of that batch still go out), then the loop fails and
    every request ends with an error, lost (the router moves them); fired once, reported in stats."""
    ps = prompts(3, [9, 20, 14])
    worker = make_worker(demo_model_dir, max_loop_restarts=5)
    try:
        col = Collector(worker)
        worker.inject_fault("loop", after_tokens=k, seed=2)
        for i, p in enumerate(ps):
            req = GenerateRequest(f"r{i}", tuple(p), SamplingParams(max_tokens=30, **GREEDY), i, 0.0)
            assert worker.submit_local(req) is not None
        col.wait(lambda: len(col.finish) == len(ps))
        assert len(col.tokens["r2"]) == k
        assert set(col.finish.values()) == {"error"} and all(worker.lost(f"r{i}") for i in range(3))
        fired = worker.stats().extra["faults_fired"]
        assert [(f["kind"], f["after_tokens"], f["request_id"]) for f in fired] == [("loop", k, "r2")]
        # A migrated request resumes past K: counted with the tokens it resumed from, it never fires again.
        worker.inject_fault("loop", after_tokens=3, seed=9)
        p = tuple(ps[0]) + (7, 8, 9)
        worker.submit_local(GenerateRequest("m", p, SamplingParams(max_tokens=5, **GREEDY), 9, 0.0, resumed_tokens=3))
        col.wait(lambda: "m" in col.finish)
        assert col.finish["m"] == "length" and len(worker.stats().extra["faults_fired"]) == 1
        worker.clear_faults()
        col.wait(lambda: worker.stats().free_blocks == worker.stats().total_blocks)
        assert worker.stats().healthy and worker.loop_failures == 1
    finally:
        worker.shutdown()


def test_the_restart_fault_stops_everything_silently_and_calls_on_restart(demo_model_dir):
    worker = make_worker(demo_model_dir)
    restarted = []
    try:
        col = Collector(worker)
        with pytest.raises(ValueError):
            worker.inject_fault("restart", after_tokens=2)  # nobody to bring up a new incarnation
        worker.on_restart = lambda: restarted.append(True)
        worker.inject_fault("restart", after_tokens=2)
        req = GenerateRequest("r", tuple(prompts(4, [10])[0]), SamplingParams(max_tokens=30, **GREEDY), 0, 0.0)
        worker.submit_local(req)
        col.wait(lambda: restarted)
        time.sleep(0.3)
        col.poll()
        assert len(col.tokens["r"]) == 2 and "r" not in col.finish  # a crash: no error from the worker itself
        assert not worker.stats().healthy
    finally:
        worker.shutdown()
def test_step_records_say_where_each_interval_went(demo_model_dir):
    """Every step's record (to the router's stats sink) carries its interval since the previous
    step's start and its parts: previous step + local prefill + idle + host gap = the interval; a
    prompt prefilled between two steps shows as that interval's prefill."""
    zmq = pytest.importorskip("zmq")
    from cluster.wire.frame_auth import STATS_SINK, FrameVerifier
    from cluster.wire.stream_messages import decode_step_records

    sink = zmq.Context.instance().socket(zmq.PULL)
    addr = f"tcp://127.0.0.1:{sink.bind_to_random_port('tcp://127.0.0.1')}"
    cfg = WorkerConfig(model_dir=str(demo_model_dir), dtype="float32", max_num_seqs=4)
    worker = DecodeWorker("d2", cfg, stats_sink=addr)
    c = Collector(worker)
    long_, short = prompts(8, [40, 120])
    try:
        worker.submit_local(GenerateRequest("a", tuple(long_), SamplingParams(max_tokens=40, **GREEDY), 0, 0.0))
        c.wait(lambda: len(c.tokens.get("a", [])) >= 5)
        worker.submit_local(GenerateRequest("b", tuple(short), SamplingParams(max_tokens=5, **GREEDY), 0, 0.0))
        c.wait(lambda: len(c.finish) == 2)
        records = []
        verify = FrameVerifier(cfg.cluster_secret, STATS_SINK)  # the stats sink's frames are signed
        # The records come from the publisher process, which may lag the finishes by a lot on a
        # loaded machine: read until the sink has been quiet for 2 s.
        while sink.poll(2000):
            records += decode_step_records(verify.open(sink.recv_multipart())).records
    finally:
        worker.shutdown()
        sink.close()
    by_step = {r.step: r for r in records}
    timed = [r for r in records if r.interval_s is not None and r.step - 1 in by_step]
    assert len(timed) >= 30
    for r in timed:
        prev = by_step[r.step - 1]
        parts = prev.step_time_s + r.prefill_s + r.idle_s + r.gap_s
        # The gap is what the other parts leave (never negative: a clamped gap means they overran it).
        assert r.gap_s >= 0 and (r.interval_s == pytest.approx(parts, abs=1e-6) or r.gap_s == 0), r
        assert r.host_s >= 0 and r.publish_lag_s >= 0
    assert sum(r.prefill_s > 0 for r in timed) >= 1  # b's prompt, prefilled between two of a's steps


def test_the_token_publisher_runs_in_its_own_process(demo_model_dir, engine):
    """Detokenizing never competes with the decode loop for the interpreter: the publisher is another
    process (its local frames and stop-string matches come back); a publisher process that died makes
    the worker unhealthy, so the router moves its requests; nothing of it outlives the worker."""
    from decode_worker.publisher_process import PublisherProcess

    worker = make_worker(demo_model_dir)
    pub = worker.publisher
    assert isinstance(pub, PublisherProcess) and pub.alive and pub.proc.pid != __import__("os").getpid()
    c = Collector(worker)
    try:
        p = prompts(11, [12])[0]
        ref = engine.generate([p], SamplingParams(max_tokens=6, **GREEDY))[0]
        worker.submit_local(GenerateRequest("x", tuple(p), SamplingParams(max_tokens=6, **GREEDY), 0, 0.0))
        c.wait(lambda: "x" in c.finish)
        assert c.tokens["x"] == list(ref.token_ids) and worker.stats().healthy
        pub.proc.kill()
        pub.proc.wait(timeout=10)
        assert not worker.stats().healthy
    finally:
        worker.shutdown()
    assert pub.proc.poll() is not None


def test_a_thread_publisher_is_the_same_publisher(demo_model_dir, engine):
    cfg = WorkerConfig(model_dir=str(demo_model_dir), dtype="float32", max_num_seqs=8)
    worker = DecodeWorker("d0", cfg, token_publisher="thread")
    c = Collector(worker)
    try:
        p = prompts(12, [20])[0]
        ref = engine.generate([p], SamplingParams(max_tokens=5, **GREEDY))[0]
        worker.submit_local(GenerateRequest("y", tuple(p), SamplingParams(max_tokens=5, **GREEDY), 0, 0.0))
        c.wait(lambda: "y" in c.finish)
        assert c.tokens["y"] == list(ref.token_ids)
    finally:
        worker.shutdown()
    with pytest.raises(ValueError, match="token_publisher"):
        DecodeWorker("d0", cfg, token_publisher="fibre")


def test_an_empty_worker_naps_long_and_new_work_wakes_it(demo_model_dir, engine, monkeypatch):
    """Holding no request, the loop naps _EMPTY_WAIT_S (not the 2 ms nap it takes while it holds
    requests); a request that comes, locally or as a landed transfer, wakes it at once. The long nap is
    made 600 s here: a wake-up that went missing would leave the request waiting out the test's timeout."""
    import decode_worker.decode_worker as dw

    monkeypatch.setattr(dw, "_EMPTY_WAIT_S", 600.0)
    ps = prompts(5, [14, 30])
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in (5, 7)]
    ref = engine.generate(ps, params)
    worker = make_worker(demo_model_dir)
    naps = []
    wait = worker._wake.wait
    monkeypatch.setattr(worker._wake, "wait", lambda timeout=None: naps.append(timeout) or wait(timeout))
    try:
        col = Collector(worker)
        worker.submit_local(GenerateRequest("local", tuple(ps[0]), params[0], 0, 0.0))
        col.wait(lambda: "local" in col.finish)
        pre = FakePrefill(demo_model_dir, worker)
        col.wait(lambda: worker.stats().free_blocks == worker.stats().total_blocks and naps[-1] == 600.0)
        pre.prefill_and_send(pre.reserve(worker, "remote", ps[1], params[1]), ps[1])
        col.wait(lambda: "remote" in col.finish)
        assert col.tokens == {"local": list(ref[0].token_ids), "remote": list(ref[1].token_ids)}
    finally:
        worker.shutdown()
