"""Prefill and decode in separate processes over gloo, coordinated through one TCPStore."""

import multiprocessing as mp
import random
import sys
import time
from pathlib import Path

import msgspec
import pytest
import torch

pytestmark = pytest.mark.slow  # prefill and decode in spawned processes over gloo

sys.path.insert(0, str(Path(__file__).parent))
import harness  # noqa: E402

from cluster.engine.engine import LLMEngine  # noqa: E402
from cluster.wire.messages import PrefillTask, Reservation  # noqa: E402
from cluster.sampling.sampling_params import SamplingParams  # noqa: E402
from cluster.transport.base import kv_cache_blocks  # noqa: E402
from cluster.transport.rendezvous_store import start_store  # noqa: E402
from cluster.transport.factory import TransportSpec  # noqa: E402

CTX = mp.get_context("spawn")


@pytest.fixture(scope="module")
def store():
    # One store for the module (each test has its own namespace), as a cluster has one for its
    # lifetime: a daemon thread a test leaves behind (a pair still forming with a killed peer ends on
    # its own) never reaches for a store that is gone, which spends the store's connect timeout.
    s = start_store("127.0.0.1", 0)
    yield s


def _spec(store, ns, **kw):
    return TransportSpec("torch_dist", store_host="127.0.0.1", store_port=store.port, namespace=ns,
                         heartbeat_s=0.1, **kw)


class PrefillProc:
    def __init__(self, spec, worker_id, model_dir, **opts):
        self.in_q, self.out_q = CTX.Queue(), CTX.Queue()
        self.proc = CTX.Process(target=harness.prefill_child, args=(spec, worker_id, model_dir, self.in_q, self.out_q, opts), daemon=True)
        self.proc.start()
        self.kv, self.sums, self.results, self.metrics = {}, {}, {}, None

    def submit(self, task, abort_after=None):
        # The first task goes in once the child is up: a test's deadlines bound the transfers, not
        # the spawn, torch's import and the model load, which took 26 s of a 30 s wait on a loaded
        # 2-core machine (CI at a0ed973 timed out there: p0 had sent nothing to d0 yet).
        if not self._ready:
            self.wait_ready()
        self.in_q.put((task, abort_after))

    def drain(self, block=False, timeout=60.0):
        deadline = time.monotonic() + timeout
        while True:
            try:
                kind, *rest = self.out_q.get(timeout=0.05 if not block else max(0.01, deadline - time.monotonic()))
            except Exception:
                if not block or time.monotonic() > deadline or not self.proc.is_alive():
                    return
                continue
            if kind == "kv":
                self.sums[rest[0]] = rest[1]
                if rest[2] is not None:
                    self.kv[rest[0]] = rest[2]
            elif kind == "result":
                self.results[rest[0].request_id] = rest[0]
            elif kind == "metrics":
                self.metrics = rest[0]
            elif kind == "done":
                return
            elif kind == "ready":
                self._ready = True  # (whichever drain reads it: a later submit must not wait for it again)
                if self._until_ready:
                    return

    _until_ready = False
    _ready = False

    def wait_ready(self):
        if self._ready:
            return
        # Generous: the child's spawn, torch's import and the model load, ~15 s of CPU, take minutes in
        # the test run's other stream (nice 10: tests/stream_scheduling.py) on a busy machine.
        self._until_ready = True
        self.drain(block=True, timeout=240)
        self._until_ready = False
        assert self._ready, f"the prefill child did not come up (alive: {self.proc.is_alive()})"

    def finish(self):
        self.in_q.put(None)
        self.drain(block=True)
        self.proc.join(timeout=30)


# A plane block of the demo model (one block's K or V of one layer) is 16 tokens x 2 heads x 32 x fp32.
PLANE = 16 * 2 * 32 * 4
SMALL_SLOTS = dict(staging_bytes=3 * 2 * PLANE)  # three blocks a launch: many launches, the ring reused


