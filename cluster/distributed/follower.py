"""RankFollower: the loop of a tensor-parallel follower rank: run every pass rank 0 announces, in order.

    follower = RankFollower(group, {PrefillPass: runner.execute, EagerDecode: runner.execute,
                                    DecodeStep: graph_runner.replay_step})
    follower.run()          # until Stop (or the group breaks)

Between messages it waits `heartbeat_s` at a time and looks at the group's watchdog; a pass that raises
breaks the group (`TPGroup.fail`): the follower's collectives would no longer pair up with rank 0's.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from cluster.distributed.step_messages import Stop

log = logging.getLogger(__name__)


class RankFollower:
    def __init__(self, group, handlers: dict[type, Callable]):
        self.group = group
        self.handlers = handlers
        self.passes = 0
        self.last_pass_at = 0.0
        self.stopped: str | None = None

    def run(self) -> str:
        """Returns why it stopped ("shutdown" from rank 0, or the group's failure)."""
        g = self.group
        while True:
            if g.failed is not None:
                self.stopped = g.failed
                return self.stopped
            msg = g.recv(g.rdv.heartbeat_s)
            if msg is None:
                continue
            if isinstance(msg, Stop):
                self.stopped = msg.why or "stopped"
                return self.stopped
            handler = self.handlers.get(type(msg))
            try:
                if handler is None:
                    raise RuntimeError(f"this follower runs no {type(msg).__name__}")
                with torch.inference_mode():
                    handler(msg)
            except Exception as e:  # noqa: BLE001 - the ranks diverged: the whole group goes
                log.exception("tensor-parallel rank %d failed a %s", g.rank, type(msg).__name__)
                g.fail(f"rank {g.rank} failed a {type(msg).__name__}: {type(e).__name__}: {e}")
                self.stopped = g.failed
                return self.stopped
            self.passes += 1
            self.last_pass_at = time.monotonic()
