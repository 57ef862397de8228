"""Plots disagg_vs_colocated.json (benchmarks/bench_disagg.py) and prints the issue's targets.

One figure: goodput per request rate under each SLO set, ITL p50/p99 and TTFT p50/p99 (log scale),
one line per setup. The targets (benchmarks.bench_disagg.evaluate_targets) are written back into the
JSON under "targets".

    python benchmarks/plot_disagg.py loadtest/results/disagg_vs_colocated.json
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from benchmarks.bench_disagg import evaluate_targets  # noqa: E402

ORDER = ["adaptive", "static-1p1d", "colocated"]


def main(path: str) -> None:
    p = Path(path)
    doc = json.loads(p.read_text())
    rows = doc["rows"]
    setups = sorted({r["setup"] for r in rows}, key=lambda s: (ORDER.index(s) if s in ORDER else len(ORDER), s))
    slos = sorted({r["slo"] for r in rows}, key=lambda s: -min(r["ttft_slo_s"] for r in rows if r["slo"] == s))
    fig, axes = plt.subplots(1, len(slos) + 2, figsize=(5 * (len(slos) + 2), 4.2))
    for i, s in enumerate(setups):
        color = f"C{i}"
        for k, slo in enumerate(slos):
            sr = sorted((r for r in rows if r["setup"] == s and r["slo"] == slo), key=lambda r: r["request_rate"])
            axes[k].plot([r["request_rate"] for r in sr], [r["goodput_rps"] for r in sr], "o-", color=color, label=s)
        sr = sorted((r for r in rows if r["setup"] == s and r["slo"] == slos[0]), key=lambda r: r["request_rate"])
        x = [r["request_rate"] for r in sr]
        axes[-2].plot(x, [r["itl_p50_ms"] for r in sr], "o-", color=color, label=f"{s} p50")
        axes[-2].plot(x, [r["itl_p99_ms"] for r in sr], "x--", color=color, label=f"{s} p99")
        axes[-1].plot(x, [r["ttft_p50_ms"] for r in sr], "o-", color=color, label=f"{s} p50")
        axes[-1].plot(x, [r["ttft_p99_ms"] for r in sr], "x--", color=color, label=f"{s} p99")
    for k, slo in enumerate(slos):
        one = next(r for r in rows if r["slo"] == slo)
        rates = sorted({r["request_rate"] for r in rows})
        axes[k].plot(rates, rates, ":", color="gray", label="offered")
        axes[k].set_title(f"goodput, {slo}: TTFT<={one['ttft_slo_s'] * 1e3:g} ms, TPOT<={one['tpot_slo_s'] * 1e3:g} ms")
        axes[k].set_ylabel("requests/s meeting the SLO")
    axes[-2].set_title("inter-token latency (ms)")
    axes[-1].set_title("time to first token (ms)")
    axes[-1].set_yscale("log")
    for ax in axes:
        ax.set_xlabel("request rate (requests/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    cfg = doc.get("config", {})
    fig.suptitle(f"prompts {cfg.get('prompt_lens')} tokens, {cfg.get('output_tokens')} output tokens, Poisson arrivals",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(p.with_suffix(".png"), dpi=110)
    doc["targets"] = evaluate_targets(rows)
    p.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(doc["targets"], indent=2))


if __name__ == "__main__":
    main(sys.argv[1])
