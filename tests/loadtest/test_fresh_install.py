"""fresh_install.py's dry run: one real run of a trivial command in a new venv on a fresh clone, and
--repeat's rows (N in a row, stopping at the first failure, replacing the commit's earlier rows); the
per-test seconds every pytest run writes, and the slowest 30 of them in a tests row."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from duration_recorder import DurationRecorder
from loadtest import fresh_install


@pytest.mark.slow  # a new venv (pip in it) and a clone
def test_a_run_is_a_new_venv_on_a_fresh_clone_without_this_sessions_environment(monkeypatch):
    monkeypatch.setitem(fresh_install.COMMANDS, "probe",
                        'python -c "import os, sys; print(sys.prefix, os.environ.get(\'PYTHONPATH\'), '
                        'os.environ[\'PDSERVE_HOME\'])" && test -f pyproject.toml && test -d .git && '
                        f'echo \'{{"tests": [{{"test": "t::a", "seconds": 1.5}}]}}\' > {fresh_install.DURATIONS}')
    monkeypatch.setenv("PYTHONPATH", "/somewhere/else")
    row = fresh_install.run("probe")
    assert row["ok"], row["log_tail"]
    prefix, pythonpath, home = row["log_tail"][-1].split()
    assert prefix.endswith("/v") and "pdserve-fresh-" in prefix and pythonpath == "None"
    assert home.startswith(os.path.dirname(prefix)) and not os.path.exists(prefix)  # removed after a pass
    assert row["slowest"] == [{"test": "t::a", "seconds": 1.5}]  # read from the clone's durations file


def test_every_run_writes_each_tests_seconds_and_a_row_keeps_the_slowest_30(tmp_path, monkeypatch):
    out = tmp_path / "durations.json"
    monkeypatch.setenv("PDSERVE_TEST_DURATIONS", str(out))
    rec = DurationRecorder(SimpleNamespace(rootpath=tmp_path))
    for i in range(40):
        for when, secs, outcome in (("setup", 0.5, "passed"), ("call", i, "failed" if i == 7 else "passed"),
                                    ("teardown", 0.25, "passed")):
            props = [("cpu_s", 2.0 * i)] if when == "teardown" and i % 2 else []  # (the worker's hook adds it)
            rec.pytest_runtest_logreport(SimpleNamespace(nodeid=f"t.py::test_{i}", when=when, duration=secs,
                                                         outcome=outcome, user_properties=props))
    rec.pytest_sessionfinish(None, 1)
    written = json.loads(out.read_text())
    assert written["exit_status"] == 1 and len(written["tests"]) == 40
    assert written["tests"][0] == {"test": "t.py::test_39", "seconds": 39.75, "cpu_seconds": 78.0, "outcome": "passed"}
    assert {"test": "t.py::test_7", "seconds": 7.75, "cpu_seconds": 14.0, "outcome": "failed"} in written["tests"]
    top = fresh_install.slowest(out)
    assert len(top) == fresh_install.SLOWEST == 30
    assert [t["test"] for t in top] == [f"t.py::test_{i}" for i in range(39, 9, -1)]
    assert top[0]["cpu_seconds"] == 78.0 and "cpu_seconds" not in top[1]  # (test_38: none recorded)
    assert fresh_install.slowest(tmp_path / "absent.json") == []
    assert written["streams"] == {} and fresh_install.stream_seconds(out) == {}  # no test said its stream
    # An xdist worker leaves the file to its controller.
    out.unlink()
    worker = DurationRecorder(SimpleNamespace(rootpath=tmp_path, workerinput={}))
    worker.pytest_runtest_logreport(SimpleNamespace(nodeid="t.py::x", when="call", duration=1.0, outcome="passed"))
    worker.pytest_sessionfinish(None, 0)
    assert not out.exists()


def test_each_tests_stream_is_recorded_and_summed(tmp_path, monkeypatch):
    """The worker's teardown report carries the test's stream (StreamPlugin.stream_of); the file sums each
    stream's seconds and a fresh_install row keeps the sums."""
    out = tmp_path / "durations.json"
    monkeypatch.setenv("PDSERVE_TEST_DURATIONS", str(out))
    rec = DurationRecorder(SimpleNamespace(rootpath=tmp_path))
    for i, (stream, secs) in enumerate([("one-at-a-time", 10.0), ("other", 2.0), ("one-at-a-time", 5.0), (None, 1.0)]):
        for when, d in (("setup", 0.5), ("call", secs), ("teardown", 0.25)):
            props = [("cpu_s", 1.0)] + ([("stream", stream)] if stream else []) if when == "teardown" else []
            rec.pytest_runtest_logreport(SimpleNamespace(nodeid=f"t.py::test_{i}", when=when, duration=d,
                                                         outcome="passed", user_properties=props))
    rec.pytest_sessionfinish(None, 0)
    written = json.loads(out.read_text())
    assert written["streams"] == {"one-at-a-time": {"tests": 2, "seconds": 16.5}, "other": {"tests": 1, "seconds": 2.75}}
    assert written["tests"][0] == {"test": "t.py::test_0", "seconds": 10.75, "cpu_seconds": 1.0, "outcome": "passed",
                                   "stream": "one-at-a-time"}
    assert "stream" not in next(t for t in written["tests"] if t["test"] == "t.py::test_3")
    assert fresh_install.stream_seconds(out) == written["streams"]
    assert fresh_install.stream_seconds(tmp_path / "absent.json") == {}


