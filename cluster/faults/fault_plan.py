"""FaultPlan: the decode worker's one fault seam (tests, chaos; None in production).

DecodeWorker.inject_fault arms a fault in the worker's FaultPlan (made on first use). The decode loop
consults the plan at one place per iteration, with that iteration's deltas before they are published
(`cut`); it returns the deltas to publish and the fault to fire right after publishing, or None:
- "loop" without a token count: fires at the next iteration;
- a TokenCountFault: when the first matching request reaches exactly K tokens in the deltas, its later
  tokens in that batch are cut and the fault fires: the client has exactly K tokens.
What fired is kept in `fired` (stats()["extra"]["faults_fired"]; the actor carries the plan over a
restart in place).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from cluster.wire.messages import TokenDelta
from cluster.engine.sequence import Sequence


@dataclass(frozen=True)
class TokenCountFault:
    """Fault injection keyed on what a client has received (tests, chaos): fires once, when the first
    matching request reaches exactly `after_tokens` tokens, counting the tokens it resumed from after a
    migration (so a request moved at that point never fires it again). The batch carrying that token
    is published (with none of the request's later tokens), then the fault happens before anything
    else is: the client has exactly `after_tokens` tokens.

    kind "loop": the decode loop raises (its requests are lost, the loop restarts);
    kind "restart": the worker's state dies at once as in a crash (nothing more is published, no
    request is failed by the worker itself) and `DecodeWorker.on_restart` brings up a new incarnation."""

    kind: str
    after_tokens: int
    seed: int | None = None  # only the request sampled with this seed (None: any request)


class FaultPlan:
    """The armed faults (an immediate "loop", at most one TokenCountFault) and what the fired ones did.
    Arming and disarming happen under its own lock (any thread); `cut` runs on the loop thread."""

    def __init__(self):
        self._lock = threading.Lock()
        self.now: TokenCountFault | None = None  # inject_fault("loop"): fires at the next iteration
        self.armed: TokenCountFault | None = None  # inject_fault(kind, after_tokens=K)
        self.fired: list[dict] = []  # what the injected faults did (stats()["extra"]["faults_fired"])

    def arm(self, kind: str, after_tokens: int | None, seed: int | None, can_restart: bool) -> None:
        """Arms the fault in place of any armed one of its kind; ValueError if it is not one
        (`can_restart`: whether the worker has an `on_restart`; without one, "restart" is refused)."""
        if kind == "loop" and after_tokens is None:
            with self._lock:
                self.now = TokenCountFault(kind, 0)
            return
        if kind not in ("loop", "restart"):
            raise ValueError(f"unknown fault {kind!r}")
        if after_tokens is None:
            raise ValueError(f"fault {kind!r} needs after_tokens")
        if after_tokens < 1:
            raise ValueError("after_tokens must be >= 1")
        if kind == "restart" and not can_restart:
            raise ValueError("this worker cannot restart in place (no on_restart)")
        with self._lock:
            self.armed = TokenCountFault(kind, after_tokens, seed)

    def disarm(self) -> None:
        with self._lock:
            self.now = self.armed = None

    def cut(self, deltas: list[TokenDelta], sequences: Callable[[], dict[str, Sequence]],
            step: int) -> tuple[list[TokenDelta], TokenCountFault | None]:
        """The armed faults against this iteration's deltas (loop thread, before they are published;
        `sequences()`: the worker's requests by id, `step`: the loop's step count, for the record): an
        immediate fault is returned at once; when a matching request reaches exactly `after_tokens`
        tokens here, its later tokens in the batch are cut and the fault is returned (disarmed)."""
        with self._lock:
            now, self.now = self.now, None
            f = self.armed
        if now is not None:
            return deltas, now
        if f is None or not deltas:
            return deltas, None
        sequences = sequences()
        in_batch: dict[str, int] = {}
        for d in deltas:
            if d.token_ids:
                in_batch[d.request_id] = in_batch.get(d.request_id, 0) + len(d.token_ids)
        target = None
        for rid, n in in_batch.items():
            seq = sequences.get(rid)  # (one that finished in this batch is not here: its end is not a fault point)
            if seq is None or (f.seed is not None and seq.seed != f.seed):
                continue
            before = seq.resumed_tokens + len(seq.output_token_ids) - n  # tokens it had sent before this batch
            if before < f.after_tokens <= before + n:
                target, keep = rid, f.after_tokens - before
                break
        if target is None:
            return deltas, None
        out = []
        for d in deltas:
            if d.request_id == target and d.token_ids:
                if keep <= 0:
                    continue
                if len(d.token_ids) > keep:
                    d = TokenDelta(d.request_id, d.token_ids[:keep], None, None,
                                   None if d.logprobs is None else d.logprobs[:keep], d.prompt_logprobs)
                keep -= len(d.token_ids)
            out.append(d)
        with self._lock:
            self.armed = None
        self.fired.append({"kind": f.kind, "after_tokens": f.after_tokens, "seed": f.seed,
                           "request_id": target, "step": step})
        return out, f
