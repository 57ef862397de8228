"""Graceful drain of `pdserve serve` (a subprocess), with one API-server process and its own Ray (as a
user runs it on one machine) and with two joining a running Ray (the run's: as on a Ray cluster):
SIGTERM to the launcher turns /ready false and answers new requests with 503 at once (on every API
server), lets in-flight requests finish, ends those that outlive `--drain-timeout-s` with a clear
error event, and then exits 0 with every process gone. A second
SIGTERM during the drain ends every stream with an error event and [DONE] (no truncated body, no ASGI
traceback); with Ray's GCS killed first, the server still exits within drain_timeout_s + 5 s."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
from serve_process import start_serve

pytestmark = pytest.mark.cluster  # `pdserve serve` subprocesses

DRAIN_S = 6.0


def _stream(url: str, body: dict, out: dict) -> None:
    text, events = "", []
    out["events"] = events  # filled as they come: a test waits on the first one
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
def test_sigterm_drains_then_exits(demo_model_dir, request, api_servers):
    pytest.importorskip("decode_worker.actor")
    # One API server on a Ray of its own; two on the run's Ray (the launcher stops only what it started).
    ray_address = request.getfixturevalue("ray_address") if api_servers == 2 else ""
    actors_before = _named_actors() if ray_address else None
    proc, url, out_lines = _serve(demo_model_dir, api_servers, DRAIN_S, ray_address)
    try:
        assert actors_before is None or _named_actors() - actors_before  # its workers, on the run's Ray
        short, long_ = {}, {}
        body = {"model": "demo", "prompt": "Once upon a time", "ignore_eos": True, "temperature": 0}
        threads = [threading.Thread(target=_stream, args=(url, {**body, "max_tokens": 40}, short)),
                   threading.Thread(target=_stream, args=(url, {**body, "max_tokens": 4000}, long_))]
        for t in threads:
            t.start()
        _wait_streaming([short, long_], 30)

        import psutil

        # (forked from the launcher's process template: named after their module)
        api = [c for c in psutil.Process(proc.pid).children(recursive=True) if c.name() == "api_server"]
        assert len(api) == api_servers
        t_sig = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        r = _wait_draining(url)
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
        if actors_before is not None:  # on the run's Ray: its workers went with it, Ray stays up
            deadline = time.monotonic() + 30
            while (left := _named_actors() - actors_before) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not left, left
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def _named_actors() -> set[tuple[str, str]]:
    """(namespace, name) of the named actors alive on the run's Ray (a cluster's workers are named)."""
    import ray

    return {(a["namespace"], a["name"]) for a in ray.util.list_named_actors(all_namespaces=True)}


def _serve(demo_model_dir, api_servers: int, drain_s: float, ray_address: str = ""):
    """`pdserve serve` as a subprocess in its own session (joining the Ray at `ray_address`, else with
    its own); returns (proc, url, output lines)."""
    # No warm-up: what these tests check starts with the first request (the warm-up before /ready, and
    # a warmed server's SIGTERM stop, are test_serve_command.py's and test_role_switch.py's).
    proc, url, out_lines = start_serve(demo_model_dir, "--prefill-workers", "0", "--decode-workers", "1",
                                       "--cpu-num-blocks", "512", "--drain-timeout-s", str(drain_s),
                                       "--api-servers", str(api_servers), "--no-warmup", new_session=True,
                                       ray_address=ray_address)
    if url is None:
        proc.kill()
        raise AssertionError("".join(out_lines))
    threading.Thread(target=lambda: out_lines.extend(proc.stdout), daemon=True).start()
    return proc, url, out_lines


def _streams(url: str, n: int, max_tokens: int) -> tuple[list[dict], list[threading.Thread]]:
    outs = [{} for _ in range(n)]
    body = {"model": "demo", "prompt": "Once upon a time", "ignore_eos": True, "temperature": 0, "max_tokens": max_tokens}
    threads = [threading.Thread(target=_stream, args=(url, body, o)) for o in outs]
    for t in threads:
        t.start()
    _wait_streaming(outs, 60)
    return outs, threads


def _wait_streaming(outs: list[dict], timeout_s: float) -> None:
    """Until every stream has its first event (the deadline only bounds a failure)."""
    deadline = time.monotonic() + timeout_s
    while not all(o.get("events") or "exc" in o for o in outs):
        assert time.monotonic() < deadline, outs
        time.sleep(0.01)
    assert all(o.get("status") == 200 and o.get("events") for o in outs), outs


def _wait_draining(url: str, timeout_s: float = 10.0) -> httpx.Response:
    """/ready's answer once the SIGTERM reached the API server that answers it: the first that says
    it drains. (The router refuses new requests before it tells the API servers to drain, so a
    request that reaches one not told yet is refused all the same.)"""
    deadline = time.monotonic() + timeout_s
    while True:
        r = httpx.get(f"{url}/ready", timeout=5)
        if r.status_code != 200 and r.json().get("draining"):
            return r
        assert time.monotonic() < deadline, f"the server did not start draining: {r.status_code} {r.text}"
        time.sleep(0.01)


def _kill_session(proc) -> None:
    import psutil

    if proc.poll() is None:
        proc.kill()
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == proc.pid:
                p.kill()
        except (psutil.Error, ProcessLookupError, PermissionError):
            pass


@pytest.mark.timeout(240)
def test_second_sigterm_ends_every_stream_with_an_error_event(demo_model_dir):
    """SIGTERM to the launcher, then a second one during the drain: every stream (on both API servers)
    ends with an error event and [DONE], nothing is cut mid-body, no ASGI traceback is logged."""
    pytest.importorskip("decode_worker.actor")
    proc, url, out = _serve(demo_model_dir, api_servers=2, drain_s=30.0)
    try:
        outs, threads = _streams(url, 8, 4000)
        proc.send_signal(signal.SIGTERM)
        assert _wait_draining(url).status_code == 503  # the first one took: the drain runs
        t_second = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=60)
        proc.wait(timeout=60)
        text = "".join(out)
        print(f"\nsecond SIGTERM: exit {proc.returncode} {time.monotonic() - t_second:.1f}s after it; "
              f"{sum('exc' in o for o in outs)} streams cut")
        for o in outs:
            assert "exc" not in o and o.get("done"), o
            err = o["events"][-1].get("error")
            assert err and "shutting down" in err["message"], o["events"][-1]
        assert "Exception in ASGI application" not in text and "Traceback" not in text, text[-3000:]
        assert "pdserve: stopped" in text
    finally:
        _kill_session(proc)


@pytest.mark.timeout(240)
def test_exits_in_time_when_ray_dies_first(demo_model_dir):
    """Ray's GCS killed before the SIGTERM (a whole process group stopped in the wrong order): the server
    still drains what it can and exits within drain_timeout_s + 5 s, not after Ray's 60 s reconnects."""
    pytest.importorskip("decode_worker.actor")
    import psutil

    drain_s = 3.0
    proc, url, out = _serve(demo_model_dir, api_servers=1, drain_s=drain_s)
    try:
        outs, threads = _streams(url, 2, 4000)
        gcs = [p for p in psutil.Process(proc.pid).children(recursive=True) if "gcs_server" in p.name()]
        assert gcs, [p.name() for p in psutil.Process(proc.pid).children(recursive=True)]
        for p in gcs:
            p.send_signal(signal.SIGKILL)
        t_sig = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        took = time.monotonic() - t_sig
        for t in threads:
            t.join(timeout=30)
        print(f"\nGCS killed first: exit {proc.returncode} {took:.1f}s after SIGTERM (drain {drain_s:g}s)")
        assert took <= drain_s + 5, "".join(out)[-3000:]
        assert "pdserve: stopped" in "".join(out)
        for o in outs:  # every stream was ended cleanly (error event and [DONE])
            assert "exc" not in o and o.get("done"), o
    finally:
        _kill_session(proc)
