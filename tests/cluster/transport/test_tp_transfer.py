"""KV transfer between tensor-parallel workers of different sizes, on CPU (gloo; every rank its own
process; the real PrefillWorker and DecodeWorker with their followers): (P, D) TP = (1, 2) (the prefill
rank splits its blocks' heads over two decode ranks), (2, 1) (the decode rank gathers head slices from
two prefill ranks), (2, 2) (rank to rank, whole blocks), and Mistral's single KV head at (2, 1): held by
both prefill ranks, sent by one of them (the other has no link in the pair). Layer-wise shipping from every prefill rank's forward, small staging slots (several
launches per link and layer), and a second wave whose prompts share a cached prefix with the first (only
the missing blocks travel). Checked: every decode rank's blocks hold exactly, bit for bit, its heads of
the prefill rank's blocks the head mapping names; greedy output equals the one-process engine's; the
transfer bytes are the whole model's; both groups shut down cleanly."""

import multiprocessing as mp
import random
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # every rank of both workers in a spawned process

sys.path.insert(0, str(Path(__file__).parents[2] / "decode_worker"))
import tp_workers  # noqa: E402
from test_decode_worker import Collector  # noqa: E402

from cluster.distributed.rank_launcher import ProcessRankLauncher  # noqa: E402
from cluster.distributed.sharding import kv_heads_of_rank  # noqa: E402
from cluster.engine.engine import LLMEngine  # noqa: E402
from cluster.wire.messages import GenerateRequest, PrefillTask, ReserveRequest  # noqa: E402
from cluster.model.config import ModelArchConfig  # noqa: E402
from cluster.sampling.sampling_params import SamplingParams  # noqa: E402
from cluster.transport.rendezvous_store import start_store  # noqa: E402
from cluster.transport.factory import TransportSpec, create_transport  # noqa: E402
from cluster.transport.plan import head_links  # noqa: E402
from cluster.worker.worker_config import WorkerConfig  # noqa: E402
from cluster.engine.worker_model import lead_group  # noqa: E402
from decode_worker.decode_worker import DecodeWorker  # noqa: E402

CASES = [("demo_model_dir", 1, 2), ("demo_model_dir", 2, 1), ("demo_model_dir", 2, 2), ("mistral_model_dir", 2, 1)]
NEW_TOKENS = 6


def _get(q, kind, timeout=180):
    got, value = q.get(timeout=timeout)
    assert got == kind, (got, value)
    return value


