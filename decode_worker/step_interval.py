"""StepIntervalClock: what the decode loop did between two decode-step launches, so that every step's
record says where its interval went (cluster.wire.messages.StepTiming, carried to `GET /stats`).

The loop tells the clock what it does besides launching steps: local-prefill passes (timed on the
device, with events on the stream, as the step itself is), naps with nothing to do, and waits for a
step's tokens. At each launch the clock closes the span since the previous launch and hands it to
the launched step; once that step's tokens are read (its device times are known), `timing()` turns
the span into the step's StepTiming:

    interval (this step's start - the previous step's start, device clock)
        = previous step's duration + prefill passes + idle (naps) + gap (the device waiting for the host)

On CPU everything runs synchronously and the same split is made with the wall clock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from cluster.wire.messages import StepTiming


@dataclass
class LaunchSpan:
    """What happened on the loop between the previous launch and this one."""

    prefill: list = field(default_factory=list)  # CUDA: (start, end) event pairs; CPU: seconds each
    idle_s: float = 0.0
    host_s: float = 0.0


class StepIntervalClock:
    def __init__(self, cuda: bool):
        self.cuda = cuda
        self._span = LaunchSpan()
        self._since = time.perf_counter()  # the previous launch
        self._excluded = 0.0  # waits, naps and prefill passes since then (not the loop's own work)
        self._prev_step_s: float | None = None

    # -- what the loop reports --------------------------------------------------------------------
    def prefill_start(self):
        if self.cuda:
            import torch

            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev, time.perf_counter()
        return None, time.perf_counter()

    def prefill_end(self, start) -> None:
        ev, t0 = start
        wall = time.perf_counter() - t0
        self._excluded += wall
        if self.cuda:
            import torch

            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._span.prefill.append((ev, end))
        else:
            self._span.prefill.append(wall)

    def idle(self, seconds: float) -> None:
        self._span.idle_s += seconds
        self._excluded += seconds

    def waited(self, seconds: float) -> None:
        """Blocked on the device (a step's tokens): its time is the step's, not the loop's."""
        self._excluded += seconds

    def launched(self, ran_s: float = 0.0) -> LaunchSpan:
        """A step was just launched: the span since the previous launch is that step's. `ran_s`: the
        step itself ran inside the launch (CPU: synchronously), not the loop's own work."""
        now = time.perf_counter()
        span, self._span = self._span, LaunchSpan()
        span.host_s = max(0.0, now - self._since - self._excluded - ran_s)
        self._since, self._excluded = now, 0.0
        return span

    # -- the record -------------------------------------------------------------------------------
    def timing(self, span: LaunchSpan, step_s: float, interval_s: float | None) -> StepTiming | None:
        """A step's timing once its tokens were read (steps are read in launch order). None for the
        first step, which has no interval."""
        prev, self._prev_step_s = self._prev_step_s, step_s
        if interval_s is None or prev is None:
            return None
        if self.cuda:  # every pass in the span ran before this step on the stream: done by now
            prefill = sum(a.elapsed_time(b) for a, b in span.prefill) / 1e3
        else:
            prefill = sum(span.prefill)
        gap = max(0.0, interval_s - prev - prefill - span.idle_s)
        return StepTiming(interval_s, prefill, span.idle_s, gap, span.host_s)
