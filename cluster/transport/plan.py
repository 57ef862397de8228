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

Tensor parallelism (a prefill worker of TP N, a decode worker of TP M: cluster/distributed/sharding.py).
Each rank's cache holds its KV heads only, so the bytes move between ranks: the pair's `PlanSpec`
carries both sizes and the model's KV heads, and from them `head_links` derives the head mapping, one
`HeadLink` per (prefill rank, decode rank, run of heads): every decode rank takes each of its heads
from one prefill rank that holds it (N > M: a decode rank gathers head slices from several prefill
ranks; N < M: a prefill rank splits its heads over several decode ranks; replicated heads come from
the holders in turn, so no rank sends them all). Each link is its own channel between its two ranks
(torch_dist.py), with launches of its own (`Launch.link`): its staged layout is
[layers, 2, blocks, block_size, link heads, head_dim]. Launches of all links are merged in order of
their last layer (a link's own order kept), so each goes out as soon as its layers are written. A
link that moves every head of both ranks' caches (`HeadLink.whole`: N = M) gathers whole blocks, as
without tensor parallelism. Both sides compute the links from the spec they agreed on; the fingerprint
covers every launch's link, so a plan with another head mapping would be refused.

Extending it: `PlanSpec` is the one place both sides check the bytes' layout (once, when the pair
forms); a KV dtype with scales would add fields there. What the bytes mean (`KVNumerics`: the cache's
element type and the numerics it was computed with; an FP8 cache travels as its uint8 view, so
PlanSpec.dtype no longer says it) is checked at the same point, before the layout, by
`check_pair_numerics`.
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import asdict, dataclass, fields, replace

from cluster.distributed.sharding import kv_heads_of_rank


@dataclass(frozen=True)
class HeadLink:
    """KV heads [h0, h0 + n) of the model, from local head `src0` of prefill rank `prefill_rank`'s cache
    into local head `dst0` of decode rank `decode_rank`'s."""

    prefill_rank: int
    decode_rank: int
    h0: int
    n: int
    src0: int
    dst0: int
    whole: bool  # every head of both ranks' caches: whole blocks move

    def heads(self, side: str) -> tuple[int, int]:
        """(first local head, heads) of this link on side "src" (prefill) or "dst" (decode)."""
        return (self.src0 if side == "src" else self.dst0), self.n


@functools.cache
def head_links(num_kv_heads: int, prefill_tp: int, decode_tp: int) -> tuple[HeadLink, ...]:
    """The head mapping between a prefill group of `prefill_tp` ranks and a decode group of `decode_tp`
    (the module docstring): links in (decode rank, head) order."""
    holders = {h: [r for r in range(prefill_tp) if h in kv_heads_of_rank(num_kv_heads, prefill_tp, r)]
               for h in range(num_kv_heads)}
    links: list[HeadLink] = []
    for d in range(decode_tp):
        d_heads = kv_heads_of_rank(num_kv_heads, decode_tp, d)
        for h in d_heads:
            p = holders[h][d % len(holders[h])]
            p_heads = kv_heads_of_rank(num_kv_heads, prefill_tp, p)
            last = links[-1] if links else None
            if last is not None and (last.prefill_rank, last.decode_rank) == (p, d) and last.h0 + last.n == h:
                links[-1] = replace(last, n=last.n + 1)
            else:
                links.append(HeadLink(p, d, h, 1, h - p_heads.start, h - d_heads.start, False))
    return tuple(replace(x, whole=x.n == len(kv_heads_of_rank(num_kv_heads, prefill_tp, x.prefill_rank))
                         == len(kv_heads_of_rank(num_kv_heads, decode_tp, x.decode_rank))) for x in links)