@pytest.mark.parametrize("fixture,p_tp,d_tp", CASES, ids=[f"{f.split('_')[0]}-P{p}D{d}" for f, p, d in CASES])
def test_tp_transfer_is_exact(fixture, p_tp, d_tp, request, tmp_path):
    model_dir = request.getfixturevalue(fixture)
    arch = ModelArchConfig.from_dir(model_dir)
    plane = 16 * 1 * arch.head_dim * 4  # one block's K of one layer, one head, fp32
    store = start_store("127.0.0.1", 0)
    spec = TransportSpec("torch_dist", store_host="127.0.0.1", store_port=store.port, namespace=f"tp-{p_tp}{d_tp}",
                         heartbeat_s=0.1, layerwise_min_tokens=0, staging_bytes=3 * 2 * plane,
                         staging_cap_bytes=64 << 20)
    base = dict(model_dir=str(model_dir), dtype="float32", cpu_num_blocks=128, max_num_seqs=8, max_prefill_tokens=256)
    p_cfg = WorkerConfig(**base, tensor_parallel_size=p_tp)
    d_cfg = WorkerConfig(**base, tensor_parallel_size=d_tp)

    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    pre = ctx.Process(target=tp_workers.prefill_main, args=(q_in, q_out, p_cfg, spec, str(tmp_path)))
    pre.start()
    launcher = ProcessRankLauncher(tp_workers.decode_rank, "d0", d_cfg, str(tmp_path))
    failures = []
    dec, served = None, False
    try:
        group = lead_group(d_cfg, launcher.launch, on_failure=failures.append) if d_tp > 1 else None
        dec = DecodeWorker("d0", d_cfg, group=group)
        dec.attach_transport(create_transport(spec, dec.kv_cache, "d0", "decode", group=dec.group,
                                              kv_heads=arch.num_kv_heads))
        # The prefill leader's spawn and torch import, then its followers' (the group's own join_timeout_s
        # is 300 s) and the model load: minutes in the test run's other stream (nice 10) on a busy machine.
        _get(q_out, "ready", timeout=300)
        q_in.put(("connect", ["d0"]))
        _get(q_out, "connected")
        rng = random.Random(7)
        first = [[0] + [rng.randrange(5, 500) for _ in range(n - 1)] for n in (7, 40, 75)]
        # The second wave shares the first wave's leading blocks (the decode worker's prefix cache has them).
        second = [first[1][:32] + [rng.randrange(5, 500) for _ in range(9)], first[2][:64] + [3, 4, 5]]
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        col = Collector(dec)
        reservations, sources = {}, {}
        for wave, prompts in enumerate((first, second)):
            rids = []
            for i, prompt in enumerate(prompts):
                rid = f"w{wave}-{i}"
                req = GenerateRequest(rid, tuple(prompt), params, 0, time.time())
                res = dec.reserve(ReserveRequest(req, "p0"))
                assert res is not None
                reservations[rid] = (res, prompt)
                q_in.put(("submit", PrefillTask(req, res)))
                rids.append(rid)
            for _ in rids:
                rid, result, src = _get(q_out, "result")
                assert result.ok, result.error
                sources[rid] = src
            col.wait(lambda: all(r in col.finish for r in rids), stall_s=120)
        assert any(reservations[r][0].num_cached_blocks > 0 for r in ("w1-0", "w1-1"))  # only the rest travelled
        ref = LLMEngine(model_dir, dtype="float32").generate([p for _, p in reservations.values()], params)
        assert [col.tokens[r] for r in reservations] == [list(o.token_ids) for o in ref]
        m = dec.transport.metrics()
        assert m["transfers"] == 5 and m["failures"] == 0
        full_block = 2 * arch.num_layers * 16 * arch.num_kv_heads * arch.head_dim * 4
        recv = {r["request_id"]: r["bytes"] for r in m["recent"] if r["side"] == "recv"}
        for rid, (res, _) in reservations.items():
            assert recv[rid] == len(sources[rid]) * full_block  # the whole model's heads, every rank's part
        served = True
    finally:
        if dec is not None:
            dec.shutdown()
        q_in.put(("stop",))
        if not served:
            # Its reports below go unread, but the prefill process must still end: pytest's exit joins
            # every non-daemon child, and one left waiting for "stop" (a failure in lead_group came
            # before this block) hung the suite after its summary.
            pre.join(60)
            if pre.is_alive():
                pre.kill()
            launcher.kill()
    p_metrics = _get(q_out, "metrics")
    assert _get(q_out, "stopped") == [0] * (p_tp - 1)  # the prefill followers left cleanly too
    pre.join(60)
    assert launcher.join(60) == [0] * (d_tp - 1) and failures == []
    assert p_metrics["transfers"] == 5 and p_metrics["failures"] == 0
    # Bytes: each decode rank's head of each transferred block equals the prefill rank's the mapping names.
    p_kv = {r: torch.load(tmp_path / f"prefill-r{r}.pt") for r in range(p_tp)}
    d_kv = {0: dec.kv_cache} | {r: torch.load(tmp_path / f"decode-r{r}.pt") for r in range(1, d_tp)}
    links = head_links(arch.num_kv_heads, p_tp, d_tp)
    checked = 0
    for rid, (res, prompt) in reservations.items():
        full = len(prompt) // 16  # full blocks: decoding never writes them again
        src = sources[rid][:max(0, full - res.num_cached_blocks)]
        dst = list(res.block_ids[:len(src)])
        for x in links:
            for j in range(x.n):
                got = d_kv[x.decode_rank][:, :, dst, :, x.dst0 + j]
                want = p_kv[x.prefill_rank][:, :, src, :, x.src0 + j]
                assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (rid, x, j)
                checked += 1
    assert checked > 0
    # Every decode rank holds exactly its heads (nothing else landed): a replicated head on every rank.
    assert {x.decode_rank for x in links} == set(range(d_tp))
    for d in range(d_tp):
        assert sum(x.n for x in links if x.decode_rank == d) == len(kv_heads_of_rank(arch.num_kv_heads, d_tp, d))
