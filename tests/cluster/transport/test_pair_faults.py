"""A pair that breaks while both its workers live (issue 29 item 3), over gloo between processes: a
transfer killed mid-payload, a transfer whose payload never completes, a peer that dies while a pair
forms. Each fails only what it must, at once or at transfer_timeout_s, frees the decode side's
blocks, and the pair is formed anew (its next generation) so the next transfer lands intact."""

import sys
import threading
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # prefill and decode in spawned processes over gloo

sys.path.insert(0, str(Path(__file__).parent))
import harness  # noqa: E402
from test_torch_dist import SMALL_SLOTS, PrefillProc, _spec  # noqa: E402

from cluster.transport.rendezvous_store import start_store  # noqa: E402
from cluster.transport.factory import create_transport  # noqa: E402
from cluster.transport.pair import PeerDeadError  # noqa: E402


@pytest.fixture
def store():
    yield start_store("127.0.0.1", 0)


def _wait(cond, timeout=20.0, what=""):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _landed_intact(dec, p, arrival, req):
    n = -(-len(req.prompt_token_ids) // 16)
    return harness.block_checksum(dec.kv_cache, list(arrival.reservation.block_ids[:n])) == p.sums[req.request_id]


@pytest.mark.parametrize("fault", ["transfer", "stuck_transfer"])
def test_a_broken_pair_fails_its_transfer_frees_it_and_forms_again(demo_model_dir, store, fault):
    """"transfer": the pair is killed right after the first layer went out: the decode side's receives
    fail at once (gloo: the socket closes), long before transfer_timeout_s. "stuck_transfer": nothing
    more moves on the pair: both sides find it at transfer_timeout_s. Either way the transfer fails on
    both sides, the prefill re-forms the pair (generation 1) and the next transfers land intact."""
    timeout_s = 2.0
    spec = _spec(store, f"pair-{fault}", layerwise_min_tokens=0, transfer_timeout_s=timeout_s, **SMALL_SLOTS,
                 peer_timeout_s=5.0)
    p = PrefillProc(spec, "p0", demo_model_dir, fault=fault, budget=64)
    dec = harness.DecodeSide("d0", demo_model_dir, spec, with_model=False)
    try:
        p.wait_ready()
        first = harness.request(list(range(5, 45)))
        t0 = time.monotonic()
        p.submit(dec.reserve(first, "p0"))
        (a,) = dec.wait_arrivals(1, timeout=30)
        took = time.monotonic() - t0
        print(f"\n{fault}: the transfer failed after {took:.2f}s: {a.error}")
        assert a.error is not None and a.reservation.request_id == first.request_id
        if fault == "transfer":
            assert took < timeout_s, took  # at once, not at the stall deadline
        else:
            assert timeout_s <= took < 4 * timeout_s + 2, took
        _wait(lambda: (p.drain(), first.request_id in p.results)[1], what="the prefill's result")
        assert not p.results[first.request_id].ok
        # Formed anew between the same incarnations: the next generation (the decode side took its Hello).
        _wait(lambda: (dec.transport.pairs.get("p0") is not None and dec.transport.pairs["p0"].gen == 1
                       and dec.transport.pairs["p0"].dead is None), what="the pair's next generation")
        nxt = [harness.request(list(range(7, 7 + n))) for n in (20, 50)]
        for r in nxt:
            p.submit(dec.reserve(r, "p0"))
        arrivals = dec.wait_arrivals(2, timeout=30)
        p.finish()
        assert [x.error for x in arrivals] == [None, None], arrivals
        assert all(_landed_intact(dec, p, x, r) for x, r in zip(arrivals, nxt))
        assert p.metrics["faults_fired"] == 1 and p.metrics["pairs"]["d0"]["gen"] == 1
    finally:
        dec.transport.close()


def test_a_peer_that_dies_while_the_pair_forms_fails_it_at_once(demo_model_dir, store):
    """The decode side takes its time to form the pair ("slow_hello": 10 s); the prefill hears that it
    died (peer_died: the router, told by Ray) and its connect fails then, not at the rendezvous'
    timeout."""
    spec = _spec(store, "slow-hello", transfer_timeout_s=30.0, peer_timeout_s=30.0)
    pool = torch.zeros(4, 2, 64, 16, 2, 32)
    dec = create_transport(spec, pool, "d0", "decode")
    pre = create_transport(spec, torch.zeros(4, 2, 64, 16, 2, 32), "p0", "prefill")
    try:
        dec.inject_fault("slow_hello", 10.0)
        out = {}

        def connect():
            t0 = time.monotonic()
            try:
                pre.connect(["d0"])
                out["ok"] = time.monotonic() - t0
            except PeerDeadError as e:
                out["err"] = (time.monotonic() - t0, str(e))
        th = threading.Thread(target=connect)
        th.start()
        time.sleep(0.5)
        pre.peer_died("d0", "Ray reports decode worker d0 dead")
        th.join(5)
        assert not th.is_alive() and "err" in out, out
        took, why = out["err"]
        print(f"\nconnect failed {took:.2f}s after it began: {why}")
        assert took < 2.0 and "died while forming" in why
    finally:
        pre.close()
        dec.close()
