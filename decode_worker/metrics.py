"""Per-step decode metrics, kept as counters and fixed-bucket histograms (Prometheus-shaped), so the
gateway's /metrics can export them without knowing how the worker runs."""

from __future__ import annotations

import bisect
import threading
from collections import Counter, deque
from dataclasses import asdict, dataclass

STEP_TIME_BUCKETS_S = (0.0005, 0.001, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 1.0)
HOST_TIME_BUCKETS_S = (0.00002, 0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 512)


class Histogram:
    """Cumulative-free histogram: counts[i] = observations <= bounds[i] and > bounds[i-1]; last = +Inf."""

    def __init__(self, bounds):
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, x: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, x)] += 1
        self.sum += x
        self.count += 1

    def to_dict(self) -> dict:
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.sum, "count": self.count}


@dataclass(frozen=True)
class StepRecord:
    step: int
    batch_size: int
    bucket: int  # rows computed, padding included
    padded_rows: int
    graph: bool
    step_time_s: float  # device time of the step (events around copies + replay), CPU: wall time
    host_time_s: float  # schedule + prepare + process outputs + publish, on the loop thread


class StepMetrics:
    def __init__(self, recent: int = 256):
        self._lock = threading.Lock()
        self.steps = 0
        self.graph_steps = 0
        self.eager_steps = 0
        self.rows = 0
        self.padded_rows = 0
        self.bucket_steps: Counter[int] = Counter()
        self.step_time = Histogram(STEP_TIME_BUCKETS_S)
        self.host_time = Histogram(HOST_TIME_BUCKETS_S)
        self.batch_size = Histogram(BATCH_SIZE_BUCKETS)
        self.recent: deque[StepRecord] = deque(maxlen=recent)

    def record(self, r: StepRecord) -> None:
        with self._lock:
            self.steps += 1
            if r.graph:
                self.graph_steps += 1
            else:
                self.eager_steps += 1
            self.rows += r.batch_size
            self.padded_rows += r.padded_rows
            self.bucket_steps[r.bucket] += 1
            self.step_time.observe(r.step_time_s)
            self.host_time.observe(r.host_time_s)
            self.batch_size.observe(r.batch_size)
            self.recent.append(r)

    def snapshot(self) -> dict:
        with self._lock:
            computed = self.rows + self.padded_rows
            return {
                "steps_total": self.steps,
                "graph_steps_total": self.graph_steps,
                "eager_steps_total": self.eager_steps,
                "rows_total": self.rows,
                "padded_rows_total": self.padded_rows,
                "padding_fraction": self.padded_rows / computed if computed else 0.0,
                "bucket_steps": dict(self.bucket_steps),
                "step_time_seconds": self.step_time.to_dict(),
                "host_time_seconds": self.host_time.to_dict(),
                "batch_size": self.batch_size.to_dict(),
                "recent": [asdict(r) for r in self.recent],
            }
