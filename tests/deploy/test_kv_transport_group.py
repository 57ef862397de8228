"""form_kv_transport_group and the store's process: a group that fails to form stops the store it
started (no child left behind), and leaves alone one its caller started (the caller owns it)."""

from __future__ import annotations

import psutil
import pytest

from cluster.errors import PdserveError
from deploy import kv_transport_group
from deploy.config import ClusterConfig

SECRET = b"k" * 32


def _cfg() -> ClusterConfig:
    return ClusterConfig(model="/m", kv_transport="local", ready_timeout_s=60)


def test_a_group_that_fails_to_form_stops_the_store_it_started(monkeypatch):
    started, real = [], kv_transport_group.start_kv_store

    def start(*args):
        started.append(real(*args))
        return started[-1]
    monkeypatch.setattr(kv_transport_group, "start_kv_store", start)
    with pytest.raises(PdserveError, match="no init_transport"):
        kv_transport_group.form_kv_transport_group({"prefill-0": object()}, {"decode-0": object()}, _cfg(),
                                                   secret=SECRET, namespace="ns")
    assert len(started) == 1 and started[0].exited() == 0 and not psutil.pid_exists(started[0].pid)


def test_a_store_the_caller_started_is_the_callers():
    sp = kv_transport_group.start_kv_store(_cfg(), "127.0.0.1", SECRET, "ns")
    try:
        with pytest.raises(PdserveError, match="no init_transport"):
            kv_transport_group.form_kv_transport_group({"prefill-0": object()}, {"decode-0": object()}, _cfg(),
                                                       secret=SECRET, namespace="ns", store=sp)
        assert sp.exited() is None and sp.client().num_keys() >= 0
        assert kv_transport_group.form_kv_transport_group({}, {"decode-0": object()}, _cfg(), store=sp) is None
    finally:
        sp.stop()
