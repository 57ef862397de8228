"""WorkerSet: the router's workers by role, on CPU."""

from __future__ import annotations

import pytest

from router.workers.worker_client import WorkerClient
from router.workers.worker_set import WorkerSet


def client(wid: str, role: str) -> WorkerClient:
    return WorkerClient(wid, role, object())


def test_workers_by_role_in_join_order():
    ws = WorkerSet([client("p0", "prefill")], [client("d1", "decode"), client("d0", "decode")])
    assert ws.ids("prefill") == ["p0"] and ws.ids("decode") == ["d1", "d0"]
    assert [v.worker_id for v in ws.of("decode")] == ["d1", "d0"]
    assert not any(v.healthy for v in ws.views.values())  # until a poll answers
    v = ws.add(client("d2", "decode"))
    assert ws.views["d2"] is v and v.role == "decode" and ws.ids("decode")[-1] == "d2"
    assert ws.remove("d1").worker_id == "d1"
    assert "d1" not in ws.views and "d1" not in ws.clients and ws.ids("decode") == ["d0", "d2"]


def test_ids_are_unique_and_roles_known():
    with pytest.raises(ValueError, match="unique"):
        WorkerSet([client("w", "prefill")], [client("w", "decode")])
    ws = WorkerSet([], [client("d0", "decode")])
    with pytest.raises(ValueError, match="already in use"):
        ws.add(client("d0", "decode"))
    with pytest.raises(ValueError, match="role"):
        ws.add(client("x", "encode"))


def test_healthy_peers_are_the_other_roles_healthy_workers():
    ws = WorkerSet([client("p0", "prefill"), client("p1", "prefill")], [client("d0", "decode")])
    ws.views["p1"].healthy = ws.views["d0"].healthy = True
    assert ws.healthy_peers("decode") == ["p1"]
    assert ws.healthy_peers("prefill") == ["d0"]
