"""RankWatchdog: the ranks of a tensor-parallel worker watch each other; one that dies takes the whole
worker down, within `peer_timeout_s`, whatever the others are doing.

Why the whole worker: a rank stuck in a collective with a dead peer cannot be unstuck (a one-shot
all-reduce spins on its peer's signal pad inside a CUDA graph; NCCL waits for its timeout), and a
group that lost a rank has lost part of every layer anyway. So each rank runs this thread, independent
of its main loop: every `heartbeat_s` it writes its next count in the group's store (hosted by rank 0's
process; sealed under the group's secret, AuthenticatedStore) and checks its peers' (rank 0 checks
every follower, a follower checks rank 0); a value that does not verify, or an older count (a replay),
is no news: a local user who reaches the store can make a rank look silent at most, never failed or
closed, nor a dead one alive for longer than it keeps overwriting. A peer whose count stalls for `peer_timeout_s` of
watching (cluster/transport/silence_watch.py), that marked itself failed, or a store that stops answering (rank
0's process is gone) calls `on_failure(why)`, which by default ends this process at once (os._exit:
nothing waits for a collective). Ray then restarts the worker's rank 0 (whose followers go with it:
they are its actors), the router migrates its requests (as for any dead worker), and the new rank 0
starts a new group.

A clean shutdown marks the rank's counter closed (negative) first, so its peers stop watching it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable

from cluster.transport.silence_watch import SilenceWatch, check_timing

log = logging.getLogger(__name__)

CLOSED = -(10**9)  # a rank's counter after a clean close
FAILED = -(2 * 10**9)  # ... after it gave up (its peers follow it down)
EXIT_CODE = 75  # a rank that ends its process because its group broke


def exit_process(why: str) -> None:
    """The default failure action: this rank's process ends now (Ray restarts the worker)."""
    try:
        log.critical("tensor-parallel group broken, ending this process: %s", why)
    finally:
        os._exit(EXIT_CODE)


class RankWatchdog(threading.Thread):
    def __init__(self, store_factory: Callable[[], object], namespace: str, rank: int, size: int,
                 heartbeat_s: float, peer_timeout_s: float, on_failure: Callable[[str], None] = exit_process):
        super().__init__(name=f"tp-watchdog-{rank}", daemon=True)
        check_timing(heartbeat_s, peer_timeout_s)
        self._store_factory = store_factory
        self.ns, self.rank, self.size = namespace, rank, size
        self.heartbeat_s, self.peer_timeout_s = heartbeat_s, peer_timeout_s
        self.on_failure = on_failure
        self.peers = list(range(1, size)) if rank == 0 else [0]
        self._halted = threading.Event()  # (not `_stop`: threading.Thread.join calls its own _stop())
        self.failed: str | None = None

    def key(self, rank: int) -> str:
        return f"{self.ns}/hb/{rank}"

    def run(self) -> None:
        try:
            store = self._store_factory()
        except Exception as e:  # noqa: BLE001
            self._fail(f"rank {self.rank} cannot reach its group's store: {type(e).__name__}: {e}")
            return
        counts: dict[int, int | None] = {p: None for p in self.peers}  # the latest count taken per peer
        silence = SilenceWatch(self.peer_timeout_s)  # (a peer that never beats: dead peer_timeout_s after the first look)
        count = 0
        while not self._halted.is_set():
            now = time.monotonic()
            try:
                count += 1
                store.set(self.key(self.rank), str(count))
                for p in list(counts):
                    raw = store.read(self.key(p))  # None: not there yet, or not sealed (no news)
                    v = int(raw) if raw is not None else None
                    if v == CLOSED:
                        del counts[p]  # left cleanly: nothing to watch
                        silence.forget(p)
                        continue
                    if v is not None and v <= FAILED:
                        self._fail(f"rank {p} of the group failed")
                        return
                    if v is not None and (counts[p] is None or v > counts[p]):  # (an older count: a replay)
                        counts[p] = v
                    quiet = silence.silent(p, counts[p], now)  # (silence_watch.py: only watched silence)
                    if quiet is not None:
                        self._fail(f"rank {p} of the group sent no heartbeat for {quiet:.1f}s "
                                   f"(peer_timeout_s={self.peer_timeout_s}): presumed dead")
                        return
            except Exception as e:  # noqa: BLE001 - rank 0's store is gone: so is rank 0
                if self._halted.is_set():
                    return
                self._fail(f"rank {self.rank} lost its group's store (rank 0's process): {type(e).__name__}: {e}")
                return
            self._halted.wait(self.heartbeat_s)

    def _fail(self, why: str) -> None:
        self.failed = why
        try:
            self._store_factory().set(self.key(self.rank), str(FAILED))
        except Exception:  # noqa: BLE001 - the store may be what failed
            pass
        self.on_failure(why)

    def stop(self, clean: bool = True) -> None:
        """Stops watching; with `clean`, marks this rank closed so its peers stop watching it."""
        self._halted.set()
        if clean:
            try:
                self._store_factory().set(self.key(self.rank), str(CLOSED))
            except Exception:  # noqa: BLE001
                pass
