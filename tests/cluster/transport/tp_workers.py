"""Processes of the tensor-parallel KV transfer tests (spawned: each imports this module afresh).

A prefill worker of N ranks runs in `prefill_main` (its rank 0, driven over multiprocessing queues;
its followers are spawned from it); the decode worker's followers run `decode_rank`. Every rank writes
its KV cache to `dump_dir/<role>-r<rank>.pt` when its worker shuts down, so the test can compare bytes
rank by rank; the prefill's rank 0 also records the source blocks of every transfer."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def _dump(dump_dir: str, role: str, rank: int, kv: torch.Tensor) -> None:
    torch.save(kv.cpu().clone(), Path(dump_dir) / f"{role}-r{rank}.pt")


def decode_rank(rank: int, rendezvous, worker_id: str, cfg, dump_dir: str) -> None:
    from decode_worker.rank_follower import DecodeRankFollower

    from cluster.distributed.rank_launcher import exit_now

    f = DecodeRankFollower(worker_id, cfg, rank, rendezvous, start=False)
    f.run()
    _dump(dump_dir, "decode", rank, f.kv_cache)
    exit_now(0)


def prefill_rank(rank: int, rendezvous, worker_id: str, cfg, dump_dir: str) -> None:
    from prefill_worker.rank_follower import PrefillRankFollower

    from cluster.distributed.rank_launcher import exit_now

    f = PrefillRankFollower(worker_id, cfg, rank, rendezvous, start=False)
    f.run()
    _dump(dump_dir, "prefill", rank, f.kv_cache)
    exit_now(0)


def prefill_main(q_in, q_out, cfg, spec, dump_dir: str) -> None:
    """Rank 0 of a prefill worker: ("connect", ids) -> seconds; ("submit", task) -> (rid, PrefillResult,
    source blocks); ("stop",) -> shuts down (the followers dump on the group's Stop)."""
    from cluster.distributed.rank_launcher import ProcessRankLauncher
    from cluster.transport.factory import create_transport
    from cluster.engine.worker_model import lead_group
    from prefill_worker.prefill_worker import PrefillWorker

    launcher = ProcessRankLauncher(prefill_rank, "p0", cfg, dump_dir)
    group = lead_group(cfg, launcher.launch) if cfg.tensor_parallel_size > 1 else None
    w = PrefillWorker("p0", cfg, group=group)
    t = create_transport(spec, w.kv_cache, "p0", "prefill", group=w.group, kv_heads=w.arch.num_kv_heads)
    sources: dict[str, list[int]] = {}
    begin = t.begin

    def recording_begin(sends, layerwise=None):
        for s in sends:
            sources[s.reservation.request_id] = list(s.src_block_ids)
        return begin(sends, layerwise)
    t.begin = recording_begin
    w.set_transport(t, spec.transfer_timeout_s)
    w.start()
    q_out.put(("ready", None))
    while True:
        cmd = q_in.get()
        if cmd[0] == "connect":
            q_out.put(("connected", t.connect(cmd[1])))
        elif cmd[0] == "submit":
            task = cmd[1]
            rid = task.request.request_id
            w.submit(task).add_done_callback(lambda f, rid=rid: q_out.put(("result", (rid, f.result(), sources.get(rid)))))
        elif cmd[0] == "stop":
            _dump(dump_dir, "prefill", 0, w.kv_cache)
            q_out.put(("metrics", json.loads(json.dumps(t.metrics(), default=str))))
            w.shutdown()
            t.close()
            q_out.put(("stopped", launcher.join(60)))
            return
