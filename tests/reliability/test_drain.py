"""Graceful drain of `pdserve serve` (a subprocess with its own Ray, as a user runs it), with one and
with two API-server processes: SIGTERM to the launcher turns /ready false and answers new requests
with 503 at once (on every API server), lets in-flight requests finish, ends those that outlive
`--drain-timeout-s` with a clear error event, and then exits 0 with every process gone."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

DRAIN_S = 6.0


def _stream(url: str, body: dict, out: dict) -> None:
    text, events = "", []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    ev = json.loads(line[6:])
                    events.append(ev)
                    if ev.get("choices"):
                        text += ev["choices"][0]["text"]
                elif line == "data: [DONE]":
                    out["done"] = True
    except httpx.HTTPError as e:
        out["exc"] = repr(e)
    out.update(text=text, events=events, t_end=time.monotonic())


@pytest.mark.timeout(240)
@pytest.mark.parametrize("api_servers", [1, 2])
def test_sigterm_drains_then_exits(demo_model_dir, api_servers):
    pytest.importorskip("decode_worker.actor")
    env = dict(os.environ, RAY_ADDRESS="")
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster.app.cli", "serve", str(demo_model_dir), "--prefill-workers", "0",
         "--decode-workers", "1", "--port", "0", "--device", "cpu", "--no-use-cuda-graph", "--cpu-num-blocks", "512",
         "--served-model-name", "demo", "--drain-timeout-s", str(DRAIN_S), "--api-servers", str(api_servers)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    out_lines: list[str] = []
    try:
        url = None
        deadline = time.monotonic() + 180
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            out_lines.append(line)
            m = re.search(r"serving demo at (http://\S+)/v1", line)
            url = m.group(1) if m else None
        assert url, "".join(out_lines)
        threading.Thread(target=lambda: out_lines.extend(proc.stdout), daemon=True).start()

        short, long_ = {}, {}
        body = {"model": "demo", "prompt": "Once upon a time", "ignore_eos": True, "temperature": 0}
        threads = [threading.Thread(target=_stream, args=(url, {**body, "max_tokens": 40}, short)),
                   threading.Thread(target=_stream, args=(url, {**body, "max_tokens": 4000}, long_))]
        for t in threads:
            t.start()
        t_wait = time.monotonic() + 30
        while not (short.get("status") and long_.get("status")) and time.monotonic() < t_wait:
            time.sleep(0.01)
        time.sleep(0.1)  # both are streaming

        import psutil

        api = [c for c in psutil.Process(proc.pid).children() if "cluster.app.api_server" in " ".join(c.cmdline())]
        assert len(api) == api_servers
        t_sig = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        r = httpx.get(f"{url}/ready", timeout=5)
        assert r.status_code == 503 and r.json() == {"ready": False, "draining": True}
        r = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 2}, timeout=5)
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining"

        for t in threads:
            t.join(timeout=60)
        # The short request finished normally during the drain ...
        assert short.get("done") and short["events"][-1]["choices"][0]["finish_reason"] == "length", short
        # ... the long one was ended with an error event at the drain timeout, not cut silently.
        assert long_.get("done"), long_
        err = long_["events"][-1].get("error")
        assert err and "drain timeout" in err["message"], long_["events"][-1]
        assert DRAIN_S - 0.5 <= long_["t_end"] - t_sig <= DRAIN_S + 5
        proc.wait(timeout=60)
        print(f"\ndrain: exit {proc.returncode} {time.monotonic() - t_sig:.1f}s after SIGTERM; long request got "
              f"{len(long_['events'])} events before the drain timeout")
        assert proc.returncode == 0, "".join(out_lines)
        assert "pdserve: stopped" in "".join(out_lines)
        assert not [c for c in api if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
