"""Every test run's per-test seconds, wall and CPU, in a file (registered by tests/conftest.py)."""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable

import psutil
import pytest


def tree_cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user + system) of a process and every live descendant, with the children each has
    reaped: a test's Ray (its GCS, raylet and actors), servers and ranks are descendants of the test
    process. Not counted: a descendant that outlives its parent and is re-parented away, e.g. the
    actors of a Ray whose raylet is stopped before them (a test that starts its own Ray, in its own
    process or a `pdserve serve`): such tests' figures are low."""
    root = psutil.Process(pid)
    total = 0.0
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.Error:  # gone meanwhile
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


class DurationRecorder:
    """Writes each test's seconds (setup + call + teardown) and CPU seconds (tree_cpu_s: the test process
    and what it started), slowest first, to .pytest_durations.json in
    the root of the run (PDSERVE_TEST_DURATIONS moves it), every run: loadtest/fresh_install.py keeps
    the slowest in loadtest/results/fresh_install.json. With `stream_of` (tests/conftest.py: the run's
    stream of a test, tests/stream_scheduling.py) each test carries its stream and the file sums the
    seconds of each: the one-at-a-time stream's sum is about the run's length. A plugin object, not
    module state: a pytest session started inside a test (a test that runs pytest itself) records its own."""

    FILE = ".pytest_durations.json"

    def __init__(self, config, stream_of: Callable[[pytest.Item], str] | None = None):
        self.config = config
        self.stream_of = stream_of
        self.seconds: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = {}
        self.stream: dict[str, str] = {}
        self.outcome: dict[str, str] = {}
        self._cpu_start: dict[str, float] = {}

    # In the process that runs the test (an xdist worker): its CPU seconds, from its setup's start to
    # its teardown's end, travel to the controller in the teardown report's user_properties. A fixture
    # shared by a module or the session is charged to the test that sets it up or tears it down.
    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item):
        self._cpu_start[item.nodeid] = tree_cpu_s()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        start = self._cpu_start.pop(item.nodeid, None) if call.when == "teardown" else None
        if start is not None:
            outcome.get_result().user_properties.append(("cpu_s", round(tree_cpu_s() - start, 3)))
            if self.stream_of is not None:
                outcome.get_result().user_properties.append(("stream", self.stream_of(item)))

    def pytest_runtest_logreport(self, report):
        # Under pytest-xdist the controller gets every worker's reports here too.
        nodeid = report.nodeid
        self.seconds[nodeid] += report.duration
        if report.when == "call" or report.outcome != "passed":
            self.outcome.setdefault(nodeid, report.outcome)
        props = dict(getattr(report, "user_properties", ())) if report.when == "teardown" else {}
        if props.get("cpu_s") is not None:
            self.cpu[nodeid] = props["cpu_s"]
        if props.get("stream") is not None:
            self.stream[nodeid] = props["stream"]

    def pytest_sessionfinish(self, session, exitstatus):
        if hasattr(self.config, "workerinput") or not self.seconds:  # an xdist worker: its controller writes
            return
        path = Path(os.environ.get("PDSERVE_TEST_DURATIONS") or Path(self.config.rootpath) / self.FILE)
        tests = sorted(({"test": k, "seconds": round(v, 3), "cpu_seconds": self.cpu.get(k),
                         "outcome": self.outcome.get(k, "passed"),
                         **({"stream": self.stream[k]} if k in self.stream else {})}
                        for k, v in self.seconds.items()), key=lambda t: -t["seconds"])
        streams: dict[str, dict] = {}
        for t in tests:
            if "stream" in t:
                s = streams.setdefault(t["stream"], {"tests": 0, "seconds": 0.0})
                s["tests"] += 1
                s["seconds"] = round(s["seconds"] + t["seconds"], 3)
        path.write_text(json.dumps({"when": time.strftime("%Y-%m-%dT%H:%M:%S"), "exit_status": int(exitstatus),
                                    "streams": streams, "tests": tests}, indent=1) + "\n")
