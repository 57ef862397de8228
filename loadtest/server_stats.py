"""Server-side truth: the decode workers' own step records, polled from the gateway while Locust runs.

Primary source, `GET /stats?cursor=C`:

    {"decode_steps": [{"worker_id": str, "t": unix_time_float, "batch_size": int, "bucket": int,
                       "padded_rows": int, "step_ms": float, "graph": bool, "interval_ms": float | null,
                       "prefill_ms", "idle_ms", "gap_ms", "host_ms", "publish_lag_ms": float}, ...],
     "requests": [...], "cursor": int, "missed": int, "now": unix_time_float}

the step records since cursor C (at most a bounded number per answer; the next poll asks from the
returned `cursor`, so every record arrives exactly once). The router builds the answer in its own
process, so a poll costs the gateway that forwards it a frame in and a frame out, not a pass over
its records. `missed` counts records the server dropped before this poller got them. If `/stats` is missing, the
fallback scrapes the Prometheus histograms `pdserve:decode_batch_size`, `pdserve:decode_step_seconds`
and `pdserve:graph_padding_ratio` from `/metrics` and differences their `_sum`/`_count` over each
step's steady window (means only: no bucket, no percentiles). With neither, the server columns of
the report are null.
"""

from __future__ import annotations

import json
import re
import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

METRIC_HISTOGRAMS = ("pdserve:decode_batch_size", "pdserve:decode_step_seconds", "pdserve:graph_padding_ratio")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfINFNa]+)")


@dataclass(frozen=True)
class StepRecord:
    worker_id: str
    t: float
    batch_size: int
    bucket: int
    padded_rows: int
    step_ms: float
    graph: bool
    # The interval since the previous step and what filled it (cluster.wire.messages.StepTiming); None /
    # 0 from a server that does not report them.
    interval_ms: float | None = None
    prefill_ms: float = 0.0
    idle_ms: float = 0.0
    gap_ms: float = 0.0
    host_ms: float = 0.0
    publish_lag_ms: float = 0.0

    @classmethod
    def from_json(cls, d: dict) -> "StepRecord":
        iv = d.get("interval_ms")
        return cls(str(d["worker_id"]), float(d["t"]), int(d["batch_size"]), int(d.get("bucket") or 0),
                   int(d.get("padded_rows") or 0), float(d["step_ms"]), bool(d.get("graph", False)),
                   None if iv is None else float(iv), float(d.get("prefill_ms") or 0.0), float(d.get("idle_ms") or 0.0),
                   float(d.get("gap_ms") or 0.0), float(d.get("host_ms") or 0.0), float(d.get("publish_lag_ms") or 0.0))


@dataclass(frozen=True)
class RequestRecord:
    """One finished request as the server timed it (`/stats` "requests": from the gateway's HTTP app
    getting it to its first token's event written, the router's placement, the prefill worker's timings)."""

    t_first: float  # unix time of the end of its TTFT (its first event written; not streamed: its first token at the gateway)
    ttft_ms: float
    e2e_ms: float
    output_tokens: int
    local_prefill: bool
    # The TTFT's consecutive parts (router.stats.step_stats.TTFTPoints: admission, placement, dispatch,
    # prefill_queue, forward, sample, delivery; or admission, placement, local_prefill; over HTTP
    # with `intake` first, and streamed with `write` last), in ms
    parts_ms: dict[str, float] | None = None
    forward_device_ms: float | None = None  # the prompt's completing prefill pass: device time
    forward_host_ms: float | None = None  # ... and its host wall time

    @classmethod
    def from_json(cls, d: dict) -> "RequestRecord | None":
        if d.get("ttft_ms") is None:
            return None  # never got a token
        finished, e2e, ttft = float(d["t"]), float(d["e2e_ms"]), float(d["ttft_ms"])
        return cls(finished - (e2e - ttft) / 1e3, ttft, e2e, int(d.get("output_tokens") or 0),
                   bool(d.get("local_prefill")), d.get("ttft_parts_ms"), d.get("forward_device_ms"),
                   d.get("forward_host_ms"))


def summarize_requests(recs: list[RequestRecord]) -> dict:
    """The server's own TTFT over the requests whose first token fell in a window, and its parts."""
    out = {"server_requests": len(recs), "server_ttft_p50_ms": None, "server_ttft_p99_ms": None,
           "server_ttft_parts_p50_ms": None}
    if recs:
        ttft = [r.ttft_ms for r in recs]
        out.update(server_ttft_p50_ms=round(statistics.median(ttft), 3), server_ttft_p99_ms=round(_percentile(ttft, 99), 3))
        # Per part, the median over the requests that have it (in the timeline's order), and the
        # completing prefill pass's device and host time.
        by_part: dict[str, list[float]] = {}
        for r in recs:
            for k, v in (r.parts_ms or {}).items():
                by_part.setdefault(k, []).append(v)
        out["server_ttft_parts_p50_ms"] = {k: round(statistics.median(v), 3) for k, v in by_part.items()} or None
        for k in ("forward_device_ms", "forward_host_ms"):
            vals = [getattr(r, k) for r in recs if getattr(r, k) is not None]
            out[f"server_{k[:-3]}_p50_ms"] = round(statistics.median(vals), 3) if vals else None
        out["server_local_prefill_fraction"] = round(sum(r.local_prefill for r in recs) / len(recs), 3)
    return out


