"""The KV payload of a tensor-parallel worker: rank 0's transport runs the control plane, and its
payload (`TPPayload`) rank 0's own links and the calls that drive the followers; each follower's
payload agent (`PayloadAgent`) runs its own links; all over the head mapping of plan.py (PlanSpec.links: which prefill rank sends which heads to which decode rank).

Per pair (a prefill worker of N ranks, a decode worker of M):
- forming, once per pair of incarnations: rank 0 reserves its links' staging and forms them as before
  (hello, verdict, warm-up: torch_dist.py), and has every follower with links in the pair reserve
  (`Reserve`, before the verdict: a refusal reaches the peer) and form (`Form`) its own, waiting for all;
- a bundle, prefill side: rank 0 claims, announces (Begin) and commits as before; the bundle's plan
  reaches the prefill followers with the pass that computes its KV (PrefillPass.shipment:
  `shipment_for_followers`), and each rank issues its own links' launches from its forward's layer
  hooks, as rank 0 does; rank 0's completion of the bundle includes each follower's part (a `Done`
  notification once that rank's payload is through), so the source blocks go back only then;
- a bundle, decode side: on the Begin, rank 0's control thread posts its own links' receives and has
  every follower with links post its own (`Post`); the arrival waits for every rank's part (`Done`);
- a dead peer: rank 0 aborts its links and has the followers abort theirs (`Abort`: NCCL's abort ends
  what is in flight, and their Done comes with an error); a restarted peer's old links are released
  everywhere (`Release`).
Only rank 0 talks to the other worker (claims, Begin, Commit, liveness). Calls and notifications travel
over the group's RankRPC (cluster/distributed/rank_rpc.py), msgspec on both ends. A follower that dies
takes its worker down (cluster/distributed/watchdog.py): its peers see that worker dead, as any other.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import Callable, Union

import msgspec
import numpy as np
import torch

from cluster.transport.completion import AllCompletion, Completion
from cluster.transport.pair import Pair
from cluster.transport.payload import KVPayload, PayloadEnd, kv_payload_view
from cluster.transport.plan import Launch, PlanSpec, bundle_blocks, plan_item
from cluster.transport.rendezvous_store import store_factory
from cluster.transport.torch_dist import TorchDistPayload
from cluster.transport.transport_spec import TransportSpec

log = logging.getLogger(__name__)


class Attach(msgspec.Struct, tag="attach"):
    spec: TransportSpec
    worker_id: str
    role: str
    incarnation: int  # rank 0's transport's (the links' rendezvous keys name it)


class Reserve(msgspec.Struct, tag="reserve"):
    peer: str
    peer_inc: int
    spec: dict  # the pair's PlanSpec
    gen: int = 0  # the pair's generation (pair.py): the links' rendezvous keys name it


class Form(msgspec.Struct, tag="form"):
    peer: str


class Post(msgspec.Struct, tag="post"):
    peer: str
    bundle: int
    dst: bytes  # <i8: the decode worker's block ids in plan order
    launches: list[tuple[int, int, int, int, int]]


class Abort(msgspec.Struct, tag="abort"):
    peer: str
    peer_inc: int
    gen: int
    why: str = ""


class Release(msgspec.Struct, tag="release"):
    """HAZARD: rank 0 gives up a pair (re-formed, its peer restarted, a formation abandoned) while a
    newer one with the same peer may already be reserved on the followers: the call names the pair's
    incarnation and generation, and a follower's pair of another one is left alone."""

    peer: str
    peer_inc: int
    gen: int


Call = Union[Attach, Reserve, Form, Post, Abort, Release]
_CALLS = msgspec.msgpack.Decoder(Call)


class Done(msgspec.Struct, array_like=True):
    """A follower's part of a bundle's payload is through (or failed)."""

    peer: str
    peer_inc: int
    bundle: int
    side: str  # "src" | "dst"
    error: str = ""


class ShipBundle(msgspec.Struct, array_like=True):
    peer: str
    peer_inc: int
    bundle: int
    src: bytes  # <i8: the prefill worker's block ids in plan order
    launches: list[tuple[int, int, int, int, int]]
    gen: int = 0  # the pair's generation


_ENC = msgspec.msgpack.Encoder()
_DONE = msgspec.msgpack.Decoder(Done)
_SHIPMENT = msgspec.msgpack.Decoder(list[ShipBundle])


def _launch_rows(launches) -> list[tuple[int, int, int, int, int]]:
    return [(la.l0, la.l1, la.b0, la.b1, la.link) for la in launches]


def _ids(raw: bytes) -> tuple[int, ...]:
    return tuple(np.frombuffer(raw, dtype="<i8").tolist())


