"""How one bundle of KV transfers travels over point-to-point: its launches and their messages.

A bundle is what one prefill forward ships to one decode worker: one item per prompt, moving the blocks
`src` of the prefill's cache into the blocks `dst` the decode worker reserved, for every layer (the
cache is [layers, 2, blocks, block_size, kv_heads, head_dim]). Both sides know src and dst (the
reservation travels with the task; the begin message carries src), so each computes the same plan with
this module and only a fingerprint of it travels. No torch here: tested on CPU.

An item travels one of two ways:
  - "direct": src and dst advance together in at most MAX_DIRECT_RUNS runs of at least
    `direct_min_bytes` per (layer, K/V) message: one message per (layer, K/V, run), read from the
    prefill's blocks and received straight into the reserved blocks, nothing staged;
  - "staged" (fragmented blocks, or messages too small to be worth their per-message host cost): one
    message per segment, the segment's layers gathered into a contiguous staging buffer by one fused
    kernel on the sender and scattered from one on the receiver (block_copy.py).
A launch is a run of (item, layer range) segments posted as one NCCL group (one kernel per side). Its
staged bytes stay within a staging slot and its messages within MAX_MESSAGES_PER_LAUNCH, so a long
transfer is a few launches that pipeline (gather k+1 while k is on the wire, scatter k while k+1
arrives). Layer-wise bundles never put two layers in one launch: layer i leaves as soon as it is
computed, while layer i+1 runs.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

MAX_DIRECT_RUNS = 4
MAX_MESSAGES_PER_LAUNCH = 16  # each costs host time before the group's kernel can start


def block_runs(src, dst) -> tuple[tuple[int, int, int], ...]:
    """(src0, dst0, length) runs where both block lists advance by one."""
    runs: list[list[int]] = []
    for s, d in zip(src, dst):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return tuple((r[0], r[1], r[2]) for r in runs)


@dataclass(frozen=True)
class ItemPlan:
    src: tuple[int, ...]
    dst: tuple[int, ...]  # the reservation's first len(src) blocks
    runs: tuple[tuple[int, int, int], ...] | None  # direct: the joint runs; None: staged

    @property
    def n(self) -> int:
        return len(self.src)

    def messages(self, layers: int) -> int:
        return 2 * layers * len(self.runs) if self.runs is not None else 1

    def staged_bytes(self, layers: int, plane_block_bytes: int) -> int:
        return 0 if self.runs is not None else layers * 2 * self.n * plane_block_bytes


def plan_item(src, dst, plane_block_bytes: int, direct_min_bytes: int) -> ItemPlan:
    src, dst = tuple(src), tuple(dst)
    if not src or len(src) != len(dst):
        raise ValueError(f"an item moves n >= 1 blocks into as many: {len(src)} -> {len(dst)}")
    runs = block_runs(src, dst)
    direct = len(runs) <= MAX_DIRECT_RUNS and min(r[2] for r in runs) * plane_block_bytes >= direct_min_bytes
    return ItemPlan(src, dst, runs if direct else None)


@dataclass(frozen=True)
class Segment:
    item: int
    l0: int
    l1: int


Launch = tuple[Segment, ...]


def plan_launches(items: list[ItemPlan], num_layers: int, plane_block_bytes: int, layerwise: bool,
                  slot_bytes: int) -> list[Launch]:
    """The bundle's launches, in the order both sides post them."""
    segs: list[Segment] = []
    if layerwise:
        segs = [Segment(i, layer, layer + 1) for layer in range(num_layers) for i in range(len(items))]
    else:
        for i, it in enumerate(items):
            if it.runs is not None:
                k = max(1, MAX_MESSAGES_PER_LAUNCH // it.messages(1))
            else:
                k = max(1, slot_bytes // it.staged_bytes(1, plane_block_bytes))
            segs += [Segment(i, l0, min(num_layers, l0 + k)) for l0 in range(0, num_layers, k)]
    launches: list[Launch] = []
    cur: list[Segment] = []
    msgs = staged = 0
    for s in segs:
        it, layers = items[s.item], s.l1 - s.l0
        m, b = it.messages(layers), it.staged_bytes(layers, plane_block_bytes)
        if cur and (msgs + m > MAX_MESSAGES_PER_LAUNCH or staged + b > slot_bytes or (layerwise and s.l0 != cur[-1].l0)):
            launches.append(tuple(cur))
            cur, msgs, staged = [], 0, 0
        cur.append(s)
        msgs, staged = msgs + m, staged + b
    if cur:
        launches.append(tuple(cur))
    return launches


def launch_last_layer(launch: Launch) -> int:
    """The launch can go out once this layer's K/V is computed."""
    return max(s.l1 for s in launch) - 1


def fingerprint(items: list[ItemPlan], launches: list[Launch]) -> int:
    """Both sides compare it: a plan computed differently would mismatch sends and receives."""
    return zlib.crc32(repr(([(it.n, it.runs) for it in items], launches)).encode())


def plan_copies(n_items: int, num_layers: int, layerwise: bool) -> list[Launch]:
    """Same-GPU bundles: each launch is one fused copy kernel per item (no messages, no staging)."""
    if layerwise:
        return [tuple(Segment(i, layer, layer + 1) for i in range(n_items)) for layer in range(num_layers)]
    return [tuple(Segment(i, 0, num_layers) for i in range(n_items))]


# -- what a pair must agree on besides the layout -----------------------------------------------------
@dataclass(frozen=True)
class KVNumerics:
    """What the K/V in a worker's cache is, beyond its shape: the cache's element type and the
    numerics tag (cluster.kv_cache.kv_numerics_tag: activation dtype, weight quantization, cache dtype).
    An FP8 cache may travel as its uint8 view (gloo and NCCL send bytes), so the transport's own tensor
    no longer says it is FP8: this does."""

    kv_dtype: str  # e.g. "bfloat16", "float8_e4m3fn"
    tag: str

    def as_dict(self) -> dict:
        return {"kv_dtype": self.kv_dtype, "tag": self.tag}

    @classmethod
    def from_dict(cls, d: dict | None) -> "KVNumerics | None":
        return None if not d else cls(str(d["kv_dtype"]), str(d["tag"]))


class KVNumericsMismatch(RuntimeError):
    """A prefill and a decode worker whose KV is not interchangeable: the pair is refused."""


def check_pair_numerics(prefill_id: str, prefill: KVNumerics | None, decode_id: str, decode: KVNumerics | None) -> None:
    """At pair formation: a prefill worker ships its K/V bytes as they are into the decode worker's
    cache, so both must store the same element type computed the same way (bf16 KV read as FP8, or
    KV from FP8 weights under a bf16 prefix-cache salt, would be silently wrong text). A side that
    does not say (None: an older worker, a test transport) is not checked."""
    if prefill is None or decode is None:
        return
    if prefill.kv_dtype != decode.kv_dtype:
        raise KVNumericsMismatch(
            f"KV cache dtype mismatch: prefill worker {prefill_id} stores {prefill.kv_dtype}, decode worker "
            f"{decode_id} {decode.kv_dtype}; serve both with the same --kv-cache-dtype")
    if prefill.tag != decode.tag:
        raise KVNumericsMismatch(
            f"KV numerics mismatch: prefill worker {prefill_id} computes KV as {prefill.tag!r}, decode worker "
            f"{decode_id} as {decode.tag!r}; serve both with the same --dtype, --quantization and --kv-cache-dtype")