def test_the_stream_travels_in_the_teardown_report(tmp_path):
    """In the process that runs the test: the teardown report gets the test's stream beside its CPU seconds."""
    from stream_scheduling import ONE_AT_A_TIME, OTHER, StreamPlugin
    plugin = StreamPlugin(lambda item: item.name == "heavy")
    rec = DurationRecorder(SimpleNamespace(rootpath=tmp_path), stream_of=plugin.stream_of)
    got = {}
    for name in ("heavy", "light"):
        item = SimpleNamespace(nodeid=f"t.py::{name}", name=name)
        rec.pytest_runtest_setup(item)
        report = SimpleNamespace(user_properties=[])
        wrapper = rec.pytest_runtest_makereport(item, SimpleNamespace(when="teardown"))
        next(wrapper)
        with pytest.raises(StopIteration):
            wrapper.send(SimpleNamespace(get_result=lambda: report))
        got[name] = dict(report.user_properties)
    assert got["heavy"]["stream"] == ONE_AT_A_TIME and got["light"]["stream"] == OTHER
    assert all(p["cpu_s"] >= 0 for p in got.values())


def test_repeat_stops_at_the_first_failure_and_replaces_the_commits_rows(tmp_path, monkeypatch):
    outcomes = iter([True, False, True])
    calls = []

    def fake_run(which, keep=False):
        calls.append(which)
        ok = next(outcomes)
        return {"command": "cmd", "commit": "abc", "seconds": 1.0, "ok": ok, "log_tail": []}
    monkeypatch.setattr(fresh_install, "run", fake_run)
    out = tmp_path / "fresh.json"
    out.write_text(json.dumps([{"command": "cmd", "commit": "abc", "ok": True},
                               {"command": "cmd", "commit": "old", "ok": True}]))
    assert fresh_install.main(["tests", "--repeat", "3", "--out", str(out)]) == 1
    assert len(calls) == 2
    rows = json.loads(out.read_text())
    assert [(r["commit"], r.get("run"), r["ok"]) for r in rows] == [("old", None, True), ("abc", "1/3", True),
                                                                   ("abc", "2/3", False)]


@pytest.mark.parametrize("which", sorted(fresh_install.COMMANDS))
def test_the_tests_command_is_the_readmes(which):
    readme = (fresh_install.REPO / "README.md").read_text()
    if which == "tests":
        assert fresh_install.COMMANDS[which] in readme
        assert fresh_install.COMMANDS[which] in (fresh_install.REPO / ".ci" / "run").read_text()
    else:
        assert fresh_install.COMMANDS[which] in readme


def test_a_tests_cpu_seconds_count_what_it_started():
    """The worker's hooks: from the setup's start to the teardown's end, the CPU of the test's process
    and of the processes it started (here one that burns ~0.5 s and is reaped), in the teardown
    report's user_properties."""
    import subprocess
    import sys

    rec = DurationRecorder(SimpleNamespace(rootpath=Path(".")))
    item = SimpleNamespace(nodeid="t.py::burn")
    rec.pytest_runtest_setup(item)
    subprocess.run([sys.executable, "-c", "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass"],
                   check=True)
    for when in ("setup", "call", "teardown"):
        report = SimpleNamespace(user_properties=[])
        hook = rec.pytest_runtest_makereport(item, SimpleNamespace(when=when))
        next(hook)
        with pytest.raises(StopIteration):
            hook.send(SimpleNamespace(get_result=lambda: report))
    assert [k for k, _ in report.user_properties] == ["cpu_s"] and 0.45 <= report.user_properties[0][1] < 5