class _FollowerParts(Completion):
    """The followers' parts of one bundle: done once every expected rank's Done came (its error: the
    first one). Never abandoned by a dead peer: a follower's part ends when its links do (an Abort
    fails them), and only then is nothing writing the bundle's blocks on that rank."""

    def __init__(self, ranks):
        self.waiting = set(ranks)
        self.errors: list[str] = []
        self._ev = threading.Event()
        self._lock = threading.Lock()
        if not self.waiting:
            self._ev.set()

    def arrive(self, rank: int, error: str) -> None:
        with self._lock:
            self.waiting.discard(rank)
            if error:
                self.errors.append(f"rank {rank}: {error}")
            if not self.waiting:
                self._ev.set()

    def done(self) -> bool:
        return self._ev.is_set()

    def wait(self) -> None:
        self._ev.wait()

    def error(self) -> str | None:
        return self.errors[0] if self.errors else None


class TPPayload(KVPayload):
    """Rank 0's payload in a tensor-parallel worker: its own links (a TorchDistPayload) and, per pair,
    the followers' over the group's RPC (the module docstring)."""

    def __init__(self, end: PayloadEnd, group, kv_heads: int):
        self.own = TorchDistPayload(end)
        self.kv_cache, self.role, self.spec = end.kv_cache, end.role, end.spec
        self.group = group
        self._parts: dict[tuple, _FollowerParts] = {}
        self._early: dict[tuple, dict[int, str]] = {}  # Done notifications ahead of their bundle's seal/post
        self._parts_lock = threading.Lock()
        # (A bundle's arrival needs no wake-up from here: its pair's waiter wakes the decode loop once
        # the whole completion, followers' parts included, is done.)
        group.rpc.on_notify = self._on_notify
        # With the cluster's secret: a follower's links rendezvous through the (sealed) store. The
        # RPC channel it goes on is a private ipc:// path (rank_rpc.py).
        attach = Attach(end.spec, end.worker_id, end.role, end.incarnation)
        self._wait_all(self._call(range(1, group.size), attach))

    # -- calls to the followers -------------------------------------------------------------------
    def _ranks_in(self, pair: Pair) -> list[int]:
        """The followers with links in the pair."""
        side = "prefill_rank" if self.role == "prefill" else "decode_rank"
        return sorted({getattr(x, side) for x in pair.spec.links} - {0})

    def _call(self, ranks, msg) -> list[Future]:
        body = _ENC.encode(msg)
        return [self.group.rpc.call(r, body) for r in ranks]

    def _wait_all(self, futures: list[Future]) -> None:
        timeout = 4 * self.spec.transfer_timeout_s
        for f in futures:
            f.result(timeout=timeout)

    # -- their parts of a bundle ----------------------------------------------------------------------
    def _on_notify(self, rank: int, body: bytes) -> None:
        d = _DONE.decode(body)
        key = (d.peer, d.peer_inc, d.bundle, d.side)
        with self._parts_lock:
            parts = self._parts.get(key)
            if parts is None:
                self._early.setdefault(key, {})[rank] = d.error
                return
        parts.arrive(rank, d.error)
        with self._parts_lock:
            if parts.done():
                self._parts.pop(key, None)

    def _follower_parts(self, pair: Pair, bundle: int, side: str, ranks) -> _FollowerParts:
        key = (pair.peer, pair.peer_inc, bundle, side)
        parts = _FollowerParts(ranks)
        with self._parts_lock:
            early = self._early.pop(key, {})
            if not parts.done():
                self._parts[key] = parts
        for rank, error in early.items():
            parts.arrive(rank, error)
        if parts.done():
            with self._parts_lock:
                self._parts.pop(key, None)
        return parts

    # -- the payload: rank 0's own links (torch_dist.py), then the followers' ----------------------------
    def plan_kind(self) -> tuple[str, int]:
        return self.own.plan_kind()

    def plan(self, pair, srcs, dsts, layerwise):
        return self.own.plan(pair, srcs, dsts, layerwise)

    def metrics(self) -> dict:
        return self.own.metrics()

    def prepare(self, pair: Pair, info: dict) -> list[bytes]:
        out = self.own.prepare(pair, info)
        self._reserve_followers(pair)
        return out

    def admit(self, pair: Pair, hello) -> None:
        self.own.admit(pair, hello)
        self._reserve_followers(pair)

    def _reserve_followers(self, pair: Pair) -> None:
        try:
            self._wait_all(self._call(self._ranks_in(pair), Reserve(pair.peer, pair.peer_inc, pair.spec.to_wire(), pair.gen)))
        except Exception:
            self.own.release(pair)
            self._call(self._ranks_in(pair), Release(pair.peer, pair.peer_inc, pair.gen))
            raise

    def warm(self, pair: Pair) -> None:
        futures = self._call(self._ranks_in(pair), Form(pair.peer))  # the followers form theirs meanwhile
        self.own.warm(pair)
        self._wait_all(futures)

    def accept(self, pair: Pair, hello) -> None:
        futures = self._call(self._ranks_in(pair), Form(pair.peer))
        self.own.accept(pair, hello)
        self._wait_all(futures)

    def issue(self, pair: Pair, b, launch: Launch, ready) -> None:
        self.own.issue(pair, b, launch, ready)  # (the followers issue theirs from their own passes)

    def seal(self, pair: Pair, b):
        own, event = self.own.seal(pair, b)
        ranks = self._ranks_in(pair)
        if not ranks:
            return own, event
        return AllCompletion([own, self._follower_parts(pair, b.id, "src", ranks)]), event

    def post(self, pair: Pair, b):
        ranks = self._ranks_in(pair)
        parts = None
        if ranks:
            parts = self._follower_parts(pair, b.id, "dst", ranks)  # before the post: a Done may come at once
            dst = np.asarray(bundle_blocks(b.items, "dst"), dtype="<i8").tobytes()
            self._call(ranks, Post(pair.peer, b.id, dst, _launch_rows(b.launches)))
        own, err = self.own.post(pair, b)
        return (own if parts is None else AllCompletion([own, parts])), err

    def kill(self, pair: Pair, bundles: list, then) -> None:
        """Fault "transfer": rank 0's links as torch_dist kills them; then the followers' go the same
        way (NCCL: aborted; gloo: released, so their sockets close) before `then()`."""
        def followers_then() -> None:
            if pair.spec is not None:
                msg = (Abort(pair.peer, pair.peer_inc, pair.gen, pair.dead or "") if self.own.backend == "nccl"
                       else Release(pair.peer, pair.peer_inc, pair.gen))
                self._call(self._ranks_in(pair), msg)
            then()
        self.own.kill(pair, bundles, followers_then)

    def abort(self, pair: Pair) -> None:
        self.own.abort(pair)
        if pair.spec is not None:
            self._call(self._ranks_in(pair), Abort(pair.peer, pair.peer_inc, pair.gen, pair.dead or ""))

    def release(self, pair: Pair) -> None:
        self.own.release(pair)
        if pair.spec is not None:
            self._call(self._ranks_in(pair), Release(pair.peer, pair.peer_inc, pair.gen))

    # -- prefill: what the followers ship with a pass ----------------------------------------------------
    def followers_part(self, shipment) -> bytes:
        """The bundles a pass ships (a SenderSide shipment), for the PrefillPass the followers run:
        their plans and source blocks; b"" when none has a follower's link."""
        if shipment is None:
            return b""
        out = [ShipBundle(b.pair.peer, b.pair.peer_inc, b.id, np.asarray(bundle_blocks(b.items, "src"), dtype="<i8").tobytes(),
                          _launch_rows(b.launches), b.pair.gen)
               for b in shipment.bundles if b.pair.spec is not None and self._ranks_in(b.pair)]
        return _ENC.encode(out) if out else b""


