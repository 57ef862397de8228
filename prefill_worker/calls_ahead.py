"""CallsAhead: a prefill worker's `attach` and `abort` calls that came before their prompt's `submit`.

The router dispatches a prompt (`submit`) before its decode worker reserves blocks for it, and hands
the reservation over a Ray round trip later (`attach`, router/requests/placement_walk.py); when it
gives a dispatch up it sends `abort`. The three are sent in that order, but the prefill actor is an
asyncio actor, and Ray runs an async actor's calls in no fixed order (its out-of-order scheduling
queue: a later call can start first, under load it does). So a prefill worker can hear of a
reservation, or of an abort, for a prompt it has not been given yet.

Without this ledger an early `attach` was taken for the reservation of a prompt already gone and
aborted at once; the prompt, submitted a moment later, waited for a reservation that never came
(CI: a streamed request hung for 60 s on the router's fake cluster). Here:
- an `attach` for an id never seen waits (`hold`) until its `submit` takes it (`take`), at most
  `wait_s`; past that its decode worker is told there is no KV (`expired`), as for a prompt gone;
- an `attach` for an id that ended a moment ago (`ended`: finished, failed or aborted) is for a
  prompt gone indeed (a walk that gave the prompt up while its decode worker reserved): aborted at once;
- an `abort` that finds no job is counted (a tombstone, kept `wait_s`): the next `submit` of that
  id ends at once instead of computing a prompt nobody waits for. Counted, not a flag, and also for
  an id that ended: a walk that gives a prompt up and comes back to this worker sends submit, abort,
  submit, abort, ... of one id, and each abort may overtake its submit.
An id submitted again after it ended is live again (`take` forgets that it ended). If the attach of
such a second submit overtakes it, it is taken for a prompt gone and aborted: the decode worker
fails the request, which the router migrates (exact), never a hang. (A walk comes back to a worker
only after a poll interval, far longer than the reorders seen.)

Bounded: at most `max_entries` ids of each kind; past that an early attach is refused (aborted, as
for a prompt gone: a migration), the oldest tombstone or ended id is forgotten. Not thread-safe: the
caller holds its lock.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable

from cluster.wire.messages import Reservation


class CallsAhead:
    def __init__(self, wait_s: float = 30.0, max_entries: int = 65536, clock: Callable[[], float] = time.monotonic):
        self.wait_s = wait_s
        self.max_entries = max_entries
        self.clock = clock
        self._held: OrderedDict[str, tuple[Reservation, float]] = OrderedDict()  # id -> (reservation, deadline)
        self._aborted: OrderedDict[str, tuple[int, float]] = OrderedDict()  # id -> (aborts, deadline)
        self._ended: OrderedDict[str, None] = OrderedDict()

    def ended(self, request_id: str) -> None:
        """The prompt of this id is over here (its result is set)."""
        self._ended[request_id] = None
        self._ended.move_to_end(request_id)
        self._trim(self._ended)

    def hold(self, request_id: str, reservation: Reservation) -> bool:
        """An `attach` that found no job: True if it is held for the submit to come; False if the
        prompt ended already (the caller aborts the reservation) or one is held already for it."""
        if request_id in self._ended or request_id in self._held or len(self._held) >= self.max_entries:
            return False
        self._held[request_id] = (reservation, self.clock() + self.wait_s)
        return True

    def abort_ahead(self, request_id: str) -> Reservation | None:
        """An `abort` that found no job: the next submit of the id, if it comes within `wait_s`, ends
        at once. Returns a reservation held for the id (the caller aborts it now: no KV will come)."""
        count = self._aborted.pop(request_id, (0, 0.0))[0]
        self._aborted[request_id] = (count + 1, self.clock() + self.wait_s)
        self._trim(self._aborted)
        held = self._held.pop(request_id, None)
        return held[0] if held is not None else None

    def take(self, request_id: str) -> tuple[Reservation | None, bool]:
        """At `submit`: (the reservation an earlier attach brought or None, whether an earlier
        abort ended it). The id is live again."""
        self._ended.pop(request_id, None)
        held = self._held.pop(request_id, None)
        count, deadline = self._aborted.get(request_id, (0, 0.0))
        if count > 1:
            self._aborted[request_id] = (count - 1, deadline)  # (in place: the order stays the deadlines')
        elif count:
            del self._aborted[request_id]
        return (held[0] if held is not None else None), count > 0

    def expired(self) -> list[tuple[str, Reservation]]:
        """Held reservations whose submit did not come within `wait_s` (the caller aborts them);
        forgets expired tombstones too. Called on every attach: it reads only what expired, as both
        maps hold their entries in deadline order (each entry is added at the end with now + wait_s,
        and only `take` changes one in place)."""
        now = self.clock()
        gone = []
        while self._held and next(iter(self._held.values()))[1] <= now:
            rid, (res, _) = self._held.popitem(last=False)
            gone.append((rid, res))
        while self._aborted and next(iter(self._aborted.values()))[1] <= now:
            self._aborted.popitem(last=False)
        return gone

    def __len__(self) -> int:
        return len(self._held) + sum(n for n, _ in self._aborted.values())

    def _trim(self, entries: OrderedDict) -> None:
        while len(entries) > self.max_entries:
            entries.popitem(last=False)
