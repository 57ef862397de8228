"""The all-reduce rule (one place: cluster/distributed/communicator.all_reduce_path) and the collectives
on CPU: gloo on CPU whatever the size; on CUDA one-shot up to the size limit of the group's size (when
the symmetric-memory buffer exists, for the dtypes its kernel reduces), NCCL above; the communicator
asks the rule for each tensor. A two-process gloo group sums, gathers in rank order and agrees on a
minimum."""

import multiprocessing as mp

import torch

from cluster.distributed.communicator import ONE_SHOT_MAX_BYTES, TPCommunicator, all_reduce_path


def test_the_rule():
    assert all_reduce_path(8192, 2, "cpu", True) == "gloo"
    assert all_reduce_path(8192, 2, "cuda", True) == "one_shot"  # 8B decode at batch 1: [1, 4096] bf16
    assert all_reduce_path(64 * 8192, 2, "cuda", True) == "one_shot"  # batch 64
    assert all_reduce_path(ONE_SHOT_MAX_BYTES[2], 2, "cuda", True) == "one_shot"
    assert all_reduce_path(ONE_SHOT_MAX_BYTES[2] + 16, 2, "cuda", True) == "nccl"  # prefill sizes
    assert all_reduce_path(8192, 2, "cuda", False) == "nccl"  # no symmetric memory on this machine
    assert all_reduce_path(8192, 2, "cuda", True, torch.float16) == "nccl"  # not a dtype the kernel reduces
    assert all_reduce_path(8190, 2, "cuda", True) == "nccl"  # unaligned
    assert all_reduce_path(ONE_SHOT_MAX_BYTES[8], 8, "cuda", True) == "one_shot"
    assert all_reduce_path(ONE_SHOT_MAX_BYTES[8] + 16, 8, "cuda", True) == "nccl"
    assert all_reduce_path(1024, 3, "cuda", True) == "nccl"  # no one-shot size for odd groups
    assert ONE_SHOT_MAX_BYTES[2] >= ONE_SHOT_MAX_BYTES[4] >= ONE_SHOT_MAX_BYTES[8]


class _FakeOneShot:
    dtype = torch.bfloat16


def test_the_communicator_asks_the_rule_per_tensor():
    c = TPCommunicator(0, 2, torch.device("cpu"))
    assert c.path(torch.zeros(4096)) == "gloo"
    c.one_shot = _FakeOneShot()
    assert c.path(torch.zeros(2, 4096, dtype=torch.bfloat16)) == "gloo"  # a CPU tensor: gloo whatever the size


def _rank(rank, port, q):
    import datetime

    import torch.distributed as dist

    # Generous: the two ranks import torch side by side in the test run's other stream (nice 10), where a
    # busy machine may leave them a tenth of a core; only a rank that never comes makes it matter.
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    c = TPCommunicator(rank, 2, torch.device("cpu"))
    s = c.all_reduce(torch.full((3,), float(rank + 1)))
    g = c.all_gather(torch.full((2, 2), float(rank)))
    q.put((rank, s.tolist(), g.tolist(), c.min_int(10 - rank), c.broadcast_int(5 + rank)))
    dist.destroy_process_group()


def test_gloo_collectives():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(q.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(30)
    for rank, s, g, m, b in got:
        assert s == [3.0] * 3
        assert g == [[[0.0, 0.0], [0.0, 0.0]], [[1.0, 1.0], [1.0, 1.0]]]  # [size, rows, cols], rank order
        assert (m, b) == (9, 5)
