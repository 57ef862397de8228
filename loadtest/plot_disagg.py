"""Plots disagg_vs_colocated.json: goodput, ITL p50/p99 and TTFT p50 against request rate per setup."""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(path: str) -> None:
    doc = json.loads(Path(path).read_text())
    setups = sorted({r["setup"] for r in doc["rows"]})
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for s in setups:
        rows = sorted((r for r in doc["rows"] if r["setup"] == s), key=lambda r: r["request_rate"])
        x = [r["request_rate"] for r in rows]
        axes[0].plot(x, [r["goodput_rps"] for r in rows], "o-", label=s)
        axes[1].plot(x, [r["itl_p50_ms"] for r in rows], "o-", label=f"{s} p50")
        axes[1].plot(x, [r["itl_p99_ms"] for r in rows], "x--", label=f"{s} p99")
        axes[2].plot(x, [r["ttft_p50_ms"] for r in rows], "o-", label=s)
    cfg = doc.get("config", {})
    axes[0].set_title(f"goodput (TTFT<={cfg.get('ttft_slo_s')}s, TPOT<={cfg.get('tpot_slo_s')}s)")
    axes[0].set_ylabel("requests/s")
    axes[1].set_title("inter-token latency (ms)")
    axes[2].set_title("time to first token p50 (ms)")
    for ax in axes:
        ax.set_xlabel("request rate (requests/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(Path(path).with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    main(sys.argv[1])
