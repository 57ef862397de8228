"""The load-test report: one row per concurrency step, client percentiles next to the server's steps.

Client numbers come from the exact per-event CSVs (not Locust's bucketed percentiles), restricted to
each step's steady window (after its warm-up). Stalls and errors count over the whole step, warm-up
included: a hang is a hang whenever it happens.

Per token (loadtest/locustfile.py): TTFT is the request's start to its first token's chunk, ITL one
sample per token (a chunk of k tokens after a gap g counts k gaps of g / k; `chunk_itl_*` are the raw
gaps between chunks, aiperf's inter-chunk latency). Server side, per row: the median step duration
(`server_step_ms`) and the median interval between consecutive steps' starts (`server_interval_ms`),
with the mean parts that filled the intervals (`server_interval_parts_ms`: the previous step, local
prefill, idle, host gap) and the publisher's lag. Where the client's ITL and the server's interval,
or the interval and the step, differ by more than 10 %, the row's `explain` says which part.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from loadtest.event_table import EventTable
from loadtest.records import StepWindow

ROW_KEYS = ("batch_size", "itl_p50_ms", "itl_p90_ms", "itl_p99_ms", "ttft_p50_ms", "tpot_p50_ms",
            "server_step_ms", "server_bucket", "server_padded_rows", "tokens_per_s", "stalls", "requests")


def percentile(xs: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks, as numpy's default (and vLLM's benchmark) does."""
    return sorted_percentile(sorted(xs), q)


def sorted_percentile(s: Sequence[float] | np.ndarray, q: float) -> float | None:
    """`percentile` of values already in ascending order (a list or a numpy array), in Python floats:
    the same arithmetic whatever holds them."""
    if len(s) == 0:
        return None
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    a, b = float(s[lo]), float(s[hi])
    return a + (b - a) * (pos - lo)


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


def client_row(events: EventTable, w: StepWindow) -> dict:
    steady, whole = events.span(w.steady_start, w.end), events.span(w.start, w.end)
    itl, ttft, tpot, chunk_itl = (events.values(k, steady) for k in ("itl", "ttft", "tpot", "chunk_itl"))
    # Sum and max over Python floats in row order (Python's rounding, not numpy's pairwise sum): the
    # numbers the report has always given. Percentiles from one stable sort per kind.
    itl_list = itl.tolist()
    tokens, chunks = sum(events.values("tokens", steady).tolist()), sum(events.values("chunks", steady).tolist())
    itl, ttft, tpot, chunk_itl = (np.sort(x, kind="stable") for x in (itl, ttft, tpot, chunk_itl))
    if len(chunk_itl):
        # Per-token ITL samples (one per token after the first): the tokens that arrived in the window.
        arrived, per_chunk = len(itl) + len(ttft), 1.0
    else:
        # Older event files (one ITL sample per chunk): convert chunks to tokens with the tokens per
        # chunk of finished requests.
        per_chunk = tokens / chunks if chunks else 1.0
        arrived = len(itl) + len(ttft)
    return {
        "batch_size": w.users,
        "step": w.index,
        "steady_s": round(w.steady_s, 3),
        "itl_p50_ms": _r(sorted_percentile(itl, 50)),
        "itl_p90_ms": _r(sorted_percentile(itl, 90)),
        "itl_p99_ms": _r(sorted_percentile(itl, 99)),
        "itl_max_ms": _r(max(itl_list) if itl_list else None),
        "itl_mean_ms": _r(sum(itl_list) / len(itl_list) if itl_list else None),
        "chunk_itl_p50_ms": _r(sorted_percentile(chunk_itl, 50)),
        "chunk_itl_p99_ms": _r(sorted_percentile(chunk_itl, 99)),
        "tokens_per_chunk": _r(tokens / chunks if chunks else None),
        "ttft_p50_ms": _r(sorted_percentile(ttft, 50)),
        "ttft_p90_ms": _r(sorted_percentile(ttft, 90)),
        "ttft_p99_ms": _r(sorted_percentile(ttft, 99)),
        "tpot_p50_ms": _r(sorted_percentile(tpot, 50)),
        "tpot_p99_ms": _r(sorted_percentile(tpot, 99)),
        "tokens_per_s": _r(arrived * per_chunk / w.steady_s if w.steady_s > 0 else None, 2),
        "requests": events.count("e2e", steady),
        "itl_samples": len(itl),
        "stalls": events.count("stall", whole),
        "errors": events.count("error", whole),
    }


