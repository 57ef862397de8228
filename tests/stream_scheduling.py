"""The test run on two pytest-xdist workers as two streams (pyproject's addopts: `-n 2 --dist loadscope
--no-loadscope-reorder`; tests/conftest.py says which test goes in which and registers `StreamPlugin`).

xdist's loadscope hands work out a scope at a time (a module) and never splits a scope between workers.
`StreamScheduling` is loadscope whose scope of a test is ONE_AT_A_TIME for the tests that must run one
at a time (a single scope, so one worker runs them all, in collection order) and its module for every
other test. The workers decide the streams (a test's stream depends on its fixtures, which only the
collecting process knows) and write them to a file the controller names in each worker's input; the
controller reads it at its first scheduling, after every worker has collected (each writes it before
it reports its collection).

The other stream runs at a lower CPU priority (`BACKGROUND_NICE`): a worker lowers its own (and so its
children's) once it starts a test of the other stream without having run a one-at-a-time test. So the
other modules take the CPU the one-at-a-time tests leave idle instead of slowing them down: those
tests keep the time bounds they have alone, and the run takes about as long as they do.

Not `--dist loadgroup` with xdist_group marks: with pytest 9.2 and pytest-xdist 3.8 the groups are
silently lost (xdist appends them to `item._nodeid`, which pytest no longer reads: pytest-xdist
issue #1386), and every test goes out alone.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import pytest
from xdist.scheduler import LoadScopeScheduling

ONE_AT_A_TIME = "one-at-a-time"
OTHER = "other"  # the modules run beside it, at BACKGROUND_NICE (a stream's name in the durations file)
BACKGROUND_NICE = 10  # CFS weight 110 against 1024: ~10 % of a core when both want it
STREAMS_FILE = "pdserve_streams_file"  # the key of the file's path in each worker's input


class StreamPlugin:
    """The hooks of the two streams; `one_at_a_time(item)` says which tests must not run beside each
    other (they go to one worker, in collection order)."""

    def __init__(self, one_at_a_time: Callable[[pytest.Item], bool]):
        self.one_at_a_time = one_at_a_time
        self.path: Path | None = None  # the controller's streams file
        self.ran_one_at_a_time = False  # in this process
        self.background = False  # this process runs at BACKGROUND_NICE

    def stream_of(self, item: pytest.Item) -> str:
        return ONE_AT_A_TIME if self.one_at_a_time(item) else OTHER

    def _streams_path(self) -> Path:
        if self.path is None:
            self.path = Path(tempfile.mkdtemp(prefix="pdserve-streams-")) / "streams.json"
        return self.path

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node):
        """The controller, before it starts a worker: where the worker writes each test's stream."""
        node.workerinput[STREAMS_FILE] = str(self._streams_path())

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_make_scheduler(self, config, log):
        if config.getvalue("dist") != "loadscope":
            return None
        return StreamScheduling(config, log, self._streams_path())

    @pytest.hookimpl(trylast=True)  # after the conftest's order: the scopes go out in it
    def pytest_collection_modifyitems(self, config, items):
        path = getattr(config, "workerinput", {}).get(STREAMS_FILE)
        if path:
            write_streams(path, {item.nodeid: ONE_AT_A_TIME if self.one_at_a_time(item) else item.nodeid.split("::")[0]
                                 for item in items})

    def pytest_runtest_setup(self, item):
        if self.one_at_a_time(item):
            self.ran_one_at_a_time = True
        elif not (self.background or self.ran_one_at_a_time) and hasattr(item.config, "workerinput"):
            # Only raised, never lowered back (an unprivileged process cannot): a worker that ran the
            # one-at-a-time stream keeps its priority for the modules it takes after it.
            os.nice(BACKGROUND_NICE)
            self.background = True

    def pytest_unconfigure(self, config):
        if self.path is not None:
            shutil.rmtree(self.path.parent, ignore_errors=True)


def write_streams(path: str | os.PathLike, scopes: dict[str, str]) -> None:
    """A worker's {node id: scope}. Both workers write the same map: each replaces the file whole."""
    tmp = Path(f"{path}.{os.getpid()}")
    tmp.write_text(json.dumps(scopes))
    tmp.replace(path)


class StreamScheduling(LoadScopeScheduling):
    def __init__(self, config, log, path: Path):
        super().__init__(config, log)
        self.path = path
        self._scopes: dict[str, str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        # First called by schedule(), once every worker's collection is in (so the file is written);
        # read once, so that a test's scope never changes during the run.
        if self._scopes is None:
            self._scopes = json.loads(self.path.read_text()) if self.path.is_file() else {}
        return self._scopes.get(nodeid) or super()._split_scope(nodeid)
