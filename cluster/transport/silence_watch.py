"""SilenceWatch: THE rule for calling a peer silent from its heartbeat counts (the KV transport's links,
cluster/transport/link.py, and a tensor-parallel group's ranks, cluster/distributed/watchdog.py).

A peer is silent for the time it has been *watched* without news: a look that finds its count where the
last look left it. Silence counts only over continuous watching. A look after a gap of timeout_s/2 or
more (the watcher looked elsewhere, or its thread did not run) starts the count again: it says nothing
about the gap, because what it read may be a forged or replayed record standing at that moment (a
store client without the cluster's secret can put one there; the readers take it as no news). Counting
the gap killed a beating peer: a sender that looked only while transfers were in flight met a replay on
its first look after an idle second, and called the peer "silent for 0.5s" (one CI run). So a dead peer
is found within timeout_s of watching, and a forgery has to stand that long, as a partition would.

Counts are monotone: the caller drops replays (an older count) before it looks. Not thread-safe: the
caller serializes its looks.
"""

from __future__ import annotations

from collections.abc import Hashable

MIN_BEATS = 4  # a peer is dead only after missing several beats


def check_timing(heartbeat_s: float, timeout_s: float) -> None:
    """A watcher that looks every heartbeat_s must see gaps well under timeout_s/2, or every look
    would start the count again and no peer would ever be found dead."""
    if heartbeat_s <= 0 or timeout_s < MIN_BEATS * heartbeat_s:
        raise ValueError(f"peer_timeout_s={timeout_s} must span at least {MIN_BEATS} heartbeats "
                         f"(heartbeat_s={heartbeat_s}): a peer is dead only after missing several")


class SilenceWatch:
    def __init__(self, timeout_s: float):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.timeout_s = timeout_s
        self._peers: dict[Hashable, tuple[object, float, float]] = {}  # peer -> (count, no news since, last look)

    def look(self, peer: Hashable, count: object, now: float) -> float:
        """Records a look at `peer`, whose latest count is `count` (None: none yet); returns the seconds
        it has been watched without news (0.0 on news)."""
        prev = self._peers.get(peer)
        since = now if prev is None or count != prev[0] or now - prev[2] >= self.timeout_s / 2 else prev[1]
        self._peers[peer] = (count, since, now)
        return now - since

    def silent(self, peer: Hashable, count: object, now: float) -> float | None:
        """look(), and the seconds silent if that is past timeout_s (the peer is presumed dead), else None."""
        quiet = self.look(peer, count, now)
        return quiet if quiet > self.timeout_s else None

    def forget(self, peer: Hashable) -> None:
        self._peers.pop(peer, None)