def _ratio(a, b) -> float | None:
    return _r(a / b, 4) if a and b else None


TOLERANCE = 0.10  # a client number and the server's counterpart agree within this


def explain(row: dict) -> list[str]:
    """Which part makes the client's ITL differ from the server's interval, or the interval from the
    step, by more than TOLERANCE (empty when they agree or the data is missing)."""
    out = []
    iv, step, itl = row.get("server_interval_ms"), row.get("server_step_ms"), row.get("itl_p50_ms")
    parts = row.get("server_interval_parts_ms") or {}
    if iv and step and iv > step * (1 + TOLERANCE):
        extra = {k: v for k, v in parts.items() if k != "step"}
        if extra:
            k, v = max(extra.items(), key=lambda kv: kv[1])
            out.append(f"interval {iv:.2f} ms > step {step:.2f} ms: mostly {k} ({v:.2f} ms a step on average; "
                       + ", ".join(f"{a} {b:.2f}" for a, b in extra.items()) + ")")
    if itl and iv and abs(itl / iv - 1) > TOLERANCE:
        lag = row.get("server_publish_lag_ms") or 0.0
        if itl > iv:
            why = (f"the worker's publisher held tokens {lag:.2f} ms (median)" if lag > TOLERANCE * iv else
                   f"between the publisher and the client (gateway, network; publisher lag {lag:.2f} ms)")
            out.append(f"client ITL p50 {itl:.2f} ms > server interval {iv:.2f} ms: {why}")
        else:
            out.append(f"client ITL p50 {itl:.2f} ms < server interval {iv:.2f} ms: several tokens per chunk "
                       f"({row.get('tokens_per_chunk')}) or the server's window holds other work")
    return out


def build_rows(events: EventTable, windows: list[StepWindow], server: Callable[[float, float], dict]) -> list[dict]:
    rows = []
    for w in windows:
        row = client_row(events, w)
        row.update(server(w.steady_start, w.end))
        row["itl_p50_over_step"] = _ratio(row["itl_p50_ms"], row.get("server_step_ms"))
        row["itl_p50_over_interval"] = _ratio(row["itl_p50_ms"], row.get("server_interval_ms"))
        row["interval_over_step"] = _ratio(row.get("server_interval_ms"), row.get("server_step_ms"))
        # Delivered tokens against what the steps made (rows computed per second of step time).
        row["delivered_over_capacity"] = _ratio(row.get("tokens_per_s"), row.get("server_rows_per_s"))
        row["explain"] = explain(row)
        rows.append(row)
    return rows


def target_checks(rows: list[dict], capacity_at: int = 256) -> dict:
    """Issue 28's targets, each {value(s), target, met} (met None where the data is missing): client ITL
    p50 <= 1.10x the server step and the step interval <= 1.10x the step duration at every batch size;
    delivered tokens/s at `capacity_at` users >= 90 % of rows / step duration; and ITL p50 at batch
    64 at most twice that at batch 1."""
    def every(key: str, limit: float) -> dict:
        vals = {str(r["batch_size"]): r.get(key) for r in rows}
        known = [v for v in vals.values() if v is not None]
        met = None if not vals or len(known) < len(vals) else all(v <= limit for v in known)
        return {"per_batch": vals, "target": f"<= {limit:g} at every batch size", "met": met}

    by_bs = {r["batch_size"]: r for r in rows}
    b1, b64 = (by_bs.get(b, {}).get("itl_p50_ms") for b in (1, 64))
    cap = by_bs.get(capacity_at, {}).get("delivered_over_capacity")
    bs64 = round(b64 / b1, 3) if b1 and b64 else None
    return {
        "itl_p50_over_step": every("itl_p50_over_step", 1 + TOLERANCE),
        "interval_over_step": every("interval_over_step", 1 + TOLERANCE),
        f"delivered_over_capacity_at_{capacity_at}": {"value": cap, "target": ">= 0.9",
                                                       "met": None if cap is None else cap >= 0.9},
        "itl_bs64_over_bs1": {"value": bs64, "target": "<= 2", "met": None if bs64 is None else bs64 <= 2},
    }


