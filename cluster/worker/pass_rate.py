"""PassRateMeter: what one pass of a worker costs, measured while it serves.

A pass (a packed prefill, a local-prefill chunk, a decode step) costs about
`overhead_s + units * unit_s` seconds, where the units are the tokens it computed (prefill) or
the rows it stepped (decode). The meter fits that line by least squares over the passes it was
shown, older passes weighing less (exponential forgetting, `half_life` passes), so the fit follows
a worker whose speed changes (batch mix, clocks, a neighbour on the same GPU) without jumping at
every sample. Workers report the fit in their stats (`PassRate`); the router's cost model and the
P:D planner read it. Warm-up passes of many sizes seed it before the worker serves.

`DevicePassTimer` times passes on a CUDA device without a host sync: it records events around the
pass and feeds the meter later, once the end event has completed (on CPU it uses the wall clock).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class PassRate:
    """Fitted cost of one pass: seconds = overhead_s + units * unit_s."""

    overhead_s: float
    unit_s: float  # seconds per token (prefill) or per row (decode step)
    samples: int  # passes the fit has seen (0: nothing measured yet)

    def seconds(self, units: float) -> float:
        return self.overhead_s + units * self.unit_s

    @property
    def units_per_s(self) -> float:
        return 1.0 / self.unit_s if self.unit_s > 0 else math.inf


class PassRateMeter:
    """Weighted least-squares line through (units, seconds) of recent passes. Thread-safe."""

    def __init__(self, half_life: float = 256.0):
        self._decay = 0.5 ** (1.0 / half_life)
        self._lock = threading.Lock()
        self._w = self._n = self._t = self._nn = self._nt = 0.0
        self.samples = 0

    def add(self, units: float, seconds: float) -> None:
        if units <= 0 or seconds <= 0 or not math.isfinite(seconds):
            return
        d = self._decay
        with self._lock:
            self._w = self._w * d + 1.0
            self._n = self._n * d + units
            self._t = self._t * d + seconds
            self._nn = self._nn * d + units * units
            self._nt = self._nt * d + units * seconds
            self.samples += 1

    def rate(self) -> PassRate | None:
        """The fit, or None before the first pass."""
        with self._lock:
            if self.samples == 0:
                return None
            w, n, t, nn, nt = self._w, self._n, self._t, self._nn, self._nt
        mean_n, mean_t = n / w, t / w
        var = nn / w - mean_n * mean_n
        if var > 1e-9 * max(1.0, mean_n * mean_n):
            slope = (nt / w - mean_n * mean_t) / var
            intercept = mean_t - slope * mean_n
            if slope > 0 and intercept >= 0:
                return PassRate(intercept, slope, self.samples)
            if slope > 0:  # a negative overhead is noise: refit through the origin
                return PassRate(0.0, nt / nn, self.samples)
        # Every pass had (about) the same size, or time did not grow with size: all of it per unit
        # is an overestimate for larger passes only by the overhead, which it then includes.
        return PassRate(0.0, mean_t / mean_n, self.samples)


class DevicePassTimer:
    """Times passes into a PassRateMeter. On CUDA: events recorded on the current stream around
    the pass, read back only once completed (`harvest`, called at the next pass or stats read), so
    timing never waits on the device. On CPU: wall clock (the pass ran synchronously)."""

    def __init__(self, meter: PassRateMeter, device):
        import torch

        self.meter = meter
        self.cuda = torch.device(device).type == "cuda"
        self._pending: deque = deque()
        self._lock = threading.Lock()

    def start(self):
        if self.cuda:
            import torch

            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def stop(self, start, units: int):
        """Ends the pass begun at `start`; returns its end mark, for `seconds(start, end)`."""
        if not self.cuda:
            end = time.perf_counter()
            self.meter.add(units, end - start)
            return end
        import torch

        end = torch.cuda.Event(enable_timing=True)
        end.record()
        with self._lock:
            self._pending.append((start, end, units))
        self.harvest()
        return end

    def seconds(self, start, end) -> float:
        """The pass's device time. NOTE: on CUDA it waits for the pass's end event: call it once the
        host has synced past the pass anyway (after reading its sampled tokens), never in a hot path."""
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def harvest(self) -> None:
        """Feeds the meter with every timed pass that has completed on the device."""
        with self._lock:
            while self._pending and self._pending[0][1].query():
                start, end, units = self._pending.popleft()
                self.meter.add(units, start.elapsed_time(end) / 1e3)
