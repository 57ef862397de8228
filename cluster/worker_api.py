"""The worker interface: every method a prefill or decode worker offers the router and the launcher.

Both Ray actors implement it (decode_worker/actor.py: DecodeWorkerActor, prefill_worker/actor.py:
PrefillWorkerActor; tests/cluster/test_worker_api.py checks every signature against these Protocols).
The router calls the workers through router.workers.worker_client.WorkerClient, whose methods are these,
awaitable and under a per-call timeout; the launcher calls them on the Ray handles
(`handle.warmup.remote()`). A method is called by name nowhere.

Over Ray every call is asynchronous whatever the method: an `async def` here is a method the actor
runs on its own event loop (many in flight at once), a plain `def` one the actor runs in turn. Only
the messages of cluster/wire/messages.py (and plain values) cross.

Serving only: what the tests and the chaos run call besides (fault injection, the block-accounting
check) is the fault interface, cluster/faults/fault_control.py, which the actors also implement.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from cluster.wire.messages import (GenerateRequest, KVCacheEvents, PrefillResult, PrefillTask, Reservation, ReserveRequest,
                              WorkerStats)

if TYPE_CHECKING:  # torch behind it: the API-server processes import this module without it
    from cluster.transport.factory import TransportSpec


class WorkerAPI(Protocol):
    """What workers of both roles offer."""

    def stats(self) -> WorkerStats:
        """Load, capacity and measured rates (`extra["incarnation"]`: new on every restart of the
        actor's process). The router polls it; a call that fails counts against the worker's health."""
        ...

    def kv_events(self, epoch: str | None, seq: int) -> KVCacheEvents:
        """The prefix cache's block changes since (epoch, seq) (router.placement.kv_index)."""
        ...

    def abort(self, request_id: str) -> None:
        """Drops the request if the worker holds it (its KV blocks go back to the pool); unknown ids
        are ignored."""
        ...

    def peer_died(self, peer: str, why: str) -> None:
        """A worker of the other role died: KV transfers with it end now (the router heard it from Ray
        before the transport's heartbeat would tell)."""
        ...

    def init_transport(self, spec: TransportSpec) -> None:
        """Joins the cluster's KV transport (once per incarnation: a second call keeps it)."""
        ...

    def transfer_metrics(self) -> dict:
        """The KV transport's counters and recent transfers ({} without a transport)."""
        ...

    def shutdown(self) -> None:
        ...


class DecodeWorkerAPI(WorkerAPI, Protocol):
    """A decode worker: holds KV for prompts prefilled elsewhere, or prefills them itself."""

    def ready(self) -> bool:
        """Returns once the model is loaded and the graphs are captured."""
        ...

    def warmup(self) -> dict:
        """Before serving: prefill shapes, the local-prefill path and a decode step of every graph
        variant."""
        ...

    def reserve(self, req: ReserveRequest) -> Reservation | None:
        """Holds KV blocks for the prompt, which `req.prefill_worker_id` will compute and send; None
        when the worker has no room now."""
        ...

    def submit_local(self, req: GenerateRequest) -> int | None:
        """Takes the request with its prompt prefilled here (in chunks between decode steps): the
        prompt tokens found in the prefix cache, or None when the worker has no room now."""
        ...

    def fail(self, request_id: str, error: str) -> None:
        """Drops the request like `abort`, but its stream ends with `error` (an error finish, not an
        abort). The router tells the request's gateway the same error on its own channel; whichever
        of the two reaches the gateway first, it says what happened."""
        ...

    def lost(self, request_id: str) -> bool:
        """Whether the worker dropped the request through a failure of its own (its loop failed), so
        that the router moves it like a dead worker's."""
        ...

    def step_metrics(self) -> dict:
        """The decode loop's per-step counters and histograms."""
        ...


class PrefillWorkerAPI(WorkerAPI, Protocol):
    """A prefill worker: computes prompts and ships their KV into decode workers' reserved blocks."""

    async def connect_transport(self, decode_worker_ids: list[str]) -> dict[str, float]:
        """Forms and warms the KV channel to every decode worker (seconds each). Off the actor's
        event loop: `peer_died` still reaches it while a pair forms (a peer dying then fails that pair
        at once)."""
        ...

    async def warmup(self) -> dict:
        """Before serving: every prefill shape class."""
        ...

    async def submit(self, task: PrefillTask) -> PrefillResult:
        """Computes the prompt, ships its KV into `task.reservation`'s blocks (or, with none, those
        `attach` names later: the prompt is computed and its first token sent meanwhile), returns
        the first token and the timings once the KV left (a prompt it cannot run, or whose transfer
        failed: ok=False and `error`)."""
        ...

    async def lifeline(self, incarnation: str) -> str:
        """Returns (why) only when this worker shuts down; raises at once if it is not `incarnation`.
        The router keeps one pending per worker it sends frames to (cluster/wire/prefill_dispatch.py):
        the call fails when the actor dies or restarts, which fails the dispatches still unanswered,
        as a Ray call per prompt would."""
        ...

    def attach(self, request_id: str, reservation: Reservation) -> None:
        """The reservation for a prompt submitted without one. A prompt the worker no longer has
        (aborted, failed) gets the reservation aborted (its decode worker frees the blocks)."""
        ...