def format_table(rows: list[dict]) -> str:
    cols = [("batch", "batch_size", "{:d}"), ("srv bs", "server_batch_size", "{:g}"), ("bucket", "server_bucket", "{:g}"),
            ("pad", "server_padded_rows", "{:g}"), ("step ms", "server_step_ms", "{:.2f}"),
            ("interval", "server_interval_ms", "{:.2f}"),
            ("ITL p50", "itl_p50_ms", "{:.2f}"), ("p90", "itl_p90_ms", "{:.2f}"), ("p99", "itl_p99_ms", "{:.2f}"),
            ("TPOT p50", "tpot_p50_ms", "{:.2f}"), ("TTFT p50", "ttft_p50_ms", "{:.1f}"),
            ("tok/s", "tokens_per_s", "{:.1f}"), ("reqs", "requests", "{:d}"), ("stalls", "stalls", "{:d}"),
            ("errors", "errors", "{:d}")]
    cells = [[h for h, _, _ in cols]]
    for row in rows:
        cells.append([("-" if row.get(k) is None else f.format(row[k])) for _, k, f in cols])
    widths = [max(len(r[i]) for r in cells) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(wd) for c, wd in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * wd for wd in widths))
    for row in rows:
        for why in row.get("explain") or ():
            lines.append(f"  batch {row['batch_size']}: {why}")
    return "\n".join(lines)


def progress_line(row: dict, n_steps: int) -> str:
    def f(k, fmt="{:.2f}"):
        return "-" if row.get(k) is None else fmt.format(row[k])
    srv = (f"server bs {f('server_batch_size', '{:g}')} bucket {f('server_bucket', '{:g}')} "
           f"step {f('server_step_ms')} ms interval {f('server_interval_ms')} ms") if row.get("server_source") \
        else "server: no stats"
    return (f"[step {row['step'] + 1}/{n_steps}] {row['batch_size']} users  steady {row['steady_s']:.1f}s  "
            f"ITL p50/p90/p99 {f('itl_p50_ms')}/{f('itl_p90_ms')}/{f('itl_p99_ms')} ms  "
            f"TTFT p50 {f('ttft_p50_ms', '{:.1f}')} ms  {f('tokens_per_s', '{:.1f}')} tok/s  {srv}  "
            f"reqs {row['requests']} stalls {row['stalls']} errors {row['errors']}")


def write_plot(rows: list[dict], path: Path, title: str = "") -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("itl_p50_ms") is not None]
    if not rows:
        return None
    bs = [r["batch_size"] for r in rows]
    fig, (ax, axp) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    ax.plot(bs, [r["itl_p50_ms"] for r in rows], "o-", label="client ITL p50")
    ax.fill_between(bs, [r["itl_p50_ms"] for r in rows], [r["itl_p99_ms"] for r in rows], alpha=0.2,
                    label="client ITL p50..p99")
    ax.plot(bs, [r["itl_p90_ms"] for r in rows], "--", color="C0", alpha=0.6, label="client ITL p90")
    srv = [(b, r["server_step_ms"]) for b, r in zip(bs, rows) if r.get("server_step_ms") is not None]
    if srv:
        ax.plot([b for b, _ in srv], [s for _, s in srv], "s-", color="C3", label="server step time (median)")
    ivs = [(b, r["server_interval_ms"]) for b, r in zip(bs, rows) if r.get("server_interval_ms") is not None]
    if ivs:
        ax.plot([b for b, _ in ivs], [s for _, s in ivs], "^--", color="C1", label="server step interval (median)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(bs, [str(b) for b in bs])
    ax.set_ylabel("ms")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title(title or "Inter-token latency per decode batch size")
    pad = [(b, r.get("server_padded_rows"), r.get("server_bucket")) for b, r in zip(bs, rows)]
    pad = [(b, p, k) for b, p, k in pad if p is not None]
    if pad:
        axp.bar([b for b, _, _ in pad], [p for _, p, _ in pad], width=[b * 0.3 for b, _, _ in pad], color="C2")
        for b, p, k in pad:
            if k is not None:
                axp.annotate(f"bucket {k:g}", (b, p), ha="center", va="bottom", fontsize=7)
    axp.set_ylim(0, max([1.0] + [p for _, p, _ in pad]) * 1.35)
    axp.set_ylabel("padded rows")
    axp.set_xlabel("concurrent streams (decode batch)")
    axp.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_summary(path: Path, rows: list[dict], config: dict, extra: dict | None = None) -> None:
    body = {"config": config, "rows": rows, **(extra or {})}
    Path(path).write_text(json.dumps(body, indent=2) + "\n")