class _Bundle:
    """A follower's view of one bundle: what torch_dist's payload code reads (items, launches, payload)."""

    def __init__(self, bid: int, pair: Pair, ids: tuple[int, ...], launches):
        self.id, self.pair = bid, pair
        self.items = [plan_item(ids, ids)]  # only bundle_blocks(items, side) is read: this side's ids
        self.launches = [Launch(*row) for row in launches]
        self.issued = 0
        self.payload = None


class PayloadAgent:
    """A follower rank's part of its worker's KV transport: its links of every pair (its own
    TorchDistPayload), driven by rank 0's calls (prefill: also by the passes it runs, `begin_pass` /
    `layer_done` / `kv_done`)."""

    def __init__(self, group, kv_cache: torch.Tensor, attach: Attach):
        self.group = group
        self.worker_id, self.role, self.tp_rank = attach.worker_id, attach.role, group.rank
        self.payload = TorchDistPayload(PayloadEnd(attach.spec, kv_cache, attach.worker_id, attach.role,
                                                   attach.incarnation, store_factory(attach.spec), group.rank))
        self.pairs: dict[str, Pair] = {}
        self._pass: list[_Bundle] = []  # prefill: the bundles of the pass being computed

    # -- rank 0's calls (the group's RPC thread, one at a time) -------------------------------------
    def handle(self, msg) -> None:
        if isinstance(msg, Reserve):
            old = self.pairs.pop(msg.peer, None)
            if old is not None:
                self._drop(old)
            pair = Pair(msg.peer, f"{self.worker_id}.r{self.tp_rank}")
            pair.peer_inc, pair.gen, pair.spec = msg.peer_inc, msg.gen, PlanSpec.from_wire(msg.spec, msg.peer)
            self.payload.reserve(pair)
            pair.waiter.start()
            self.pairs[msg.peer] = pair
        elif isinstance(msg, Form):
            pair = self.pairs[msg.peer]
            with pair.io:
                self.payload.open_links(pair, send=self.role == "prefill")
        elif isinstance(msg, Post):
            self._post(msg)
        elif isinstance(msg, Abort):
            pair = self._pair_of(msg.peer, msg.peer_inc, msg.gen)
            if pair is not None:
                pair.dead = msg.why or "aborted by rank 0"
                with pair.io:
                    self.payload.abort(pair)
        elif isinstance(msg, Release):
            pair = self._pair_of(msg.peer, msg.peer_inc, msg.gen)
            if pair is not None:
                del self.pairs[msg.peer]
                self._drop(pair)

    def _pair_of(self, peer: str, peer_inc: int, gen: int) -> Pair | None:
        """This rank's pair with `peer` if it is the one rank 0 names (see Release)."""
        pair = self.pairs.get(peer)
        return pair if pair is not None and (pair.peer_inc, pair.gen) == (peer_inc, gen) else None

    def _drop(self, pair: Pair) -> None:
        pair.waiter.stop()
        self.payload.release(pair)

    def _done(self, pair: Pair, b: _Bundle, side: str, completion: Completion, err: str | None = None) -> None:
        def report():
            e = err or completion.error() or ""
            self.group.rpc.notify(_ENC.encode(Done(pair.peer, pair.peer_inc, b.id, side, e)))
        pair.waiter.put(completion, report)

    def _post(self, msg: Post) -> None:
        pair = self.pairs.get(msg.peer)
        if pair is None:
            raise RuntimeError(f"a bundle from {msg.peer}, whose links this rank has not formed")
        b = _Bundle(msg.bundle, pair, _ids(msg.dst), msg.launches)
        with pair.io:
            completion, err = self.payload.post(pair, b)
        self._done(pair, b, "dst", completion, err)

    # -- prefill: the pass's shipment (the main thread, in the forward) -----------------------------
    def begin_pass(self, raw: bytes) -> None:
        self._pass = []
        if not raw:
            return
        for sb in _SHIPMENT.decode(raw):
            pair = self.pairs.get(sb.peer)
            if pair is None or (pair.peer_inc, pair.gen) != (sb.peer_inc, sb.gen):
                raise RuntimeError(f"a bundle for {sb.peer} (incarnation {sb.peer_inc}, pair generation {sb.gen}), "
                                   f"whose links this rank has not formed")
            self._pass.append(_Bundle(sb.bundle, pair, _ids(sb.src), sb.launches))

    def layer_done(self, layer: int | None) -> None:
        """This rank's launches whose layers are written (every one left when layer is None)."""
        ready = None
        for b in self._pass:
            while b.issued < len(b.launches) and (layer is None or b.launches[b.issued].last_layer <= layer):
                if ready is None:
                    ready = self.payload.mark()
                if b.pair.dead is None:
                    with b.pair.io:
                        self.payload.issue(b.pair, b, b.launches[b.issued], ready)
                b.issued += 1

    def kv_done(self) -> None:
        self.layer_done(None)
        for b in self._pass:
            with b.pair.io:
                completion, _ = self.payload.seal(b.pair, b)
            self._done(b.pair, b, "src", completion, b.pair.dead)
        self._pass = []

    def close(self) -> None:
        for pair in list(self.pairs.values()):
            self._drop(pair)
        self.pairs.clear()


class AgentHost:
    """A follower's end of rank 0's transport calls (the group's RPC thread): the first Attach creates
    this rank's PayloadAgent over its KV cache, every later call drives it."""

    def __init__(self, group, kv_cache: Callable[[], torch.Tensor]):
        self.group, self.kv_cache = group, kv_cache
        self.agent: PayloadAgent | None = None
        group.rpc.on_call = self.on_call

    def on_call(self, body: bytes) -> bytes:
        msg = _CALLS.decode(body)
        if isinstance(msg, Attach):
            if self.agent is None:
                self.agent = PayloadAgent(self.group, kv_payload_view(self.kv_cache()), msg)
        elif self.agent is None:
            raise RuntimeError(f"a {type(msg).__name__} before this rank's transport was attached")
        else:
            self.agent.handle(msg)
        return b""

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()