def parse_histogram_totals(text: str, names=METRIC_HISTOGRAMS) -> dict[str, tuple[float, float]]:
    """{histogram: (sum, count)} over all label sets, from Prometheus text exposition."""
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        metric, value = m.group(1), m.group(3)
        for name in names:
            if metric == name + "_sum":
                sums[name] = sums.get(name, 0.0) + float(value)
            elif metric == name + "_count":
                counts[name] = counts.get(name, 0.0) + float(value)
    return {n: (sums[n], counts[n]) for n in names if n in sums and n in counts}


def parse_counter_totals(text: str, names, label: str | None = None) -> dict[str, float]:
    """{metric: value summed over its label sets}, from Prometheus text exposition (counters carry
    their `_total` suffix in `names`); with `label` (e.g. 'role="prefill"'), only the label sets
    that contain it."""
    out: dict[str, float] = {}
    wanted = set(names)
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) in wanted and (label is None or label in (m.group(2) or "")):
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


@dataclass
class ServerStatsPoller:
    """Polls /stats (or /metrics) on a thread; `records` and `snapshots` grow while it runs."""

    base_url: str
    interval_s: float = 0.5
    headers: dict = field(default_factory=dict)
    raw_path: Path | None = None  # every new /stats record is appended here as JSON
    source: str | None = None  # "stats" | "metrics" | None (undecided or neither)
    records: list[StepRecord] = field(default_factory=list)
    requests: list[RequestRecord] = field(default_factory=list)
    snapshots: list[tuple[float, dict[str, tuple[float, float]]]] = field(default_factory=list)
    gaps: int = 0  # polls that found records dropped before this poller read them

    def __post_init__(self):
        self._cursor = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> "ServerStatsPoller":
        self._client = httpx.Client(base_url=self.base_url, headers=self.headers, timeout=5.0)
        self.source = self._detect()
        self._thread = threading.Thread(target=self._run, name="server-stats", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        try:
            self.poll_once()  # the last records of the final step
        except httpx.HTTPError:
            pass
        self._client.close()

    def _detect(self) -> str | None:
        try:
            r = self._client.get("/stats", params={"limit": 1})
            body = r.json() if r.status_code == 200 else {}
            if isinstance(body.get("decode_steps"), list) and isinstance(body.get("cursor"), int):
                self._cursor = body["cursor"] - len(body["decode_steps"]) - len(body.get("requests", []))
                return "stats"
        except (httpx.HTTPError, ValueError, AttributeError):
            pass
        try:
            r = self._client.get("/metrics")
            if r.status_code == 200 and "pdserve:decode_batch_size" in r.text:
                return "metrics"
        except httpx.HTTPError:
            pass
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll_once()
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                continue  # a busy gateway may miss a poll; the next one catches up

    def poll_once(self) -> None:
        if self.source == "stats":
            while True:  # a full answer means more are waiting
                body = self._client.get("/stats", params={"cursor": self._cursor}).json()
                self._cursor = body["cursor"]
                self.gaps += body.get("missed", 0) > 0
                self._add([StepRecord.from_json(d) for d in body.get("decode_steps", [])],
                          [r for r in map(RequestRecord.from_json, body.get("requests", [])) if r is not None])
                if not body.get("more"):
                    break
        elif self.source == "metrics":
            text = self._client.get("/metrics").text
            with self._lock:
                self.snapshots.append((time.time(), parse_histogram_totals(text)))

    def _add(self, fresh: list[StepRecord], requests: list[RequestRecord] = ()) -> None:
        with self._lock:
            self.records.extend(fresh)
            self.requests.extend(requests)
        if (fresh or requests) and self.raw_path is not None:
            with open(self.raw_path, "a") as f:
                for r in fresh:
                    f.write(json.dumps(r.__dict__) + "\n")
                for r in requests:
                    f.write(json.dumps({"request": r.__dict__}) + "\n")

    def summarize(self, t0: float, t1: float) -> dict:
        """The server columns of one report row, over [t0, t1)."""
        with self._lock:
            if self.source == "stats":
                return {**summarize_records([r for r in self.records if t0 <= r.t < t1]),
                        **summarize_requests([r for r in self.requests if t0 <= r.t_first < t1])}
            if self.source == "metrics":
                return summarize_snapshots(self.snapshots, t0, t1)
        return empty_summary(None)


INTERVAL_PARTS = ("prefill", "idle", "gap")  # interval = previous step + these (cluster.wire.messages.StepTiming)


def empty_summary(source: str | None) -> dict:
    return {"server_source": source, "server_steps": 0, "server_workers": None, "server_batch_size": None,
            "server_batch_size_mean": None, "server_bucket": None, "server_padded_rows": None,
            "server_padding_ratio": None, "server_step_ms": None, "server_step_p90_ms": None,
            "server_step_mean_ms": None, "server_graph_fraction": None, "server_interval_ms": None,
            "server_interval_p90_ms": None, "server_interval_mean_ms": None,
            "server_interval_parts_ms": None, "server_host_ms": None, "server_publish_lag_ms": None,
            "server_publish_lag_p90_ms": None, "server_rows_per_s": None}


def _percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize_records(recs: list[StepRecord]) -> dict:
    out = empty_summary("stats")
    # Idle steps (batch 0) are no decode work; drop them if a worker reports any.
    recs = [r for r in recs if r.batch_size > 0]
    if not recs:
        return out
    bs = [r.batch_size for r in recs]
    out.update(
        server_steps=len(recs),
        server_workers=len({r.worker_id for r in recs}),
        server_batch_size=statistics.median(bs),
        server_batch_size_mean=round(statistics.fmean(bs), 3),
        server_bucket=Counter(r.bucket for r in recs).most_common(1)[0][0],
        server_padded_rows=statistics.median(r.padded_rows for r in recs),
        server_padding_ratio=round(statistics.fmean(r.padded_rows / r.bucket if r.bucket else 0.0 for r in recs), 4),
        server_step_ms=round(statistics.median(r.step_ms for r in recs), 4),
        server_step_p90_ms=round(_percentile([r.step_ms for r in recs], 90), 4),
        server_graph_fraction=round(sum(r.graph for r in recs) / len(recs), 4),
        server_step_mean_ms=round(statistics.fmean(r.step_ms for r in recs), 4),
    )
    # Rows the steps computed per second of step time: what the window could deliver at most.
    step_s = sum(r.step_ms for r in recs) / 1e3
    out["server_rows_per_s"] = round(sum(bs) / step_s, 2) if step_s > 0 else None
    timed = [r for r in recs if r.interval_ms is not None]
    if timed:
        iv = [r.interval_ms for r in timed]
        out.update(
            server_interval_ms=round(statistics.median(iv), 4),
            server_interval_p90_ms=round(_percentile(iv, 90), 4),
            server_interval_mean_ms=round(statistics.fmean(iv), 4),
            # Means, which add up: mean interval = mean previous step + these (medians of the parts
            # would be 0 for a part that fills a few intervals a lot, local prefill chunks say).
            server_interval_parts_ms={
                "step": round(statistics.fmean(r.step_ms for r in timed), 4),
                **{k: round(statistics.fmean(getattr(r, f"{k}_ms") for r in timed), 4) for k in INTERVAL_PARTS}},
            server_host_ms=round(statistics.median(r.host_ms for r in timed), 4),
        )
    lag = [r.publish_lag_ms for r in recs]
    out.update(server_publish_lag_ms=round(statistics.median(lag), 4), server_publish_lag_p90_ms=round(_percentile(lag, 90), 4))
    return out


def summarize_snapshots(snaps: list[tuple[float, dict]], t0: float, t1: float) -> dict:
    out = empty_summary("metrics")
    inside = [s for s in snaps if t0 <= s[0] <= t1]
    if len(inside) < 2:
        return out
    (_, a), (_, b) = inside[0], inside[-1]

    def mean(name: str) -> tuple[float | None, float]:
        if name not in a or name not in b:
            return None, 0.0
        ds, dc = b[name][0] - a[name][0], b[name][1] - a[name][1]
        return (ds / dc if dc > 0 else None), dc

    bs, n = mean("pdserve:decode_batch_size")
    step_s, _ = mean("pdserve:decode_step_seconds")
    ratio, _ = mean("pdserve:graph_padding_ratio")
    out.update(server_steps=int(n), server_batch_size_mean=None if bs is None else round(bs, 3),
               server_batch_size=None if bs is None else round(bs, 3),
               server_step_ms=None if step_s is None else round(step_s * 1000, 4),
               server_padding_ratio=None if ratio is None else round(ratio, 4))
    if bs is not None and ratio is not None and ratio < 1:
        # Exact when the batch is steady: padded / (batch + padded) = ratio.
        out["server_padded_rows"] = round(bs * ratio / (1 - ratio), 3)
        out["server_bucket"] = round(bs / (1 - ratio), 3)
    return out
