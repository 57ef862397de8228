"""RateLimitedLog: what a thread that fails every round (its store gone) says, and how often."""

from __future__ import annotations

import logging

from cluster.wire.socket_bounds import RateLimitedLog


def test_one_line_per_interval_with_the_count_and_the_traceback(caplog):
    log = logging.getLogger("test.rate_limited")
    said = RateLimitedLog(log, interval_s=3600.0)
    with caplog.at_level(logging.WARNING, logger="test.rate_limited"):
        for _ in range(50):
            try:
                raise ConnectionError("store gone")
            except ConnectionError:
                said.warn("round failed on %s", "p", exc_info=True)
        (first,) = caplog.records
        assert first.getMessage() == "round failed on p" and first.exc_info[0] is ConnectionError
        said._next = 0.0  # the interval is over
        said.warn("round failed on %s", "p")
    second = caplog.records[1]
    assert second.getMessage() == "round failed on p (49 more like it in the last 3600 s)"
    assert not second.exc_info
