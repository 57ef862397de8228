"""The run's two streams (tests/stream_scheduling.py) on real pytest-xdist workers: a small suite in a
subprocess, `-n 2 --dist loadscope --no-loadscope-reorder` as pyproject's addopts, whose tests record
which worker ran them, and at which priority."""

from __future__ import annotations

import json
import os
from pathlib import Path

from stream_scheduling import BACKGROUND_NICE

pytest_plugins = ["pytester"]

TESTS = Path(__file__).resolve().parent

RECORDING_TEST = """
import json, os, time
import pytest

{mark}
@pytest.mark.parametrize("i", range(3))
def test_{name}(i):
    time.sleep({sleep})
    with open(os.environ["RECORD"], "a") as f:
        f.write(json.dumps({{"module": "{name}", "i": i, "worker": os.environ["PYTEST_XDIST_WORKER"],
                            "nice": os.nice(0)}}) + "\\n")
"""


def test_one_at_a_time_tests_run_on_one_worker_in_order_and_the_other_modules_beside_them(pytester, monkeypatch):
    record = pytester.path / "record.jsonl"
    monkeypatch.setenv("RECORD", str(record))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p))
    pytester.makeini("[pytest]\nmarkers =\n    solo: one at a time\n")
    pytester.makeconftest("""
from stream_scheduling import StreamPlugin

def pytest_configure(config):
    config.pluginmanager.register(StreamPlugin(lambda item: item.get_closest_marker("solo") is not None), "streams")
""")
    # Collected in name order: the solo modules first, as tests/conftest.py sorts the cluster stream.
    for name in ("a_solo", "b_solo", "c_solo"):
        pytester.makepyfile(**{f"test_{name}": RECORDING_TEST.format(mark="@pytest.mark.solo", name=name, sleep=0.3)})
    for name in ("d", "e", "f"):
        pytester.makepyfile(**{f"test_{name}": RECORDING_TEST.format(mark="", name=name, sleep=0.05)})
    result = pytester.runpytest_subprocess("-p", "xdist", "-n", "2", "--dist", "loadscope", "--no-loadscope-reorder", "-v")
    result.assert_outcomes(passed=18)
    result.stdout.fnmatch_lines(["*scheduling tests via StreamScheduling*"])
    runs = [json.loads(line) for line in record.read_text().splitlines()]
    solo = [r for r in runs if r["module"].endswith("solo")]
    # One worker ran every solo test, one after another in collection order.
    assert len({r["worker"] for r in solo}) == 1
    assert [(r["module"], r["i"]) for r in solo] == [(m, i) for m in ("a_solo", "b_solo", "c_solo") for i in range(3)]
    # The other worker took the other modules while the solo stream ran (2.7 s of it against 0.45 s),
    # each module whole on one worker.
    others = {}
    for r in runs:
        if not r["module"].endswith("solo"):
            others.setdefault(r["module"], set()).add(r["worker"])
    assert all(len(w) == 1 for w in others.values()), others
    assert {w for ws in others.values() for w in ws} == {"gw0", "gw1"} - {solo[0]["worker"]}
    # ... at a lower priority: the solo tests at this process's, the others BACKGROUND_NICE lower.
    base = os.nice(0)
    assert {r["nice"] for r in solo} == {base}
    assert {r["nice"] for r in runs if r not in solo} == {min(19, base + BACKGROUND_NICE)}