@pytest.mark.parametrize("how", ["one_message", "layerwise_small_slots"])
def test_kv_bit_identical_and_greedy_matches_engine(demo_model_dir, store, how):
    # one_message: every bundle of the demo model fits one staging slot, gathered into one message and
    # scattered on arrival; layerwise_small_slots: layer by layer during the forward, each layer of a
    # bundle in windows of three blocks through a two-slot ring reused across launches and bundles.
    kw = {} if how == "one_message" else dict(layerwise_min_tokens=0, **SMALL_SLOTS)
    spec = _spec(store, f"exact-{how}", **kw)
    p = PrefillProc(spec, "p0", demo_model_dir, ship_kv=True, budget=48)
    dec = harness.DecodeSide("d0", demo_model_dir, spec)
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 500) for _ in range(n)] for n in (7, 16, 61, 33, 100)]
    reqs = [harness.request(pr, max_tokens=8) for pr in prompts]
    # Every other reservation is scattered over the pool (staged and scattered on arrival whatever
    # the config); the others are one run (in place when the config allows).
    pool = dec.allocator.allocate(200)
    rng.shuffle(pool)
    tasks = []
    for k, r in enumerate(reqs):
        n = -(-len(r.prompt_token_ids) // 16) + 1
        blocks = [pool.pop() for _ in range(n)] if k % 2 else None
        tasks.append(dec.reserve(r, "p0", blocks))
    for t in tasks:
        p.submit(t)
    arrivals = dec.wait_arrivals(len(reqs))
    p.finish()
    assert len(arrivals) == len(reqs) and all(a.error is None for a in arrivals), arrivals
    assert [a.reservation.transfer_seq for a in arrivals] == list(range(len(reqs)))
    ref = LLMEngine(demo_model_dir).generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    for a, req, out in zip(arrivals, reqs, ref):
        n = -(-len(req.prompt_token_ids) // 16)
        got = kv_cache_blocks(dec.kv_cache, list(a.reservation.block_ids[:n]))
        assert got.contiguous().view(torch.uint8).numpy().tobytes() == p.kv[req.request_id]  # bit-identical
        assert a.stats.bytes == n * dec.kvspec.bytes_per_block and a.stats.gbps > 0
        assert p.results[req.request_id].ok and p.results[req.request_id].transfer_bytes == a.stats.bytes
        assert dec.greedy_decode(req, a.reservation.block_ids, a.header.first_token) == list(out.token_ids)
    assert p.metrics["transfers"] == len(reqs) and p.metrics["failures"] == 0
    dec.transport.close()


@pytest.mark.parametrize("layerwise", [False, True])
def test_prefix_cached_remainder_is_staged_exactly(demo_model_dir, store, layerwise):
    """With prefix caching the decode worker holds a prompt's leading blocks already: only the rest
    travels (two launches a layer here), into the reserved blocks after them. The cached blocks are
    not touched, and greedy decoding from cached + shipped KV matches the engine."""
    spec = _spec(store, f"prefix{layerwise}", layerwise_min_tokens=0 if layerwise else 1 << 30, **SMALL_SLOTS)
    p = PrefillProc(spec, "p0", demo_model_dir, ship_kv=True, budget=128)
    dec = harness.DecodeSide("d0", demo_model_dir, spec)
    rng = random.Random(5)
    prefix = [rng.randrange(5, 500) for _ in range(48)]  # three full blocks
    first = harness.request(prefix + [rng.randrange(5, 500) for _ in range(13)], max_tokens=4)
    p.submit(dec.reserve(first, "p0"))
    (a,) = dec.wait_arrivals(1)
    assert a.error is None, a.error
    cached = list(a.reservation.block_ids[:3])  # what the decode worker's prefix cache holds for `prefix`
    before = harness.block_checksum(dec.kv_cache, cached)
    second = harness.request(prefix + [rng.randrange(5, 500) for _ in range(60)], max_tokens=8)
    rest = dec.allocator.allocate(dec.kvspec.blocks_for_tokens(len(second.prompt_token_ids) + 1) - 3)
    res = Reservation(second.request_id, "d0", tuple(rest), next(dec._seq["p0"]), num_cached_blocks=3)
    dec.transport.expect(res, "p0")
    p.submit(PrefillTask(second, res))
    (b,) = dec.wait_arrivals(1)
    p.finish()
    assert b.error is None and b.header.num_tokens == 60, b
    n = 4  # 60 tokens
    assert b.stats.bytes == n * dec.kvspec.bytes_per_block == p.results[second.request_id].transfer_bytes
    got = kv_cache_blocks(dec.kv_cache, rest[:n]).contiguous().view(torch.uint8).numpy().tobytes()
    assert got == p.kv[second.request_id]  # bit-identical
    assert harness.block_checksum(dec.kv_cache, cached) == before  # the cached prefix is as it was
    ref = LLMEngine(demo_model_dir).generate([list(second.prompt_token_ids)],
                                             SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert dec.greedy_decode(second, cached + rest, b.header.first_token) == list(ref[0].token_ids)
    dec.transport.close()


def test_interleaved_prefills_and_decodes_keep_order(demo_model_dir, store):
    spec = _spec(store, "many")
    ps = {pid: PrefillProc(spec, pid, demo_model_dir, budget=40) for pid in ("p0", "p1")}
    decs = {did: harness.DecodeSide(did, demo_model_dir, spec, with_model=False) for did in ("d0", "d1")}
    rng = random.Random(1)
    sent = []
    for i in range(16):
        pid, did = rng.choice(sorted(ps)), rng.choice(sorted(decs))
        req = harness.request([rng.randrange(5, 500) for _ in range(rng.randrange(1, 90))])
        task = decs[did].reserve(req, pid)
        ps[pid].submit(task)
        sent.append((pid, did, task))
    got = {did: d.wait_arrivals(sum(1 for _, x, _ in sent if x == did)) for did, d in decs.items()}
    for p in ps.values():
        p.finish()
    for did, arrivals in got.items():
        assert all(a.error is None for a in arrivals), arrivals
        for pid in ps:
            seqs = [a.reservation.transfer_seq for a in arrivals if (pid, did, a.reservation.request_id) in
                    {(x, y, t.request.request_id) for x, y, t in sent}]
            assert seqs == sorted(seqs) and len(seqs) == sum(1 for x, y, _ in sent if (x, y) == (pid, did))
        for a in arrivals:
            pid = next(x for x, _, t in sent if t.request.request_id == a.reservation.request_id)
            n = -(-a.header.num_tokens // 16)
            assert harness.block_checksum(decs[did].kv_cache, a.reservation.block_ids[:n]) == ps[pid].sums[a.reservation.request_id]
    for d in decs.values():
        d.transport.close()


def test_killed_prefill_times_out_instead_of_hanging(demo_model_dir, store):
    spec = _spec(store, "killp", peer_timeout_s=1.0, expect_timeout_s=60.0)
    p = PrefillProc(spec, "p0", demo_model_dir, die_after_sends=1)
    dec = harness.DecodeSide("d0", demo_model_dir, spec, with_model=False)
    tasks = [dec.reserve(harness.request(list(range(5, 30))), "p0") for _ in range(3)]
    p.submit(tasks[0])
    arrivals = dec.wait_arrivals(1, timeout=60)
    t0 = time.monotonic()
    for t in tasks[1:]:
        p.submit(t)
    arrivals += dec.wait_arrivals(2, timeout=20)
    elapsed = time.monotonic() - t0
    p.proc.join(timeout=5)
    assert p.proc.exitcode == 17
    assert len(arrivals) == 3 and elapsed < 15, (arrivals, elapsed)
    assert arrivals[0].error is None
    for a in arrivals[1:]:
        assert a.error and "dead" in a.error and a.header is None, a.error
        dec.allocator.free(list(a.reservation.block_ids))  # the failed arrival is what frees them
    # The peer stays dead: a later expect fails fast instead of waiting expect_timeout_s.
    late = dec.reserve(harness.request(list(range(5, 9))), "p0")
    (a,) = dec.wait_arrivals(1, timeout=5)
    assert a.reservation == late.reservation and "dead" in a.error
    dec.transport.close()


@pytest.mark.parametrize("die_at,slots", [("layer", "one"), ("commit", "one"), ("layer", "small")])
def test_prefill_killed_mid_transfer_fails_it_cleanly(demo_model_dir, store, die_at, slots):
    """Killed with the transfer claimed and its receives posted: mid-payload (layer-wise; with small
    slots, after the first of a layer's several launches went out), or with the payload landed but the
    first token never sent. Either way the transfer fails (no decoding from a half-shipped prompt),
    within peer_timeout_s, and only then do its blocks come back."""
    spec = _spec(store, f"mid{die_at}{slots}", peer_timeout_s=1.0, layerwise_min_tokens=0,
                 **(SMALL_SLOTS if slots == "small" else {}))
    p = PrefillProc(spec, "p0", demo_model_dir, die_at=die_at)
    dec = harness.DecodeSide("d0", demo_model_dir, spec, with_model=False)
    tasks = [dec.reserve(harness.request(list(range(5, 45))), "p0") for _ in range(2)]
    p.wait_ready()
    t0 = time.monotonic()
    for t in tasks:
        p.submit(t)
    arrivals = dec.wait_arrivals(2, timeout=20)
    p.proc.join(timeout=5)
    assert p.proc.exitcode == 17
    assert len(arrivals) == 2 and time.monotonic() - t0 < 10, arrivals
    for a in arrivals:
        assert a.error and "dead" in a.error.lower() and a.header is None, a.error
    assert dec.transport.metrics()["transfers"] == 0
    dec.transport.close()


def test_killed_decode_fails_the_send_with_a_clear_error(demo_model_dir, store):
    from cluster.wire.messages import KVHeader
    from cluster.transport.factory import create_transport

    spec = _spec(store, "killd", peer_timeout_s=1.0, transfer_timeout_s=30.0)
    # The decode worker reserved and then died: no heartbeat, no receives (its last record, sealed as
    # every value in the store is: control.py).
    from cluster.transport.rendezvous_store import store_factory

    store_factory(spec)().set("killd/hb/d0", msgspec.msgpack.encode([1, 5]))
    kv = torch.randn(2, 2, 8, 16, 2, 4)
    t = create_transport(spec, kv, "p0", "prefill")
    res = Reservation("r-dead", "d0", (1, 2), 0)
    t0 = time.monotonic()
    with pytest.raises((TimeoutError, RuntimeError), match="d0"):
        t.send(res, KVHeader("r-dead", 0, 20, 3), [3, 4], timeout_s=30.0)
    assert time.monotonic() - t0 < 10
    with pytest.raises(RuntimeError, match="marked dead"):
        t.send(Reservation("r2", "d0", (5,), 1), KVHeader("r2", 1, 4, 3), [5], timeout_s=30.0)
    t.close()


@pytest.mark.parametrize("slots", ["one", "small"])
def test_random_aborts_and_timeouts_never_expose_foreign_blocks(demo_model_dir, store, slots):
    """A small pool forces block reuse; prefill aborts, decode cancels and expect timeouts race the
    transfers (with small slots: each through many launches of a reused staging ring). Every block a
    request decodes from must hold exactly that request's KV, from arrival until it is freed, and a
    freed block must stay untouched until it is handed out again."""
    spec = _spec(store, f"chaos{slots}", expect_timeout_s=1.0, **(SMALL_SLOTS if slots == "small" else {}))
    rng = random.Random(7)
    reqs = [harness.request([rng.randrange(5, 500) for _ in range(rng.randrange(1, 60))]) for _ in range(40)]
    slow = {r.request_id: 1.5 for r in reqs if rng.random() < 0.2}  # past expect_timeout_s: cancelled
    p = PrefillProc(spec, "p0", demo_model_dir, budget=32, slow=slow)
    dec = harness.DecodeSide("d0", demo_model_dir, spec, num_blocks=24, with_model=False)
    p.wait_ready()
    POISON = float("nan")
    dec.kv_cache.fill_(POISON)
    poison_sum = harness.block_checksum(dec.kv_cache, [1])[0]
    live, decoding, arrived_sums, outcomes = {}, [], {}, {"ok": 0, "aborted": 0, "timeout": 0, "cancelled": 0}
    todo = list(reqs)

    def check_free_untouched():
        free = list(dec.allocator._free)
        assert all(s == poison_sum for s in harness.block_checksum(dec.kv_cache, free)), "write into a free block"

    deadline = time.monotonic() + 60
    while (todo or live or decoding) and time.monotonic() < deadline:
        if todo and dec.allocator.can_allocate(-(-len(todo[0].prompt_token_ids) // 16) + 1) and len(live) < 6:
            req = todo.pop(0)
            task = dec.reserve(req, "p0")
            live[req.request_id] = task
            r = rng.random()
            p.submit(task, abort_after=0.0 if r < 0.15 else None)
            if 0.15 <= r < 0.25:
                dec.transport.cancel(task.reservation, "p0")  # decode side aborts: blocks held until arrival
        for a in dec.transport.poll_arrivals():
            deadline = time.monotonic() + 60  # restarted by every arrival: the child may get a tenth of a core
            task = live.pop(a.reservation.request_id)
            blocks = list(a.reservation.block_ids)
            if a.error is None:
                n = -(-a.header.num_tokens // 16)
                arrived_sums[a.reservation.request_id] = (harness.block_checksum(dec.kv_cache, blocks[:n]), n)
                decoding.append((time.monotonic() + rng.random() * 0.2, a.reservation.request_id, blocks, n))
                outcomes["ok"] += 1
            else:
                outcomes["timeout" if "Timeout" in a.error else "aborted"] += 1
                dec.kv_cache[:, :, blocks] = POISON
                dec.allocator.free(blocks)
        for item in [d for d in decoding if d[0] < time.monotonic()]:
            _, rid, blocks, n = item
            assert harness.block_checksum(dec.kv_cache, blocks[:n]) == arrived_sums[rid][0], f"{rid}'s blocks were rewritten"
            dec.kv_cache[:, :, blocks] = POISON
            dec.allocator.free(blocks)
            decoding.remove(item)
        check_free_untouched()
        time.sleep(0.002)
    p.finish()
    assert not todo and not live and not decoding, (len(todo), live, decoding)
    for rid, (sums, n) in arrived_sums.items():
        assert sums == p.sums[rid], f"{rid} decoded from KV that is not its own"
    assert outcomes["ok"] >= 10 and outcomes["timeout"] + outcomes["aborted"] >= 5, outcomes
    failed_sends = [r for r in p.results.values() if not r.ok]
    assert all(r.error for r in failed_sends)
    dec.transport.close()
