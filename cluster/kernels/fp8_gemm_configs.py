"""Tile configs of the FP8 GEMM kernels (cluster/kernels/fp8_gemm.py) and, per shape and batch, which
FP8 path is fastest: a committed table measured by benchmarks/tune_fp8_gemm.py, defaults elsewhere.

The table (fp8_gemm_configs.json beside this file) is keyed by (N, K, M bucket), M buckets being
M_BUCKETS (a decode step's row count rounds up to one; more rows than the last bucket take the
defaults). Each entry holds the best weight-only config, the best W8A8 config, and `path`: the
fastest of "weight_only", "w8a8" (our Triton kernel) and "scaled_mm" (torch._scaled_mm) as the tuner
timed them inside CUDA graphs (the W8A8 times include the activation quantization). The table is read
only on a device of the compute capability it was measured on; anything it lacks gets
`default_config`, and the path then follows cluster/model/linear.py's default rule. Which path a
linear runs is decided in one place, linear.py's `fp8_path`, from `tuned_path` below.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

TABLE_PATH = Path(__file__).with_name("fp8_gemm_configs.json")
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PATHS = ("weight_only", "w8a8", "scaled_mm")
SCALE_BLOCK = 128  # rows and columns of a block-scaled checkpoint's scale block
MAX_SPLIT_M_TILES = 4  # split-K only while the rows fit in this many M tiles (the lock buffer's size)
_TARGET_WAVES = 3  # split K until the grid holds about this many programs per SM


@dataclass(frozen=True)
class GemmConfig:
    """One launch's tiles: BLOCK_M rows (tokens), BLOCK_N output channels, BLOCK_K of the reduction per
    step, K split `split_k` ways (a request: the launcher rounds each split to whole BLOCK_K steps, or
    whole scale blocks for block-scaled weights), and Triton's warps and pipeline depth."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int

    def __post_init__(self):
        for v in (self.block_m, self.block_n, self.block_k):
            assert v >= 16 and v & (v - 1) == 0, f"tile sizes are powers of two >= 16, got {self}"
        assert self.split_k >= 1 and self.num_warps in (1, 2, 4, 8, 16) and self.num_stages >= 1

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(d: dict) -> "GemmConfig":
        return GemmConfig(**{k: int(d[k]) for k in ("block_m", "block_n", "block_k", "split_k", "num_warps",
                                                    "num_stages")})


@dataclass(frozen=True)
class TunedEntry:
    path: str  # one of PATHS
    weight_only: GemmConfig
    w8a8: GemmConfig | None  # None where the tuner measured no W8A8 (it always does for PATHS' sake)


def m_bucket(m: int) -> int | None:
    """The smallest bucket holding m rows; None above the last (prefill sizes)."""
    for b in M_BUCKETS:
        if m <= b:
            return b
    return None


def parse_table(data: dict) -> dict[tuple[int, int, int], TunedEntry]:
    """The JSON the tuner writes -> {(N, K, M bucket): entry}. Unknown paths are an error, not a skip."""
    out = {}
    for e in data.get("entries", []):
        path = e["path"]
        if path not in PATHS:
            raise ValueError(f"fp8 GEMM table entry {e['N']}x{e['K']} M={e['M']}: unknown path {path!r}")
        if e["M"] not in M_BUCKETS:
            raise ValueError(f"fp8 GEMM table entry {e['N']}x{e['K']}: M={e['M']} is not a bucket {M_BUCKETS}")
        w8a8 = GemmConfig.from_json(e["w8a8"]) if e.get("w8a8") else None
        if path == "w8a8" and w8a8 is None:
            raise ValueError(f"fp8 GEMM table entry {e['N']}x{e['K']} M={e['M']}: path w8a8 without its config")
        out[(int(e["N"]), int(e["K"]), int(e["M"]))] = TunedEntry(path, GemmConfig.from_json(e["weight_only"]), w8a8)
    return out


@functools.cache
def _table(capability: tuple[int, int]) -> dict[tuple[int, int, int], TunedEntry]:
    if not TABLE_PATH.is_file():
        return {}
    data = json.loads(TABLE_PATH.read_text())
    measured_on = data.get("capability")
    if measured_on is None or tuple(measured_on) != capability:
        return {}  # tiles tuned for another architecture (or none): the defaults
    return parse_table(data)


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    if device.type != "cuda":
        return (0, 0)  # CPU: the interpreter; no table applies
    return tuple(torch.cuda.get_device_capability(device))


def tuned(n: int, k: int, m: int, device: torch.device) -> TunedEntry | None:
    """The table's entry for this shape at m rows, if the tuner measured it on this kind of device."""
    b = m_bucket(m)
    return None if b is None else _table(_capability(device)).get((n, k, b))


@functools.cache
def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # the interpreter: a small grid


def default_config(m: int, n: int, k: int, w8a8: bool, block_scaled: bool, sms: int) -> GemmConfig:
    """Tiles for a shape the table lacks. One warpgroup computes a [BLOCK_N, BLOCK_M] tile of out^T
    (wgmma's M is the weight rows, its N the tokens); K is split until the grid covers the SMs about
    _TARGET_WAVES times (decode: N / BLOCK_N alone leaves most SMs idle for o_proj and down_proj)."""
    bm = 16
    while bm < min(m, 128 if w8a8 else 64):
        bm *= 2
    # A warpgroup's fp32 accumulator takes BLOCK_N * BLOCK_M / 128 registers a thread, beside (weight-only)
    # the widened weight tile's BLOCK_N * BLOCK_K / 256; narrow outputs want more tiles.
    bn = 128 if bm <= (64 if w8a8 else 32) and n >= 4096 else 64
    bk = 128
    m_tiles, n_tiles = -(-m // bm), -(-n // bn)
    split = 1
    if m_tiles <= MAX_SPLIT_M_TILES:
        unit = SCALE_BLOCK if block_scaled else bk
        steps = -(-k // unit)
        want = -(-_TARGET_WAVES * sms // (n_tiles * m_tiles))
        # The float32 partials (written and read back: 8 * split * M * N bytes) stay under a quarter of
        # the weight's N * K bytes: split <= K / (32 M). At M = 1 no limit; at 64 rows, K = 4096: two.
        traffic_cap = max(1, k // (32 * m))
        split = max(1, min(want, traffic_cap, steps // 2 if steps >= 4 else 1))  # at least two steps per split
    return GemmConfig(bm, bn, bk, split, 4, 4)


def tuned_or_default(m: int, n: int, k: int, w8a8: bool, block_scaled: bool, device: torch.device) -> GemmConfig:
    """The config a launch uses: the table's (weight-only or W8A8) where it has one, else the default.
    Block-scaled weights always take the default (the tuner measures per-channel scales)."""
    entry = None if block_scaled else tuned(n, k, m, device)
    cfg = None if entry is None else (entry.w8a8 if w8a8 else entry.weight_only)
    return cfg or default_config(m, n, k, w8a8, block_scaled, num_sms(device))


def tuned_path(n: int, k: int, m: int, device: torch.device) -> str | None:
    """The fastest FP8 path measured for this shape at m rows, or None (no entry)."""
    entry = tuned(n, k, m, device)
    return None if entry is None else entry.path
