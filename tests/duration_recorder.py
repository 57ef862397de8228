"""Every test run's per-test seconds, in a file (registered by tests/conftest.py)."""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from pathlib import Path


class DurationRecorder:
    """Writes each test's seconds (setup + call + teardown), slowest first, to .pytest_durations.json in
    the root of the run (PDSERVE_TEST_DURATIONS moves it), every run: loadtest/fresh_install.py keeps
    the slowest in loadtest/results/fresh_install.json. A plugin object, not module state: a pytest
    session started inside a test (a test that runs pytest itself) records its own."""

    FILE = ".pytest_durations.json"

    def __init__(self, config):
        self.config = config
        self.seconds: dict[str, float] = defaultdict(float)
        self.outcome: dict[str, str] = {}

    def pytest_runtest_logreport(self, report):
        # Under pytest-xdist the controller gets every worker's reports here too.
        nodeid = report.nodeid
        self.seconds[nodeid] += report.duration
        if report.when == "call" or report.outcome != "passed":
            self.outcome.setdefault(nodeid, report.outcome)

    def pytest_sessionfinish(self, session, exitstatus):
        if hasattr(self.config, "workerinput") or not self.seconds:  # an xdist worker: its controller writes
            return
        path = Path(os.environ.get("PDSERVE_TEST_DURATIONS") or Path(self.config.rootpath) / self.FILE)
        tests = sorted(({"test": k, "seconds": round(v, 3), "outcome": self.outcome.get(k, "passed")}
                        for k, v in self.seconds.items()), key=lambda t: -t["seconds"])
        path.write_text(json.dumps({"when": time.strftime("%Y-%m-%dT%H:%M:%S"), "exit_status": int(exitstatus),
                                    "tests": tests}, indent=1) + "\n")
