"""SenderSide's watch of broken pairs, without processes (the pairs themselves: test_pair_faults.py)."""

import logging
import time
from types import SimpleNamespace

from cluster.transport.sender_side import SenderSide


def test_a_broken_pair_whose_peer_never_beats_again_is_said_once(caplog):
    """A pair re-forms only after its peer's next heartbeat; a peer that serves on without beating
    would leave it unformed for good, silently. Past peer_timeout_s the watch says so, once per break,
    with the counts; a later break of the same pair is said again."""
    side = SimpleNamespace(_unformed_since={}, link=SimpleNamespace(worker_id="prefill-0",
                                                                     spec=SimpleNamespace(peer_timeout_s=0.05)))
    with caplog.at_level(logging.WARNING, logger="cluster.transport.sender_side"):
        SenderSide._note_unformed(side, "decode-1", 5, 5)
        assert not caplog.records  # within peer_timeout_s: the next beat may still come
        time.sleep(0.06)
        for _ in range(3):
            SenderSide._note_unformed(side, "decode-1", 5, 5)
        (said,) = caplog.records
        assert "decode-1" in said.getMessage() and "count is 5, 5 when the pair broke" in said.getMessage()
        SenderSide._note_unformed(side, "decode-1", 9, 9)  # the pair re-formed, and broke again
        time.sleep(0.06)
        SenderSide._note_unformed(side, "decode-1", 9, 9)
    assert len(caplog.records) == 2
