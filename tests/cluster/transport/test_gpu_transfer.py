"""GPU: same-GPU (CUDA IPC) transfers on one device; the staged torch_dist payload's CUDA code on one
device over a loopback group (NCCL-free); NCCL between two GPUs: exact for every slot size, and a peer
that dies mid-transfer fails that transfer cleanly (no hang, no process torn down by NCCL's watchdog)
while the survivor's other pairs keep working."""

import multiprocessing as mp
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import harness  # noqa: E402
import loopback_pg  # noqa: E402

from cluster.wire.messages import Reservation  # noqa: E402
from cluster.transport.base import KVSend  # noqa: E402
from cluster.transport.rendezvous_store import start_store  # noqa: E402
from cluster.transport.factory import TransportSpec, create_transport  # noqa: E402

pytestmark = pytest.mark.gpu
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
CTX = mp.get_context("spawn")


def test_same_gpu_transfer_is_exact_and_reports_bandwidth():
    from benchmarks.bench_transfer import run_path

    res = run_path("same_gpu", [256, 2048], quick=True)
    assert res["rows"] and not res["errors"], res
    for r in res["rows"]:
        print(f"same_gpu {r['prompt_tokens']} tokens: {r['GBps']:.1f} GB/s (D2D copy {r['copy_GBps']:.1f} GB/s)")
        assert r["exact"], r
        assert r["GBps"] > 0 and r["copy_GBps"] > 0 and r["copy_kernel_GBps"] > 0


def test_staged_cuda_payload_on_one_gpu_over_a_loopback_group(monkeypatch):
    """Both ends on one GPU, NCCL replaced by a loopback group with the same stream rules: bundles of
    1-3 prompts, layer-wise (each layer written by the "forward" on the compute stream after a delay
    kernel, just before its layer_done) or not, through a two-slot ring of three blocks a launch
    (layer groups and windows). Every reserved block gets exactly its source block's final bytes."""
    import random
    import uuid

    loopback_pg.install(monkeypatch, seed=1)
    plane = 16 * 8 * 64 * 2
    spec = TransportSpec("torch_dist", backend="nccl", namespace=f"loop-{uuid.uuid4().hex[:8]}", heartbeat_s=0.05,
                         staging_bytes=3 * 2 * plane)
    g = torch.Generator(device="cuda").manual_seed(0)
    src = torch.randn((4, 2, 96, 16, 8, 64), generator=g, device="cuda").to(torch.bfloat16)
    dst = torch.zeros_like(src)
    td = create_transport(spec, dst, "d", "decode")
    tp = create_transport(spec, src, "p", "prefill")
    tp.connect(["d"])
    rng, seq = random.Random(2), 0
    for bundle in range(10):
        free = rng.sample(range(1, 96), 95)
        used = rng.sample(range(1, 96), 30)
        sends = []
        for _ in range(rng.randint(1, 3)):
            n = rng.randint(1, 9)
            res = Reservation(f"r{seq}", "d", tuple(free.pop() for _ in range(n + 1)), seq)
            td.expect(res, "p")
            sends.append(KVSend(res, n * 16, tuple(used.pop() for _ in range(n))))
            seq += 1
        blocks = [b for s in sends for b in s.src_block_ids]
        layerwise = bundle % 2 == 0
        sh = tp.begin(sends, layerwise=layerwise)
        for layer in range(4):  # the forward writes layer i, then reports it
            torch.cuda._sleep(rng.randrange(1, 300_000))
            src[layer][:, blocks] = torch.randn((2, len(blocks), 16, 8, 64), generator=g, device="cuda").to(src.dtype)
            if layerwise:
                sh.layer_done(layer)
        sh.commit({s.reservation.request_id: 1 for s in sends})
        for s in sends:
            sh.futures[s.reservation.request_id].result(timeout=60)
        got, deadline = [], time.monotonic() + 60
        while len(got) < len(sends) and time.monotonic() < deadline:
            got += td.poll_arrivals()
            time.sleep(0.001)
        assert [a.reservation for a in got] == [s.reservation for s in sends]
        for a, s in zip(got, sends):
            assert a.error is None, a.error
            n = len(s.src_block_ids)
            want = src[:, :, list(s.src_block_ids)].view(torch.int16)
            assert torch.equal(dst[:, :, list(a.reservation.block_ids[:n])].view(torch.int16), want), (bundle, layerwise)
    assert tp.metrics()["staging_bytes"] == td.metrics()["staging_bytes"] == 2 * spec.staging_bytes
    tp.close(), td.close()


@two_gpus
@pytest.mark.parametrize("path", ["nccl", "nccl_slot16m"])
def test_nccl_transfer_is_exact(path):
    # 8192 tokens are 32 MiB a layer: layer groups with 32 MiB slots, two windows a layer with 16 MiB.
    from benchmarks.bench_transfer import run_path

    res = run_path(path, [128, 2048, 8192], "cuda:0", "cuda:1", quick=True)
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
                         transfer_timeout_s=20.0, staging_bytes=64 << 10)  # one layer of two blocks a launch
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
