"""What the Locust processes write for the report: raw client events and the step log.

Locust's own CSV percentiles are bucketed (2 significant digits), so every Locust process also
appends exact per-event rows to `events-<pid>.csv` in the output directory, and the step shape
appends one JSON line per step transition to `steps.jsonl`. The report reads both back (the events
through loadtest.event_table) and joins them by wall-clock time (`time.time()`), which is also the
clock of the server's step records.

Event kinds (`value` unit in brackets), per token (see timing_rows):
  ttft [ms]     request start -> the chunk carrying the first token; `t` is that chunk's arrival
  itl [ms]      one per token after the first: a chunk of k tokens after a gap g gives k of g / k
                (tokens that came with the first give 0); `t` is the chunk's arrival
  chunk_itl [ms] one gap between two consecutive token chunks
  tpot [ms]     (latency - ttft) / (output tokens - 1); `t` is the last chunk's arrival
  e2e [ms]      request start -> last token chunk; `t` as for tpot
  tokens [n]    output tokens of the request (usage.completion_tokens, else the chunk count)
  chunks [n]    token chunks the request streamed (tokens / chunks converts chunk rate to tokens/s)
  stall [ms]    no token for the stall timeout: time since the last chunk (or the start); `t` = when given up
  error [0]     the request failed otherwise (HTTP status, connection, error event in the stream)
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

EVENT_FIELDS = ("t", "step", "kind", "value")
# Text prompts (the load test's default): words the demo tokenizer (trained on
# cluster/model/demo_corpus.txt) and any real one encode as about one token each.
PROMPT_WORDS = ("the", "sea", "a", "ship", "light", "on", "of", "wind", "and", "was", "in", "it", "to", "he",
                "that", "with", "night", "water", "came", "over")
EVENT_KINDS = ("ttft", "itl", "chunk_itl", "tpot", "e2e", "tokens", "chunks", "stall", "error")
STEPS_FILE = "steps.jsonl"
EVENTS_GLOB = "events-*.csv"


@dataclass(frozen=True)
class Event:
    t: float
    step: int
    kind: str
    value: float


class EventWriter:
    """Appends rows to one CSV per process; flushed once per request, never inside a stream."""

    def __init__(self, path: Path):
        new = not path.exists()
        self._f = open(path, "a", newline="", buffering=1 << 16)
        self._w = csv.writer(self._f)
        if new:
            self._w.writerow(EVENT_FIELDS)

    def write(self, rows: Iterable[tuple[float, int, str, float]]) -> None:
        self._w.writerows((f"{t:.6f}", step, kind, f"{value:.4f}") for t, step, kind, value in rows)
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def token_chunks(chunks: list[tuple[float, bytes]]) -> tuple[list[tuple[float, int]], int | None, str | None]:
    """SSE data lines (arrival, b"data: {...}") of one stream -> (arrival, tokens) of the chunks that
    carry tokens, the last completion_tokens seen, the stream's error message (or None).

    With `stream_options.continuous_usage_stats` a chunk's tokens are the growth of its
    usage.completion_tokens; without, a chunk with text or without finish_reason counts one token
    (pdserve sends an event for every token, even when the detokenizer holds its text back)."""
    out: list[tuple[float, int]] = []
    completion_tokens = None
    for t, line in chunks:
        d = json.loads(line[5:])
        if "error" in d:
            err = d["error"]
            return out, completion_tokens, err.get("message", str(err)) if isinstance(err, dict) else str(err)
        choices = d.get("choices")
        usage = d.get("usage")
        counted = usage is not None and usage.get("completion_tokens") is not None
        if choices:
            c = choices[0]
            if counted:
                n = usage["completion_tokens"] - (completion_tokens or 0)
            else:
                n = 1 if c.get("text") or c.get("finish_reason") is None else 0  # a finish-only chunk: none
            if n > 0:
                out.append((t, n))
        if counted:
            completion_tokens = usage["completion_tokens"]
    return out, completion_tokens, None


def timing_rows(carried: list[tuple[float, int]], step: int, t_wall0: float, t0: float
                ) -> list[tuple[float, int, str, float]]:
    """Per-token event rows of one stream from its (perf_counter arrival, tokens) chunks: ttft, one
    itl per later token, one chunk_itl per gap between chunks; `t` in wall time (t_wall0 ~ t0)."""
    rows: list[tuple[float, int, str, float]] = []
    if not carried:
        return rows
    first, k = carried[0]
    at = t_wall0 + first - t0
    rows.append((at, step, "ttft", (first - t0) * 1000))
    rows += [(at, step, "itl", 0.0)] * (k - 1)  # tokens that came with the first one
    for (a, _), (b, k) in zip(carried, carried[1:]):
        gap = (b - a) * 1000
        at = t_wall0 + b - t0
        rows.append((at, step, "chunk_itl", gap))
        rows += [(at, step, "itl", gap / k)] * k
    return rows


def append_step_log(out_dir: Path, record: dict) -> None:
    with open(Path(out_dir) / STEPS_FILE, "a") as f:
        f.write(json.dumps(record) + "\n")


def read_step_log(out_dir: Path) -> list[dict]:
    path = Path(out_dir) / STEPS_FILE
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


@dataclass(frozen=True)
class StepWindow:
    """One concurrency step: [start, end) in wall-clock seconds; the steady state is [steady_start, end)."""

    index: int
    users: int
    start: float
    ready: float  # when Locust reported all `users` running (start if never logged)
    end: float
    steady_start: float

    @property
    def steady_s(self) -> float:
        return max(0.0, self.end - self.steady_start)


def step_windows(log: list[dict], warmup_s: float, now: float | None = None) -> list[StepWindow]:
    """Step log lines -> windows. A step ends where the next one starts, or at the final `end` line
    (or `now`, for a step still running). Steps whose steady state is empty are still returned."""
    starts: dict[int, dict] = {}
    ready: dict[int, float] = {}
    final_end = None
    for rec in log:
        ev = rec.get("event")
        if ev == "start":
            starts[int(rec["step"])] = rec
        elif ev == "ready":
            ready.setdefault(int(rec["step"]), float(rec["t"]))
        elif ev == "end":
            final_end = float(rec["t"])
    order = sorted(starts)
    windows = []
    for i, idx in enumerate(order):
        start = float(starts[idx]["t"])
        if i + 1 < len(order):
            end = float(starts[order[i + 1]]["t"])
        elif final_end is not None:
            end = final_end
        elif now is not None:
            end = now
        else:
            continue
        r = min(max(ready.get(idx, start), start), end)
        windows.append(StepWindow(idx, int(starts[idx]["users"]), start, r, end, min(end, r + warmup_s)))
    return windows
