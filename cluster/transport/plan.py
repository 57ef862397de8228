"""How one bundle of KV transfers travels: what both ends of a pair agree on (`PlanSpec`), and the
bundle's launches, each one message of contiguous bytes.

A bundle is what one prefill forward ships to one decode worker: one item per prompt, moving the blocks
`src` of the prefill's cache into the blocks `dst` the decode worker reserved (the reservation's first
len(src): with prefix caching, only the blocks the decode worker lacks). The cache is
[layers, 2, blocks, block_size, kv_heads, head_dim]; a block's K or V of one layer is one "plane block"
of `PlanSpec.plane_block_bytes`. Both sides know src and dst (the reservation travels with the task, the
Begin carries src), so each computes the same plan with this module; only a fingerprint of it travels.
No torch here: tested on CPU.

The bundle's blocks, its items' in order, are numbered 0..N-1 (`bundle_blocks`). A launch is a layer
range [l0, l1) times a window [b0, b1) of those blocks: the sender gathers it into one staging slot with
one fused kernel (block_copy.py), sends the slot as ONE message, and the receiver scatters it from its
own slot into the reserved blocks with the same kernel. Layouts on both sides: [l1 - l0, 2, b1 - b0,
block_size, kv_heads, head_dim], contiguous. A launch's bytes stay within `chunk_bytes` (one slot).

Launches are layer-major: a "layer group" of as many whole layers of every block as fit a slot, or,
when one layer of the bundle does not fit, that layer in windows of blocks. The same plan serves both
ways of shipping: all at once after the forward, or layer-wise, each launch as soon as its last layer's
K/V is written (`Launch.last_layer`), so shipping overlaps the rest of the forward. The last group is
the smallest one: what stays exposed after the forward is as short as the plan can make it.

Extending it: `PlanSpec` is the one place both sides check (once, when the pair forms); a KV-head
mapping between tensor-parallel groups of different sizes, or a KV dtype with scales, adds fields there
and a head range to `Launch`.
"""

from __future__ import annotations

import zlib
from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class PlanSpec:
    """What both ends of a pair must share to compute the same plans and lay out the same bytes.
    Built by each transport from its cache; the prefill sends its own in the Hello, the decode side
    publishes its own with its control endpoint; `check_peer` refuses a pair that differs in anything."""

    payload: str  # how the bytes move: "torch_dist/nccl", "torch_dist/gloo", "same_gpu"
    num_layers: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: str  # the cache's torch dtype name, e.g. "bfloat16"
    elem_bytes: int
    chunk_bytes: int  # the most bytes one launch moves (one staging slot); 0: no staging (same-GPU copies)

    def __post_init__(self):
        if min(self.num_layers, self.block_size, self.kv_heads, self.head_dim, self.elem_bytes) <= 0:
            raise ValueError(f"a KV layout of positive sizes, got {self}")
        if self.chunk_bytes < 0 or 0 < self.chunk_bytes < 2 * self.plane_block_bytes:
            raise ValueError(f"staging_bytes={self.chunk_bytes} cannot hold one block's K and V of one layer "
                             f"({2 * self.plane_block_bytes} bytes): raise it")

    @property
    def plane_block_bytes(self) -> int:
        """One block's K (or V) of one layer."""
        return self.block_size * self.kv_heads * self.head_dim * self.elem_bytes

    @property
    def block_bytes(self) -> int:
        """One block, every layer, K and V: what a transfer moves per block."""
        return 2 * self.num_layers * self.plane_block_bytes

    def to_wire(self) -> dict:
        return asdict(self)

    @classmethod
    def from_wire(cls, d: dict, peer: str) -> "PlanSpec":
        names = {f.name for f in fields(cls)}
        if not isinstance(d, dict) or set(d) != names:
            raise RuntimeError(f"{peer} describes its KV payload as {d!r}: not a PlanSpec of this version "
                               f"(fields {sorted(names)}); mismatched code?")
        return cls(**d)

    def check_peer(self, theirs: "PlanSpec", peer: str) -> None:
        if theirs != self:
            diff = {f.name: (getattr(self, f.name), getattr(theirs, f.name)) for f in fields(self)
                    if getattr(self, f.name) != getattr(theirs, f.name)}
            raise RuntimeError(f"KV layout or payload mismatch with {peer} (field: (here, there)): {diff}")


@dataclass(frozen=True)
class ItemPlan:
    src: tuple[int, ...]
    dst: tuple[int, ...]  # the reservation's first len(src) blocks

    @property
    def n(self) -> int:
        return len(self.src)


def plan_item(src, dst) -> ItemPlan:
    src, dst = tuple(src), tuple(dst)
    if not src or len(src) != len(dst):
        raise ValueError(f"an item moves n >= 1 blocks into as many: {len(src)} -> {len(dst)}")
    return ItemPlan(src, dst)


@dataclass(frozen=True)
class Launch:
    """Layers [l0, l1) of the bundle's blocks [b0, b1): one message (or one same-GPU copy kernel)."""

    l0: int
    l1: int
    b0: int
    b1: int

    @property
    def last_layer(self) -> int:
        """The launch can go out once this layer's K/V is computed."""
        return self.l1 - 1

    @property
    def layers(self) -> int:
        return self.l1 - self.l0

    @property
    def blocks(self) -> int:
        return self.b1 - self.b0

    def nbytes(self, spec: PlanSpec) -> int:
        return self.layers * 2 * self.blocks * spec.plane_block_bytes


def bundle_blocks(items: list[ItemPlan], side: str) -> list[int]:
    """This side's block ids in plan order ("src": the prefill's, "dst": the decode worker's)."""
    return [x for it in items for x in (it.src if side == "src" else it.dst)]


def plan_launches(spec: PlanSpec, n_blocks: int) -> list[Launch]:
    """A staged bundle of n_blocks blocks: layer groups that fit one slot, smallest group last; a
    layer that does not fit alone goes in near-equal windows of blocks."""
    per_layer = 2 * n_blocks * spec.plane_block_bytes
    L = spec.num_layers
    if n_blocks <= 0:
        raise ValueError("a bundle moves at least one block")
    if per_layer <= spec.chunk_bytes:
        g = min(L, spec.chunk_bytes // per_layer)
        return [Launch(l0, min(L, l0 + g), 0, n_blocks) for l0 in range(0, L, g)]
    per_window = spec.chunk_bytes // (2 * spec.plane_block_bytes)  # >= 1 (PlanSpec checks)
    k = -(-n_blocks // per_window)
    edges = [n_blocks * j // k for j in range(k + 1)]
    return [Launch(layer, layer + 1, edges[j], edges[j + 1]) for layer in range(L) for j in range(k)]


def plan_copies(spec: PlanSpec, n_blocks: int, layerwise: bool) -> list[Launch]:
    """Same-GPU bundles: each launch is one fused copy kernel, cache to pool (no message, no staging):
    one per layer when layer-wise, else one for the whole bundle."""
    if layerwise:
        return [Launch(layer, layer + 1, 0, n_blocks) for layer in range(spec.num_layers)]
    return [Launch(0, spec.num_layers, 0, n_blocks)]


def fingerprint(items: list[ItemPlan], launches: list[Launch]) -> int:
    """Both sides compare it: a plan computed differently would mismatch sends and receives."""
    return zlib.crc32(repr(([it.n for it in items], [(la.l0, la.l1, la.b0, la.b1) for la in launches])).encode())
