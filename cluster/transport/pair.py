"""One prefill-decode pair as either side of a KV transport sees it, the error that ends it,
and the claim entries of its transfers in the store (control.py's docstring has the whole layout).

Both sides import this module and nothing above it: the sender side (sender_side.py) claims with
CLAIM or ABORT, the receiver side (receiver_side.py) cancels with CANCEL, on the same key.
"""

from __future__ import annotations

import threading
from typing import Any

from cluster.transport.channel import Outbox
from cluster.transport.completion import Waiter

CLAIM, ABORT, CANCEL = b"P", b"A", b"C"


def down_key(namespace: str, prefill: str, prefill_inc: int, decode: str, decode_inc: int) -> str:
    """{ns}/down/P.i/D.j: the last generation of the pair between incarnation i of P and incarnation j
    of D that D broke (a stalled or failed payload): the prefill re-forms the pair once it reads it (its
    watch thread). Both incarnations: a restarted P (same worker id, generation 0 again) must not read
    its previous incarnation's note and break its new pair."""
    return f"{namespace}/down/{prefill}.{prefill_inc}/{decode}.{decode_inc}"


def verdict_key(namespace: str, prefill: str, prefill_inc: int, decode: str, decode_inc: int, gen: int = 0) -> str:
    """The decode side's answer to a prefill's hello ("ok", or why it refuses the pair, e.g. its staging
    memory is spent), which the prefill reads before it forms its half of the payload channel: a
    refused pair fails fast on both sides instead of at a rendezvous timeout. Per pair generation (a
    broken pair formed anew between the same incarnations says hello again). Connecting only."""
    return f"{namespace}/verdict/{prefill}.{prefill_inc}/{decode}.{decode_inc}/g{gen}"


def claim_key(namespace: str, prefill: str, decode: str, decode_inc: int, seq: int) -> str:
    """{ns}/x/P/D.i/s: transfer s from prefill P to incarnation i of decode D. The decode incarnation
    is part of the key, so no key of an old incarnation is ever taken for a new transfer."""
    return f"{namespace}/x/{prefill}/{decode}.{decode_inc}/{seq}"


class PeerDeadError(RuntimeError):
    """The peer shut down, stopped heart-beating, or broke the pair's channel."""


class Pair:
    """One prefill-decode pair as this side sees it."""

    def __init__(self, peer: str, me: str):
        self.peer = peer
        self.peer_inc = 0  # the peer's incarnation this pair was formed with
        self.gen = 0  # the pair's generation (a broken pair between the same incarnations is re-formed)
        self.order = threading.Lock()  # prefill: held from a bundle's begin until its last launch is issued
        self.io = threading.Lock()  # the payload channel is used by one thread at a time (abort included)
        self.outbox: Outbox | None = None
        self.payload: Any = None  # the payload's per-pair state (payload.py)
        self.spec: Any = None  # the pair's PlanSpec (plan.py): both sides' layouts and tensor-parallel sizes
        self.waiter = Waiter(f"kv-wait-{me}-{peer}")
        self.bundles: list = []  # in flight: out_bundle.OutBundle or in_bundle.InBundle
        self.dead: str | None = None
        self.wedged = False  # fault "stuck_transfer" (prefill side): nothing goes out on it any more
