"""The fault interface: what the worker actors offer the reliability tests and the chaos run besides
serving (cluster/worker_api.py holds the serving interface). The router never calls these; the
actors implement both, and tests/cluster/test_worker_api.py checks each exactly and that no router
module calls a method of this one.

Like the serving interface, a call crosses Ray (`handle.inject_fault.remote(...)`); only plain values
cross."""

from __future__ import annotations

from typing import Protocol


class FaultControl(Protocol):
    """What workers of both roles offer the tests and the chaos run."""

    def check_blocks(self) -> None:
        """Raises if the KV block accounting is inconsistent (after a fault: nothing leaked)."""
        ...

    def inject_transport_fault(self, kind: str, seconds: float = 0.0) -> None:
        """Arms one fault in the KV transport (cluster/transport/transport_faults.py): a prefill
        worker's "transfer" / "stuck_transfer", a decode worker's "slow_hello"."""
        ...


class DecodeFaultControl(FaultControl, Protocol):
    """A decode worker's faults: its loop's (fault_plan.py)."""

    def inject_fault(self, kind: str, after_tokens: int | None = None, seed: int | None = None) -> None:
        """"loop", "restart"; with `after_tokens`: right after a request has sent exactly that many
        tokens (fault_plan.TokenCountFault)."""
        ...

    def clear_faults(self) -> None:
        """Disarms the injected faults that have not fired."""
        ...
