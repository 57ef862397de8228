"""StepHandle: one decode step the BucketedGraphRunner launched, read without waiting for later ones.

The runner's launch() returns at once on CUDA; the handle waits for that step's CUDA event only
(`tokens()`), then reads the step's sampled tokens (and, for a features step, its logprobs) from the
runner's pinned host buffers (`HostStepOutputs`, all a handle holds of the runner). Those have two slots, so step t+1's output copy cannot overwrite step t's
unread tokens; a handle's slot is valid until the launch after next. StepInfo records what the step
was (its rows, bucket, variant) and what the host spent on it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class StepInfo:
    batch_size: int
    bucket: int  # rows computed (padded); equals batch_size for an unpadded eager batch
    graph: bool
    features: bool  # the features variant ran (processing, state update, logprobs)
    host_prepare_s: float  # filling the staging buffer and queueing its copy
    launch_s: float = 0.0  # graph.replay() (or the eager forward's dispatch) on the host
    constrained: int = 0  # rows under a grammar mask


@dataclass(frozen=True)
class HostStepOutputs:
    """The pinned host buffers a step's outputs are copied into, two slots each ([2, max_batch, ...]):
    the sampled tokens and, for a features step, the logprob, top ids and top logprobs (NumPy views of
    the pinned tensors, so a handle returns rows without a copy)."""

    tokens: torch.Tensor  # int64 [2, max_batch]
    logprob: np.ndarray  # float32 [2, max_batch]
    top_ids: np.ndarray  # int64 [2, max_batch, MAX_LOGPROBS]
    top_logprobs: np.ndarray  # float32 [2, max_batch, MAX_LOGPROBS]


class StepHandle:
    """One launched step: `tokens()` waits for its sampled tokens (only this step's, not later ones).

    After tokens(): `gpu_time_s`, the step on the device (its input copy, the replay, its output
    copies; on CPU the wall time of the synchronous step), and `interval_s`, from the previous step's
    start to this one's on the device (None for the first step)."""

    def __init__(self, host: HostStepOutputs, slot: int, info: StepInfo, start_ev, end_ev, prev_start):
        self._host, self.slot, self.info = host, slot, info
        self._start_ev, self._end_ev, self._prev_start = start_ev, end_ev, prev_start
        self._tokens: list[int] | None = None
        self.gpu_time_s = 0.0
        self.interval_s: float | None = None
        self.wait_s = 0.0  # how long tokens() blocked the caller
        self.ran_in_launch_s = 0.0  # the step computed synchronously inside launch() (CPU), not the caller's work

    def ready(self) -> bool:
        return self._end_ev is None or self._end_ev.query()

    def tokens(self) -> list[int]:
        if self._tokens is None:
            if self._end_ev is not None:
                t0 = time.perf_counter()
                self._end_ev.synchronize()  # waits for this step only; later steps keep running
                self.wait_s = time.perf_counter() - t0
                self.gpu_time_s = self._start_ev.elapsed_time(self._end_ev) / 1e3
                if self._prev_start is not None:
                    try:  # both are done (the previous step's start came first on the stream)
                        self.interval_s = self._prev_start.elapsed_time(self._start_ev) / 1e3
                    except RuntimeError:  # recorded again by a later launch (a caller kept > 2 steps unread)
                        self.interval_s = None
            self._tokens = self._host.tokens[self.slot, : self.info.batch_size].tolist()
        return self._tokens

    def logprobs(self):
        """(logprob [n], top ids [n, MAX_LOGPROBS], top logprobs [n, MAX_LOGPROBS]) as NumPy views of
        the pinned host buffers for a features step (None for a plain one): valid until the next launch
        but one (the slot's reuse); the caller converts the rows it needs (a whole [n, 20] table as
        Python lists costs ~1 ms at 256 rows). Call after tokens()."""
        if not self.info.features:
            return None
        n, host = self.info.batch_size, self._host
        return (host.logprob[self.slot, :n], host.top_ids[self.slot, :n], host.top_logprobs[self.slot, :n])
