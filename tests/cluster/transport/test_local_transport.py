"""The control plane in one process: the local (same-device) path, expect timeouts, cancels, aborts."""

import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import harness  # noqa: E402

from cluster.wire.messages import KVHeader, Reservation  # noqa: E402
from cluster.transport.factory import TransportSpec, create_transport  # noqa: E402


def test_spec_rejects_wildcard_store_address():
    with pytest.raises(ValueError):
        TransportSpec("torch_dist", store_host="0.0.0.0", store_port=1)


def _pair(ns, **kw):
    spec = TransportSpec("local", namespace=ns, heartbeat_s=0.05, **kw)
    src = torch.randn(2, 2, 16, 4, 2, 8)
    dst = torch.zeros(2, 2, 16, 4, 2, 8)
    return spec, src, dst, create_transport(spec, src, "p", "prefill"), create_transport(spec, dst, "d", "decode")


@pytest.mark.parametrize("dst_blocks", [(3, 4, 5, 6), (9, 2, 11, 6)])
def test_local_path_is_exact(dst_blocks):
    spec, src, dst, tp, td = _pair(f"exact{dst_blocks[1]}")
    res = Reservation("r", "d", dst_blocks, 0)
    td.expect(res, "p")
    st = tp.send(res, KVHeader("r", 0, 12, 5), [1, 2, 7], 5.0)
    (a,) = harness_wait(td, 1)
    assert a.error is None and a.header.first_token == 5 and st.bytes == 3 * tp.bytes_per_block
    assert torch.equal(dst[:, :, list(dst_blocks[:3])], src[:, :, [1, 2, 7]])
    assert tp.metrics()["transfers"] == 1 and td.metrics()["bytes"] == st.bytes
    tp.close(), td.close()


def test_expect_timeout_cancels_before_any_write():
    spec, src, dst, tp, td = _pair("late", expect_timeout_s=0.2)
    res = Reservation("r", "d", (3, 4), 0)
    td.expect(res, "p")
    (a,) = harness_wait(td, 1)
    assert a.header is None and "expect_timeout_s" in a.error
    with pytest.raises(TimeoutError, match="gave up"):
        tp.send(res, KVHeader("r", 0, 4, 5), [1], 5.0)
    # Nothing landed in blocks the decode side already took back (block 0, the NULL block, is where
    # warming the pair ran the copy kernel: garbage by design).
    assert not dst[:, :, 1:].any()
    tp.close(), td.close()


def test_prefill_abort_arrives_as_failed_header():
    spec, src, dst, tp, td = _pair("abort")
    res = Reservation("r", "d", (3, 4), 0)
    td.expect(res, "p")
    tp.send_abort(res, "r", 5.0)
    (a,) = harness_wait(td, 1)
    assert a.header is not None and not a.header.ok and a.error
    tp.close(), td.close()


def harness_wait(t, n, timeout=10.0):
    out, deadline = [], time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        out += t.poll_arrivals()
        time.sleep(0.005)
    return out
