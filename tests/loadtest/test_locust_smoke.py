"""CPU smoke runs of the load-test tooling: Locust headless through `loadtest.run`, report files and
their numbers checked.

`FakeDecodeServer` is a small OpenAI-compatible streaming server with a decode loop of its own: every
step takes `base_ms + per_row_ms * batch` and emits one token to every active stream, and `/stats`
serves its step records through the router's own `StepStats` (the same cursor format). Against it the expected ITL is known, so the test
checks the tooling's numbers, not a model's. A second test runs against the real `pdserve serve`.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from cluster.wire.stream_messages import DecodeStepRecord
from router.stats.step_stats import StepStats

pytestmark = pytest.mark.cluster  # Locust and servers in subprocesses

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeDecodeServer:
    def __init__(self, base_ms: float = 20.0, per_row_ms: float = 2.0, prefill_ms: float = 5.0,
                 stall_after: int | None = None):
        self.base_ms, self.per_row_ms, self.prefill_ms, self.stall_after = base_ms, per_row_ms, prefill_ms, stall_after
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.records = StepStats(max_records=4096)
        self._steps = 0
        self.active: dict[str, asyncio.Queue] = {}
        app = FastAPI()

        @app.on_event("startup")
        async def _start():
            asyncio.get_running_loop().create_task(self._decode_loop())

        @app.get("/ready")
        async def ready():
            return {"ready": True}

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

        @app.get("/stats")
        async def stats(cursor: int = 0, limit: int = 0):
            return Response(self.records.since(cursor, limit), media_type="application/json")

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await request.json()
            assert body["stream"] is True and body["ignore_eos"] is True and body["temperature"] == 0
            return StreamingResponse(self._stream(body), media_type="text/event-stream")

        self.app = app

    async def _decode_loop(self) -> None:
        while True:
            n = len(self.active)
            step_ms = self.base_ms + self.per_row_ms * n
            await asyncio.sleep(step_ms / 1000)
            if not n:
                continue
            bucket = 1 << (n - 1).bit_length()
            self._steps += 1
            self.records.record_step(DecodeStepRecord("decode-0", self._steps, time.time(), n, bucket, step_ms / 1000))
            for q in list(self.active.values()):
                q.put_nowait(None)

    async def _stream(self, body: dict):
        rid = uuid.uuid4().hex
        n = body["max_tokens"]
        await asyncio.sleep(self.prefill_ms / 1000)
        q: asyncio.Queue = asyncio.Queue()
        self.active[rid] = q
        try:
            continuous = (body.get("stream_options") or {}).get("continuous_usage_stats")
            for i in range(n):
                if self.stall_after is not None and i >= self.stall_after:
                    await asyncio.sleep(3600)  # a hung stream: the client must give up
                await q.get()
                finish = "length" if i == n - 1 else None
                chunk = {"id": rid, "object": "text_completion", "model": body["model"],
                         "choices": [{"index": 0, "text": " x", "finish_reason": finish}]}
                if continuous:  # vLLM's continuous usage: the tokens streamed so far
                    chunk["usage"] = {"prompt_tokens": 1, "completion_tokens": i + 1, "total_tokens": i + 2}
                yield "data: " + json.dumps(chunk) + "\n\n"
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n,
                     "total_tokens": len(body["prompt"]) + n}
            yield "data: " + json.dumps({"id": rid, "choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.active.pop(rid, None)

    def __enter__(self) -> "FakeDecodeServer":
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/ready", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError("fake server did not start")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def _run_loadtest(args: list[str], timeout: float = 120, ray_address: str = "") -> subprocess.CompletedProcess:
    """`python -m loadtest.run ARGS`; a cluster it starts joins the Ray at `ray_address` (else its own)."""
    return subprocess.run([sys.executable, "-m", "loadtest.run", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "RAY_ADDRESS": ray_address})


def test_steps_against_fake_server_report_itl_and_server_batches(tmp_path):
    out = tmp_path / "lt"
    with FakeDecodeServer(base_ms=20.0, per_row_ms=2.0) as srv:
        r = _run_loadtest(["--url", srv.url, "--steps", "1,2", "--step-duration", "4", "--warmup", "1",
                           "--prompt-tokens", "16", "--output-tokens", "8", "--stall-timeout", "5",
                           "--stats-interval", "0.25", "--out", str(out)])
    assert r.returncode == 0, r.stdout + r.stderr
    # A progress line per step, then the table.
    assert sum(line.startswith("[step ") for line in r.stdout.splitlines()) == 2, r.stdout
    assert "ITL p50" in r.stdout

    for name in ("summary.json", "itl.png", "locust_stats.csv", "locust_stats_history.csv", "steps.jsonl",
                 "server_steps.jsonl"):
        assert (out / name).is_file(), name
    assert list(out.glob("events-*.csv"))
    assert (out / "itl.png").read_bytes()[:4] == b"\x89PNG"

    summary = json.loads((out / "summary.json").read_text())
    assert summary["server_stats_source"] == "stats" and "itl_p50_over_step" in summary["checks"]
    assert summary["config"]["prompt"] == "text"
    rows = summary["rows"]
    assert [row["batch_size"] for row in rows] == [1, 2]
    for row in rows:
        b = row["batch_size"]
        # The server saw the batch the step asked for, in the bucket the fake pads it to.
        assert abs(row["server_batch_size"] - b) <= 0.5 and row["server_bucket"] == b
        assert row["server_padded_rows"] <= 0.5
        expect_ms = 20.0 + 2.0 * b
        assert row["server_step_ms"] == pytest.approx(expect_ms)
        # Client ITL ~ the server's step (asyncio.sleep overshoots by a little, never undershoots much).
        assert 0.8 * expect_ms < row["itl_p50_ms"] < 2.0 * expect_ms, row
        assert 0 < row["itl_p50_ms"] <= row["itl_p90_ms"] <= row["itl_p99_ms"]
        assert row["ttft_p50_ms"] > 0 and row["tpot_p50_ms"] == pytest.approx(row["itl_p50_ms"], rel=0.3)
        assert row["requests"] >= 5 and row["stalls"] == 0 and row["errors"] == 0
        # b streams, one token per step each.
        assert row["tokens_per_s"] == pytest.approx(b * 1000 / expect_ms, rel=0.5)

    # Locust's CSV carries the custom request types.
    stats = (out / "locust_stats.csv").read_text()
    assert "ITL" in stats and "TTFT" in stats and "TPOT" in stats


def test_stalled_streams_are_failures(tmp_path):
    out = tmp_path / "lt"
    with FakeDecodeServer(base_ms=10.0, per_row_ms=0.0, stall_after=3) as srv:
        r = _run_loadtest(["--url", srv.url, "--steps", "2", "--step-duration", "3", "--warmup", "0",
                           "--output-tokens", "8", "--stall-timeout", "1", "--start-stagger", "0", "--out", str(out)])
    assert r.returncode == 1, r.stdout + r.stderr  # stalls make the run fail, after writing the report
    row = json.loads((out / "summary.json").read_text())["rows"][0]
    assert row["stalls"] >= 2 and row["requests"] == 0
    assert "STALL" in (out / "locust_failures.csv").read_text()


def test_refuses_non_loopback_url(tmp_path):
    r = _run_loadtest(["--url", "http://10.1.2.3:8000", "--out", str(tmp_path)], timeout=60)
    assert r.returncode == 2 and "loopback" in r.stderr and "Traceback" not in r.stderr


def test_steps_against_real_cluster(tmp_path, ray_address):
    """`pdserve serve` with the demo model (on the run's Ray, prefill and decode workers on CPU), two
    short steps."""
    out = tmp_path / "lt"
    prefill = os.environ.get("PDSERVE_LOADTEST_PREFILL_WORKERS", "1")
    # Two 2.5-s measured windows: 17 and 13 requests were counted in one (3 asked for below).
    r = _run_loadtest(["--start-cluster", "--prefill-workers", prefill, "--decode-workers", "1",
                       "--steps", "1,2", "--step-duration", "3.5", "--warmup", "1", "--prompt-tokens", "16",
                       "--output-tokens", "24", "--stall-timeout", "10", "--ready-timeout", "120",
                       "--serve-arg=--no-warmup",  # the steps are the subject, not the server's warm-up
                       "--out", str(out)], timeout=240, ray_address=ray_address)
    if r.returncode == 2 and ("before /ready" in r.stderr or "was not ready" in r.stderr):
        pytest.skip(f"`pdserve serve --prefill-workers {prefill}` did not come up: {r.stderr.strip()[-600:]}")
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert (out / "itl.png").is_file() and (out / "locust_stats.csv").is_file()
    assert summary["server_stats_source"] in ("stats", "metrics")
    rows = summary["rows"]
    assert [row["batch_size"] for row in rows] == [1, 2]
    for row in rows:
        b = row["batch_size"]
        assert 0 < row["itl_p50_ms"] <= row["itl_p99_ms"] and row["ttft_p50_ms"] > 0 and row["tokens_per_s"] > 0
        assert row["requests"] >= 3 and row["stalls"] == 0 and row["errors"] == 0
        # The decode batch the server ran is the step's concurrency, less the streams between requests.
        assert 0.5 * b <= row["server_batch_size"] <= b, row