@dataclass(frozen=True)
class PlanSpec:
    """What both ends of a pair must share to compute the same plans and lay out the same bytes.
    Built by each transport from its cache; the prefill sends its own in the Hello, the decode side
    publishes its own with its control endpoint; `check_peer` refuses a pair that differs in anything."""

    payload: str  # how the bytes move: "torch_dist/nccl", "torch_dist/gloo", "same_gpu"
    num_layers: int
    block_size: int
    kv_heads: int  # the model's KV heads (all of them: a tensor-parallel rank's cache holds its share)
    head_dim: int
    dtype: str  # the cache's torch dtype name, e.g. "bfloat16"
    elem_bytes: int
    chunk_bytes: int  # the most bytes one launch moves (one staging slot); 0: no staging (same-GPU copies)
    prefill_tp: int = 1  # the ranks of the prefill worker (tensor parallelism)
    decode_tp: int = 1  # ... and of the decode worker; each side publishes its own, the pair's has both

    def __post_init__(self):
        if min(self.num_layers, self.block_size, self.kv_heads, self.head_dim, self.elem_bytes) <= 0:
            raise ValueError(f"a KV layout of positive sizes, got {self}")
        if self.chunk_bytes < 0 or 0 < self.chunk_bytes < 2 * self.plane_block_bytes:
            raise ValueError(f"staging_bytes={self.chunk_bytes} cannot hold one block's K and V of one layer "
                             f"({2 * self.plane_block_bytes} bytes): raise it")

    @property
    def plane_block_bytes(self) -> int:
        """One block's K (or V) of one layer, every KV head of the model."""
        return self.block_size * self.kv_heads * self.head_dim * self.elem_bytes

    @property
    def links(self) -> tuple[HeadLink, ...]:
        """The pair's head mapping (one whole link without tensor parallelism)."""
        return head_links(self.kv_heads, self.prefill_tp, self.decode_tp)

    def link_plane_bytes(self, link: int) -> int:
        """One block's K (or V) of one layer, the heads of one link."""
        return self.block_size * self.links[link].n * self.head_dim * self.elem_bytes

    def joined(self, theirs: "PlanSpec", my_role: str) -> "PlanSpec":
        """The pair's spec: this side's, with the peer's tensor-parallel size (the other fields must
        then be equal: check_peer)."""
        if my_role == "prefill":
            return replace(self, decode_tp=theirs.decode_tp)
        return replace(self, prefill_tp=theirs.prefill_tp)

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
    """Layers [l0, l1) of the bundle's blocks [b0, b1), the heads of `link` (PlanSpec.links): one
    message (or one same-GPU copy kernel)."""

    l0: int
    l1: int
    b0: int
    b1: int
    link: int = 0

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
        return self.layers * 2 * self.blocks * spec.link_plane_bytes(self.link)


def bundle_blocks(items: list[ItemPlan], side: str) -> list[int]:
    """This side's block ids in plan order ("src": the prefill's, "dst": the decode worker's)."""
    return [x for it in items for x in (it.src if side == "src" else it.dst)]


def plan_launches(spec: PlanSpec, n_blocks: int) -> list[Launch]:
    """A staged bundle of n_blocks blocks: per link, layer groups that fit one slot, smallest group
    last; a layer that does not fit alone goes in near-equal windows of blocks. The links' launches
    merged by last layer (each link's own order kept)."""
    if n_blocks <= 0:
        raise ValueError("a bundle moves at least one block")
    per_link = [_link_launches(spec, n_blocks, i) for i in range(len(spec.links))]
    if len(per_link) == 1:
        return per_link[0]
    merged = [(la.last_layer, i, k, la) for i, ls in enumerate(per_link) for k, la in enumerate(ls)]
    return [la for *_, la in sorted(merged, key=lambda x: x[:3])]


def _link_launches(spec: PlanSpec, n_blocks: int, link: int) -> list[Launch]:
    plane = spec.link_plane_bytes(link)
    per_layer = 2 * n_blocks * plane
    L = spec.num_layers
    if per_layer <= spec.chunk_bytes:
        g = min(L, spec.chunk_bytes // per_layer)
        return [Launch(l0, min(L, l0 + g), 0, n_blocks, link) for l0 in range(0, L, g)]
    per_window = spec.chunk_bytes // (2 * plane)  # >= 1 (PlanSpec checks the whole block; a link is less)
    k = -(-n_blocks // per_window)
    edges = [n_blocks * j // k for j in range(k + 1)]
    return [Launch(layer, layer + 1, edges[j], edges[j + 1], link) for layer in range(L) for j in range(k)]


def plan_copies(spec: PlanSpec, n_blocks: int, layerwise: bool) -> list[Launch]:
    """Same-GPU bundles: each launch is one fused copy kernel, cache to pool (no message, no staging):
    one per layer when layer-wise, else one for the whole bundle."""
    if layerwise:
        return [Launch(layer, layer + 1, 0, n_blocks) for layer in range(spec.num_layers)]
    return [Launch(0, spec.num_layers, 0, n_blocks)]


def fingerprint(items: list[ItemPlan], launches: list[Launch]) -> int:
    """Both sides compare it: a plan computed differently would mismatch sends and receives."""
    return zlib.crc32(repr(([it.n for it in items], [(la.l0, la.l1, la.b0, la.b1, la.link) for la in launches])).encode())


# -- what a pair must agree on besides the layout -----------------------------------------------------
@dataclass(frozen=True)
class KVNumerics:
    """What the K/V in a worker's cache is, beyond its shape: the cache's element type and the
    numerics tag (cluster.kv.kv_cache.kv_numerics_tag: activation dtype, weight quantization, cache dtype).
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
