"""TPCommunicator: the collectives a tensor-parallel model runs, and THE rule for how each all-reduce goes.

Each process is one rank of one tensor-parallel group, which is its torch.distributed world group
(cluster/distributed/tp_group.py forms it; the KV transport's pair groups are separate objects). Per
decoder layer the model runs two all-reduces (after o_proj and after down_proj, RowParallelLinear) and
per pass one all-gather (the vocabulary-parallel LM head's logits).

The all-reduce rule (`all_reduce_path`, the one place it is decided; the benchmark's `allreduce` rows
measure both paths per size to check it):
- on CPU: gloo;
- on CUDA, messages of at most ONE_SHOT_MAX_BYTES[world size] bytes: PyTorch symmetric memory's one-shot
  all-reduce (`torch.ops.symm_mem.one_shot_all_reduce_copy`): each rank copies its input into its
  symmetric buffer, a barrier on the signal pads, then every rank reads every peer's buffer over NVLink
  (CUDA IPC mappings) and sums in rank order, so all ranks hold the same bits. One kernel, ~2-5 us,
  where NCCL's ring costs 10-20 us at decode sizes: at batch 1, 64 all-reduces per 8B step;
- larger messages (prefill, large decode batches): NCCL.
Both run inside a captured CUDA graph (the decode step: one graph per bucket, collectives included):
the one-shot kernel synchronizes through its signal pads, NCCL through its own kernels; the NCCL
communicator is created by an eager collective before any capture (the graph runner's warm-up pass).

NVLink multicast (NVLS) stays off: tp_group.py sets NCCL_NVLS_ENABLE=0 and
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 before any communicator exists, and only the unicast one-shot kernel
is called here (never multimem_*).
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# Largest all-reduce (bytes) that goes one-shot, per world size: one-shot reads (N - 1) peer copies per
# rank, so its advantage over NCCL's ring shrinks as the group grows (vLLM's custom all-reduce draws the
# same lines). 8B decode: [B, 4096] bf16 = 8 KiB a row, so batch 256 still goes one-shot at TP 2.
ONE_SHOT_MAX_BYTES = {2: 4 << 20, 4: 1 << 20, 8: 512 << 10}
ONE_SHOT_DTYPES = (torch.bfloat16, torch.float32)  # what the symmetric-memory kernel reduces


def all_reduce_path(nbytes: int, world_size: int, device_type: str, one_shot_ready: bool,
                    dtype: torch.dtype = torch.bfloat16) -> str:
    """THE all-reduce rule: "gloo" (CPU), "one_shot" (symmetric memory) or "nccl"."""
    if device_type != "cuda":
        return "gloo"
    if one_shot_ready and dtype in ONE_SHOT_DTYPES and nbytes <= ONE_SHOT_MAX_BYTES.get(world_size, 0) \
            and nbytes % 16 == 0:
        return "one_shot"
    return "nccl"


class OneShotAllReduce:
    """The symmetric-memory one-shot all-reduce over the world group: one buffer of max_bytes per rank,
    allocated and exchanged (rendezvous) once. Raises at construction if this torch build or machine
    cannot do it (the communicator then uses NCCL for every size)."""

    def __init__(self, device: torch.device, dtype: torch.dtype, max_bytes: int):
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = dist.group.WORLD.group_name
        self.dtype = dtype
        self.max_bytes = max_bytes
        self.buffer = symm_mem.empty(max_bytes // dtype.itemsize, dtype=dtype, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, self.group_name)
        if getattr(self.handle, "multicast_ptr", 0):
            log.info("symmetric memory offers multicast; it is not used (TORCH_SYMM_MEM_DISABLE_MULTICAST)")
        self._copy = getattr(torch.ops.symm_mem, "one_shot_all_reduce_copy", None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel()
        buf = self.buffer[:n]
        if self._copy is not None:  # one kernel: copy in, barrier, reduce
            return self._copy(buf, x.reshape(-1), "sum", self.group_name).view(x.shape)
        buf.copy_(x.reshape(-1))
        return torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", self.group_name).view(x.shape)


def _all_gather_into(out: torch.Tensor, x: torch.Tensor) -> None:
    fn = getattr(dist, "all_gather_single", None)
    if fn is not None:
        fn(out, x)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dist.all_gather_into_tensor(out, x)


class TPCommunicator:
    """The model's collectives over the world group (this process's tensor-parallel group)."""

    def __init__(self, rank: int, size: int, device: torch.device, one_shot: OneShotAllReduce | None = None):
        self.rank, self.size, self.device = rank, size, device
        self.one_shot = one_shot

    def path(self, x: torch.Tensor) -> str:
        return all_reduce_path(x.numel() * x.element_size(), self.size, x.device.type,
                               self.one_shot is not None and x.dtype == self.one_shot.dtype, x.dtype)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks (in place on gloo and NCCL; a new tensor one-shot). No host sync."""
        if self.path(x) == "one_shot":
            return self.one_shot(x)
        dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[size, *x.shape]: every rank's x, in rank order (the same bits on every rank)."""
        out = torch.empty((self.size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        _all_gather_into(out, x.contiguous())
        return out.view((self.size,) + tuple(x.shape))

    def min_int(self, value: int) -> int:
        """The smallest of every rank's value (start-up only: syncs)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def broadcast_int(self, value: int) -> int:
        """Rank 0's value (start-up only: syncs)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.broadcast(t, 0)
        return int(t.item())

    def describe(self) -> dict:
        return {"one_shot": self.one_shot is not None,
                "one_shot_max_bytes": ONE_SHOT_MAX_BYTES.get(self.size, 0) if self.one_shot is not None else 0}
