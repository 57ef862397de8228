"""ProcessTemplate (cluster/process/): a child forked from the template runs `python -m module` as a
new interpreter would (argv, environment, working directory, stdin/stdout pipes, passed descriptors
at their numbers and no others, exit codes and signals), without importing again what the template
preloaded; a template running a Python thread is refused; a shared template is replaced when the
environment changes and exits after its last child; children end with their template and launcher."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from cluster.process.process_template import PIPE, ProcessTemplate
from cluster.process.template_child import TEMPLATE_GONE

CHILD = """
import json, os, sys

def open_fds():
    listed = [int(f) for f in os.listdir("/proc/self/fd")]
    out = []
    for fd in listed:  # (the listing's own descriptor is closed by now)
        try:
            os.fstat(fd)
            out.append(fd)
        except OSError:
            pass
    return sorted(out)

print(json.dumps({"argv": sys.argv[1:], "env": os.environ.get("PT_VALUE"), "cwd": os.getcwd(),
                  "stdin": sys.stdin.read(), "name": sys.argv[0], "fds": open_fds(),
                  "imports": open(os.environ["PT_COUNT"]).read() if os.path.exists(os.environ["PT_COUNT"]) else None,
                  "preloaded": "pt_heavy" in sys.modules}), flush=True)
code = int(os.environ.get("PT_EXIT", "0"))
if code == 99:
    import time
    time.sleep(600)
sys.exit(code)
"""
HEAVY = """
import os
with open(os.environ["PT_COUNT"], "a") as f:
    f.write("x")
"""
THREADED = """
import threading
threading.Thread(target=threading.Event().wait, daemon=True).start()
"""


@pytest.fixture
def modules(tmp_path, monkeypatch):
    for name, text in (("pt_child", CHILD), ("pt_heavy", HEAVY), ("pt_threaded", THREADED)):
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(text))
    # (before whatever PYTHONPATH holds: where msgspec and this checkout are on a host without a venv)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv("PT_COUNT", str(tmp_path / "count"))
    return tmp_path


def _run(t: ProcessTemplate, *args, stdin: bytes = b"", env=None, pass_fds=()):
    import json

    c = t.spawn("pt_child", args, stdin=PIPE, stdout=PIPE, env=env, pass_fds=pass_fds)
    c.stdin.write(stdin)
    c.stdin.close()
    out = c.stdout.read()
    return c, json.loads(out) if out else None


def test_a_child_runs_its_module_as_python_m_would(modules, tmp_path, monkeypatch):
    t = ProcessTemplate(("pt_heavy",))
    try:
        inheritable = os.open(os.devnull, os.O_RDONLY)
        os.set_inheritable(inheritable, True)  # close_fds: still not the child's
        sock = socket.socket()
        monkeypatch.chdir(tmp_path)
        c, got = _run(t, "a", "--b", stdin=b"hello", env={"PT_VALUE": "v", "PT_EXIT": "3"},
                      pass_fds=(sock.fileno(),))
        assert c.wait(30) == 3 and c.returncode == 3
        assert got["argv"] == ["a", "--b"] and got["env"] == "v" and got["cwd"] == str(tmp_path)
        assert got["stdin"] == "hello" and got["name"].endswith("pt_child.py")
        # 0-2 and the passed socket at its own number; nothing else of this process's
        assert got["fds"] == sorted({0, 1, 2, sock.fileno()}), (got["fds"], inheritable)
        # The template imported pt_heavy once; no child imports it again.
        assert got["preloaded"] and got["imports"] == "x"
        _, again = _run(t)
        assert again["imports"] == "x"
        assert t.ready.threads == 1 and t.ready.cpu_s >= 0
        os.close(inheritable)
        sock.close()
    finally:
        t.close()


def test_signals_exit_codes_and_names(modules):
    t = ProcessTemplate(())
    try:
        c = t.spawn("pt_child", env={"PT_EXIT": "99"})
        assert psutil.Process(c.pid).ppid() == t.pid
        deadline = time.monotonic() + 30  # (named by the child itself, right after the fork)
        while psutil.Process(c.pid).name() != "pt_child":
            assert time.monotonic() < deadline, psutil.Process(c.pid).name()
            time.sleep(0.01)
        assert c.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            c.wait(0.2)
        c.kill()
        assert c.wait(30) == -signal.SIGKILL
        c.send_signal(signal.SIGTERM)  # an ended child: nothing to signal, no error
        bad = t.spawn("pt_no_such_module")
        assert bad.wait(30) == 1
    finally:
        t.close()


def test_a_template_running_a_python_thread_is_refused(modules):
    t = ProcessTemplate(("pt_threaded",))
    try:
        with pytest.raises(RuntimeError, match="2 threads.*unsafe"):
            t.spawn("pt_child")
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="2 threads.*unsafe"):  # at once, every time
            t.spawn("pt_child")
        assert time.monotonic() - t0 < 1 and not t.alive
    finally:
        t.close()


def test_the_shared_template_follows_the_environment_and_retires_after_its_last_child(modules, monkeypatch):
    first = ProcessTemplate.shared(("pt_heavy",))
    try:
        assert ProcessTemplate.shared(("pt_heavy",)) is first
        running = first.spawn("pt_child", env={"PT_EXIT": "99"})
        monkeypatch.setenv("PT_VALUE", "changed")  # what a preloaded module might have read
        second = ProcessTemplate.shared(("pt_heavy",))
        assert second is not first and first.retired and first.alive  # kept for its running child
        _, got = _run(second)
        assert got["env"] == "changed"
        running.kill()
        assert running.wait(30) == -signal.SIGKILL
        deadline = time.monotonic() + 30
        while first.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not first.alive  # retired, and its last child ended: it exited
    finally:
        for t in (first, ProcessTemplate.shared(("pt_heavy",))):
            t.close()


def test_children_end_with_their_template(modules):
    t = ProcessTemplate(())
    c = t.spawn("pt_child", env={"PT_EXIT": "99"})
    os.kill(t.pid, signal.SIGKILL)
    # Re-parented, its pid reaped by someone else: the handle says so with TEMPLATE_GONE.
    # (pt_child does not watch its parent: it is killed here; API servers and the store exit by themselves.)
    deadline = time.monotonic() + 30
    while t.alive and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not t.alive and c.poll() is None
    os.kill(c.pid, signal.SIGKILL)
    assert c.wait(30) == TEMPLATE_GONE
    with pytest.raises(RuntimeError, match="gone"):
        t.spawn("pt_child")
    t.close()


def test_the_template_exits_with_its_launcher(modules, tmp_path):
    """A launcher killed with SIGKILL: its template reads EOF and exits."""
    script = tmp_path / "launcher.py"
    script.write_text(textwrap.dedent("""
        import sys, time
        from cluster.process.process_template import PIPE, ProcessTemplate
        t = ProcessTemplate(())
        c = t.spawn("pt_child", stdout=PIPE)
        c.stdout.read()
        c.wait(60)
        print(t.pid, flush=True)
        time.sleep(600)
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    launcher = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        template = int(launcher.stdout.readline())
        assert psutil.pid_exists(template)
        launcher.kill()
        launcher.wait(30)
        deadline = time.monotonic() + 30
        while psutil.pid_exists(template) and psutil.Process(template).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the template outlived its launcher"
            time.sleep(0.05)
    finally:
        if launcher.poll() is None:
            launcher.kill()
