"""GPU: same-GPU (CUDA IPC) transfers on one device; NCCL between two GPUs: exact under every plan, and
a peer that dies mid-transfer fails that transfer cleanly (no hang, no process torn down by NCCL's
watchdog) while the survivor's other pairs keep working."""

import multiprocessing as mp
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import harness  # noqa: E402

from cluster.messages import Reservation  # noqa: E402
from cluster.transport.control import start_store  # noqa: E402
from cluster.transport.factory import TransportSpec  # noqa: E402

pytestmark = pytest.mark.gpu
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
CTX = mp.get_context("spawn")


def test_same_gpu_transfer_is_exact_and_reports_bandwidth():
    from loadtest.bench_transfer import run_path

    res = run_path("same_gpu", [256, 2048], quick=True)
    assert res["rows"] and not res["errors"], res
    for r in res["rows"]:
        print(f"same_gpu {r['prompt_tokens']} tokens: {r['GBps']:.1f} GB/s (D2D copy {r['copy_GBps']:.1f} GB/s)")
        assert r["exact"], r
        assert r["GBps"] > 0 and r["copy_GBps"] > 0 and r["copy_kernel_GBps"] > 0


@two_gpus
@pytest.mark.parametrize("path", ["nccl", "nccl_direct", "nccl_staged"])
def test_nccl_transfer_is_exact(path):
    from loadtest.bench_transfer import run_path

    res = run_path(path, [128, 2048], "cuda:0", "cuda:1", quick=True)
    assert res["rows"] and not res["errors"] and res["decode_failures"] == 0, res
    for r in res["rows"]:
        print(f"{path} {r['prompt_tokens']} tokens: {r['seconds'] * 1e3:.3f} ms, {r['GBps']:.1f} GB/s")
        assert r["exact"], r


def _messages(q, until, timeout=60.0):
    out, deadline = [], time.monotonic() + timeout
    while not until(out) and time.monotonic() < deadline:
        try:
            out.append(q.get(timeout=0.5))
        except Exception:
            pass
    return out


@two_gpus
def test_nccl_peer_death_fails_only_its_transfers():
    store = start_store("127.0.0.1", 0)
    spec = TransportSpec("torch_dist", store_host="127.0.0.1", store_port=store.port, backend="nccl",
                         namespace=f"gpu-death-{time.monotonic_ns()}", heartbeat_s=0.1, peer_timeout_s=1.0,
                         transfer_timeout_s=20.0)
    r1 = Reservation("to-d1", "d1", (1, 2, 3), 0)  # d1 dies while this one is half sent
    r2 = Reservation("to-d2", "d2", (5, 6, 7), 0)  # then a normal transfer to d2 on the same prefill
    r3 = Reservation("dies", "d2", (9, 10, 11), 1)  # then the prefill dies half way into this one
    out_q, c1, c2, cp = CTX.Queue(), CTX.Queue(), CTX.Queue(), CTX.Queue()
    d1 = CTX.Process(target=harness.gpu_decode_child, args=(spec, "d1", "cuda:1", [("p0", r1)], c1, out_q), daemon=True)
    d2 = CTX.Process(target=harness.gpu_decode_child, args=(spec, "d2", "cuda:1", [("p0", r2), ("p0", r3)], c2, out_q),
                     daemon=True)
    p0 = CTX.Process(target=harness.gpu_prefill_child,
                     args=(spec, "cuda:0", [("d1", r1, "stall"), ("d2", r2, "full"), ("d2", r3, "die")], cp, out_q),
                     daemon=True)
    for p in (d1, d2, p0):
        p.start()
    msgs = _messages(out_q, lambda m: any(x[0] == "layer0" and x[1] == "to-d1" for x in m), timeout=180)
    assert any(x[0] == "layer0" for x in msgs), msgs
    c1.put("die")  # d1 goes away with the transfer's receives posted and layer 0 landed
    d1.join(timeout=30)
    t_dead = time.monotonic()
    cp.put("go")  # the prefill now sends layers 1..3 to a dead peer
    msgs += _messages(out_q, lambda m: sum(x[0] == "arrival" and x[1] == "d2" for x in m) >= 2, timeout=90)
    sent = {x[1]: x for x in msgs if x[0] == "sent"}
    arrivals = {x[2]: x for x in msgs if x[0] == "arrival"}
    # The half-sent transfer to the dead decode worker failed, in about peer_timeout_s, cleanly.
    assert sent["to-d1"][2] and "d1" in sent["to-d1"][2], sent
    assert time.monotonic() - t_dead < 60
    # The prefill process survived it (NCCL's watchdog did not take it down) and its pair with d2 works.
    assert sent["to-d2"][2] is None and arrivals["to-d2"][3] is None, (sent, arrivals)
    assert arrivals["to-d2"][4] == sent["to-d2"][3]  # exact
    # The prefill died half way into its next transfer: d2 reports it failed, and only then.
    p0.join(timeout=30)
    assert p0.exitcode == 17
    assert arrivals["dies"][3] and "dead" in arrivals["dies"][3].lower(), arrivals["dies"]
    assert d2.is_alive()  # the decode process survived the abort of its pair with p0
    c2.put("die")
    d2.join(timeout=30)
