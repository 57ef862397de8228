"""TransportFaults: the faults armed in one KV transport (chaos and reliability tests arm them through
the worker's fault interface, cluster/faults/fault_control.py; in production none is ever armed).
Each side looks at one place: the sender when a bundle's first launch goes out, the receiver when a
pair forms."""

from __future__ import annotations

import threading
from collections import deque

# kind -> what it does (the side that fires it)
KINDS = {
    "prefill": {
        "transfer": "the next bundle's pair is killed right after its first launch (the payload channel torn "
                    "down as a failed link would be: the decode side's receives fail at once)",
        "stuck_transfer": "the next bundle's payload never moves (the pair's channel wedges: nothing more goes "
                          "out on it, both sides find the stall at transfer_timeout_s)",
    },
    "decode": {
        "slow_hello": "the next pair formed here waits `seconds` first (a window in which its prefill peer "
                      "can die while the pair forms)",
    },
}


class TransportFaults:
    """Armed faults, each fired once (`take`), and a record of those that fired."""

    def __init__(self, role: str):
        self.role = role
        self._lock = threading.Lock()
        self._armed: list[tuple[str, float]] = []
        self._count = 0
        self._fired: deque[dict] = deque(maxlen=64)  # kind, peer, pair generation

    def arm(self, kind: str, seconds: float = 0.0) -> None:
        kinds = tuple(KINDS[self.role])
        if kind not in kinds:
            raise ValueError(f"unknown KV transport fault {kind!r} for a {self.role} worker; choose from {kinds}")
        with self._lock:
            self._armed.append((kind, seconds))

    def take(self, kind: str, pair=None) -> float | None:
        """The armed fault of this kind (its seconds), now disarmed and recorded as fired on `pair`
        (a pair.Pair); None if none is armed."""
        with self._lock:
            for i, (k, sec) in enumerate(self._armed):
                if k == kind:
                    del self._armed[i]
                    self._count += 1
                    self._fired.append({"kind": kind, "peer": pair.peer if pair else None,
                                        "gen": pair.gen if pair else None})
                    return sec
        return None

    def metrics(self) -> dict:
        with self._lock:
            return {"faults_fired": self._count, "fired": list(self._fired)}
