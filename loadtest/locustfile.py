"""Locust users that stream completions from the OpenAI-compatible API, and a concurrency step shape.

Run through `python -m loadtest.run` (which also polls the server's step records and writes the
report); by hand:

    python -m locust -f loadtest/locustfile.py --headless --host http://127.0.0.1:8000 \
        --steps 1,2,4 --step-duration 20 --output-tokens 128 --events-dir /tmp/lt

Each user sends one `POST /v1/completions` (`stream`, `ignore_eos`, `temperature: 0`, usage on) at a
time, back to back, so the decode batch equals the number of users. The prompt is text by default
(words of the demo corpus; `--prompt-ids` sends random token ids instead).

Timing is per token. The request asks for `stream_options.continuous_usage_stats` (vLLM's), so every
chunk says how many tokens the stream has carried so far: a chunk's tokens are the difference. TTFT is
the request's start to the chunk carrying its first token (the server sends an event for every token,
even one whose text the detokenizer still holds back, so the first token is not "the first visible
character"); ITL is one sample per token after the first: a chunk of k tokens after a gap g counts k
gaps of g / k (tokens that came with the first one count 0); `chunk_itl` keeps the raw gaps between
chunks. TPOT = (latency - TTFT) / (output tokens - 1). Against a server without continuous usage every
chunk counts one token. Chunks are timestamped with `perf_counter()` the moment `readline()` returns
them, and nothing else happens inside the read loop (no JSON parsing, no Locust events, no file
I/O): all of that runs after the stream has ended.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

from gevent import GreenletExit
from locust import LoadTestShape, constant, events, task
from locust.contrib.fasthttp import FastHttpUser
from locust.runners import MasterRunner, WorkerRunner

from loadtest.records import PROMPT_WORDS, EventWriter, append_step_log, timing_rows, token_chunks


ERROR_BACKOFF_S = 0.5


class StallError(Exception):
    """No token arrived for the stall timeout: the stream is closed and counted as failed."""


class StreamError(Exception):
    """The request failed: HTTP status, an error event in the stream, or a stream that ended early."""


def _env(name: str, default: str) -> str:
    return os.environ.get(f"LOADTEST_{name}", default)


@events.init_command_line_parser.add_listener
def _add_arguments(parser) -> None:
    g = parser.add_argument_group("pdserve load test")
    g.add_argument("--prompt-tokens", type=int, default=int(_env("PROMPT_TOKENS", "128")),
                   help="prompt length in tokens (text, or token ids with --prompt-ids)")
    g.add_argument("--output-tokens", type=int, default=int(_env("OUTPUT_TOKENS", "128")),
                   help="max_tokens of every request (ignore_eos keeps it fixed)")
    g.add_argument("--prompt-text", action="store_true", default=True,
                   help="send the prompt as text, one word per token roughly (the default)")
    g.add_argument("--prompt-ids", action="store_true", default=_env("PROMPT_IDS", "") == "1",
                   help="send random token ids (--prompt-id-range) instead of text")
    g.add_argument("--prompt-id-range", default=_env("PROMPT_ID_RANGE", "10,250"),
                   help="LOW,HIGH: random prompt token ids are drawn from [LOW, HIGH)")
    g.add_argument("--model-name", default=_env("MODEL", "pdserve"), help="the request's `model` field")
    g.add_argument("--api-key", default=_env("API_KEY", ""), help="sent as `Authorization: Bearer KEY`")
    g.add_argument("--stall-timeout", type=float, default=float(_env("STALL_TIMEOUT", "10")),
                   help="seconds without a token after which a stream counts as stalled and is closed")
    g.add_argument("--steps", default=_env("STEPS", "1,2,4,8,16,32,64,128"),
                   help="comma-separated concurrency levels, walked in order")
    g.add_argument("--step-duration", type=float, default=float(_env("STEP_DURATION", "30")),
                   help="seconds each concurrency level is held")
    g.add_argument("--start-stagger", type=float, default=float(_env("START_STAGGER", "1.0")),
                   help="a new user waits uniform(0, S) seconds before its first request, so users do not "
                        "run in lock-step")
    g.add_argument("--events-dir", default=_env("EVENTS_DIR", ""),
                   help="directory for the exact per-event CSVs and the step log (empty: none)")


# The step the shape is in, as this process knows it: set by the shape in a local run, by a message
# from the master in a `--processes` run. Only tags events (Locust's CSV names); the report joins by time.
_STEP = {"index": -1, "users": 0}
_writer: EventWriter | None = None


def _events_dir(environment) -> Path | None:
    d = getattr(environment.parsed_options, "events_dir", "") if environment.parsed_options else ""
    if not d:
        return None
    p = Path(d)
    p.mkdir(parents=True, exist_ok=True)
    return p


def _event_writer(environment) -> EventWriter | None:
    global _writer
    if _writer is None:
        d = _events_dir(environment)
        if d is not None:
            _writer = EventWriter(d / f"events-{os.getpid()}.csv")
    return _writer


@events.init.add_listener
def _on_init(environment, **_kw) -> None:
    if environment.parsed_options is not None:
        # Users read these when they are created, i.e. after init, in every process.
        CompletionStreamUser.network_timeout = environment.parsed_options.stall_timeout
        CompletionStreamUser.connection_timeout = environment.parsed_options.stall_timeout
    if isinstance(environment.runner, WorkerRunner):
        def on_step(msg, **_):
            _STEP.update(msg.data)
        environment.runner.register_message("pdserve_step", on_step)


@events.quitting.add_listener
def _on_quit(environment, **_kw) -> None:
    if _writer is not None:
        _writer.close()


def _step_name() -> str:
    return f"c={_STEP['users']}" if _STEP["users"] else "c=?"


class CompletionStreamUser(FastHttpUser):
    wait_time = constant(0)
    # Per socket read: a stalled stream raises TimeoutError here. Set from --stall-timeout at start.
    network_timeout = 10.0
    connection_timeout = 10.0

    def on_start(self) -> None:
        o = self.environment.parsed_options
        self.opts = o
        low, high = (int(x) for x in o.prompt_id_range.split(","))
        self.id_range = (low, high)
        self.rng = random.Random()
        self.headers = {"Accept-Encoding": "identity", "Accept": "text/event-stream"}
        if o.api_key:
            self.headers["Authorization"] = f"Bearer {o.api_key}"
        if o.start_stagger > 0:
            time.sleep(self.rng.uniform(0.0, o.start_stagger))  # gevent-patched: yields

    def _prompt(self):
        n = max(1, self.opts.prompt_tokens)
        if self.opts.prompt_ids:
            return [self.rng.randrange(*self.id_range) for _ in range(n)]
        return " ".join(self.rng.choice(PROMPT_WORDS) for _ in range(n))

    @staticmethod
    def _read_stream(raw, stall_timeout: float, t0: float, chunks: list[tuple[float, bytes]]) -> bool:
        """Appends (arrival, line) of every SSE data line to `chunks` until `[DONE]` (returns True) or
        the end of the body (False). Raises StallError when no data line came for `stall_timeout`."""
        last = t0
        perf = time.perf_counter
        while True:
            try:
                line = raw.readline(b"\n")
            except TimeoutError:
                raise StallError(f"no token for {stall_timeout:g} s after {len(chunks)} chunks") from None
            now = perf()
            if not line:
                return False
            if line.startswith(b"data:"):
                if line[5:].strip() == b"[DONE]":
                    return True
                chunks.append((now, line))
                last = now
            elif now - last > stall_timeout:  # keep-alive comments must not hide a stall
                raise StallError(f"no token for {stall_timeout:g} s after {len(chunks)} chunks")

    @staticmethod
    def _fire(environment, kind: str, name: str, ms: float, exc: Exception | None = None) -> None:
        environment.events.request.fire(request_type=kind, name=name, response_time=ms, response_length=0,
                                        exception=exc, context={})

    def _record(self, rows: list[tuple[float, int, str, float]]) -> None:
        w = _event_writer(self.environment)
        if w is not None:
            w.write(rows)

    def _request(self) -> None:
        o = self.opts
        body = {"model": o.model_name, "prompt": self._prompt(), "max_tokens": o.output_tokens, "temperature": 0,
                "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        step, name = _STEP["index"], _step_name()
        t_wall0, t0 = time.time(), time.perf_counter()
        chunks: list[tuple[float, bytes]] = []
        try:
            self._stream(body, name, step, t_wall0, t0, chunks)
        except GreenletExit:
            # Locust stopped this user mid-stream (end of the run, or a step down): keep the gaps that
            # arrived, or the last step would lose its final request's worth of tokens.
            carried, _, _ = token_chunks(chunks)
            self._record(self._timing_rows(carried, step, t_wall0, t0, name, fire=False))
            raise

    def _timing_rows(self, carried: list[tuple[float, int]], step: int, t_wall0: float, t0: float, name: str,
                     fire: bool = True) -> list[tuple[float, int, str, float]]:
        rows = timing_rows(carried, step, t_wall0, t0)
        if fire:
            for _, _, kind, value in rows:
                if kind in ("ttft", "itl"):
                    self._fire(self.environment, kind.upper(), name, value)
        return rows

    def _stream(self, body: dict, name: str, step: int, t_wall0: float, t0: float,
                chunks: list[tuple[float, bytes]]) -> None:
        failure: Exception | None = None
        stalled_at = None
        with self.client.request("POST", "/v1/completions", json=body, headers=self.headers, stream=True,
                                 catch_response=True, name=name) as resp:
            raw = getattr(resp, "_response", None)
            if resp.status_code != 200 or raw is None:
                detail = (resp.text or "")[:200] if raw is not None else resp.error
                failure = StreamError(f"HTTP {resp.status_code}: {detail}")
            else:
                try:
                    if not self._read_stream(raw, self.opts.stall_timeout, t0, chunks):
                        failure = StreamError(f"stream ended without [DONE] after {len(chunks)} chunks")
                except StallError as e:
                    failure, stalled_at = e, time.perf_counter()
                    raw.release()  # an unfinished response closes its socket rather than pooling it
                except Exception as e:  # noqa: BLE001 - connection reset etc.; GreenletExit is not caught
                    failure = StreamError(f"{type(e).__name__}: {e}")
            carried, completion_tokens, err = token_chunks(chunks)
            times = [t for t, _ in carried]
            if err and failure is None:
                failure = StreamError(f"error event in the stream: {err}")
            end = times[-1] if times else time.perf_counter()
            resp.request_meta["response_time"] = (end - t0) * 1000  # the POST row: end-to-end latency
            if failure is not None:
                resp.failure(failure)
            else:
                resp.success()

        rows = self._timing_rows(carried, step, t_wall0, t0, name)
        wall = t_wall0 + end - t0
        if stalled_at is not None:
            since = (stalled_at - (times[-1] if times else t0)) * 1000
            rows.append((t_wall0 + stalled_at - t0, step, "stall", since))
            self._fire(self.environment, "STALL", name, since, failure)
        elif failure is not None:
            rows.append((wall, step, "error", 0.0))
        elif times:
            n_out = completion_tokens or sum(k for _, k in carried)
            latency = (end - t0) * 1000
            rows += [(wall, step, "e2e", latency), (wall, step, "tokens", float(n_out)),
                     (wall, step, "chunks", float(len(times)))]
            if n_out > 1:
                tpot = (latency - (times[0] - t0) * 1000) / (n_out - 1)
                rows.append((wall, step, "tpot", tpot))
                self._fire(self.environment, "TPOT", name, tpot)
        self._record(rows)
        if failure is not None and stalled_at is None:
            time.sleep(ERROR_BACKOFF_S)  # a refusing server is not hammered in a tight loop

    @task
    def stream_completion(self) -> None:
        self._request()


class ConcurrencySteps(LoadTestShape):
    """Walks the user count through --steps, holding each for --step-duration, then stops.

    Every level is spawned at once (spawn rate = the jump); the report discards each step's warm-up
    after Locust says all its users run. Transitions go to `steps.jsonl` (see loadtest.records).
    """

    def __init__(self):
        super().__init__()
        self._index = -1
        self._ready_logged = False

    def _opts(self):
        return self.runner.environment.parsed_options

    def _log(self, record: dict) -> None:
        d = _events_dir(self.runner.environment)
        if d is not None:
            append_step_log(d, record)

    def tick(self):
        o = self._opts()
        steps = [int(x) for x in str(o.steps).split(",") if x.strip()]
        idx = int(self.get_run_time() // o.step_duration)
        if idx >= len(steps):
            if self._index != len(steps):
                self._index = len(steps)
                self._log({"event": "end", "t": time.time()})
            return None
        users = steps[idx]
        if idx != self._index:
            prev = steps[self._index] if self._index >= 0 else 0
            self._index, self._ready_logged = idx, False
            _STEP.update(index=idx, users=users)
            if isinstance(self.runner, MasterRunner):
                self.runner.send_message("pdserve_step", dict(_STEP))
            self._log({"event": "start", "step": idx, "users": users, "t": time.time()})
            self._spawn_rate = max(1, abs(users - prev))
        if not self._ready_logged and self.get_current_user_count() == users:
            self._ready_logged = True
            self._log({"event": "ready", "step": idx, "users": users, "t": time.time()})
        return users, self._spawn_rate
