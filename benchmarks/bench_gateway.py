"""The gateway alone on CPU: streamed SSE events/s and client ITL for K API-server processes.

    python -m benchmarks.bench_gateway [--api-servers 1,2,4] [--streams 256] [--step-ms 2.5]
        [--duration 20] [--out loadtest/results/gateway_cpu.json]

Everything but the model is real: the K API-server processes (deploy/api_server.py: uvicorn,
uvloop, httptools, the FastAPI gateway) on one shared socket, the RouterServer and Router in this
process, and the decode worker's own TokenPublisher (detokenization, stop strings, per-gateway ZMQ
sinks). The decode worker is a fake process that runs no model: every `--step-ms` it emits one token
for each request it holds (cycling through the tokens of a real sentence, so the detokenizer has real
text to produce) and publishes the step like the real loop does. Clients are `--client-procs`
processes of raw asyncio HTTP/1.1 streams (one connection per request, `--streams` users in all,
back-to-back requests of `--max-tokens` tokens); each SSE event is timed when the read that carries
it returns. For each K: events/s and tokens/s over the steady window, client ITL p50/p99 (every gap
between two events of a stream). Then, at the largest K, the same run with a /stats poller every
0.25 s (what `pdserve loadtest` does): how much the load test's own polling moves ITL p99.

Writes `--out` (rows `{api_servers, events_per_s, itl_p50_ms, itl_p99_ms, ...}`) and prints a table.
Offered load is streams x 1000 / step_ms tokens/s; a gateway that keeps up streams them all as
separate events with ITL p50 = step_ms; one that falls behind merges tokens into fewer events.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from array import array
from pathlib import Path

from loadtest.report import percentile

MODEL = "bench"
SENTENCE = ("The sea was calm that morning, and the old ship moved slowly past the lighthouse; "
            "its crew watched the gulls, counted the waves (128, 256, 512) and sang about é, ü and 漢字. ")


# -- the fake decode worker (its own process) -------------------------------------------------------
def fake_decode_main(cmd_addr: str, stats_sink: str, step_s: float, model_dir: str) -> None:
    """A decode loop without a model: one token per held request per step, through the real publisher."""
    import zmq

    import msgspec

    from cluster.wire.messages import GenerateRequest, TokenBatch, TokenDelta
    from cluster.text.tokenizer import load_tokenizer
    from decode_worker.token_publisher import TokenPublisher

    tok = load_tokenizer(model_dir)
    text_ids = list(tok(SENTENCE * 4, add_special_tokens=False).input_ids)
    decode_cmd = msgspec.msgpack.Decoder(tuple[str, GenerateRequest | None, str]).decode
    running: dict[str, list[int]] = {}  # request id -> [tokens emitted, max_tokens]
    lock = threading.Lock()
    publisher = TokenPublisher("fake-decode", tok, stats_sink, on_stop=lambda rid: abort(rid))
    outbox: list[TokenDelta] = []

    def abort(rid: str) -> None:
        with lock:
            if running.pop(rid, None) is not None:
                outbox.append(TokenDelta(rid, (), "abort"))

    def commands() -> None:
        sock = zmq.Context.instance().socket(zmq.PULL)
        sock.connect(cmd_addr)
        while True:
            kind, req, rid = decode_cmd(sock.recv())
            if kind == "add":
                publisher.register(req)
                with lock:
                    running[req.request_id] = [0, req.params.max_tokens]
            elif kind == "abort":
                abort(rid)
            elif kind == "stop":
                return

    cmd_thread = threading.Thread(target=commands, daemon=True)
    cmd_thread.start()
    step, nxt = 0, time.perf_counter()
    while cmd_thread.is_alive():
        nxt += step_s
        with lock:
            deltas, outbox[:] = list(outbox), []
            for rid, st in list(running.items()):
                t = text_ids[st[0] % len(text_ids)]
                st[0] += 1
                done = st[0] >= st[1]
                deltas.append(TokenDelta(rid, (t,), "length" if done else None))
                if done:
                    del running[rid]
            n = len(deltas)
        if deltas:
            publisher.publish(TokenBatch("fake-decode", step, tuple(deltas), step_s, n, 0))
        step += 1
        delay = nxt - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        else:
            nxt = time.perf_counter()  # behind: don't burst to catch up
    publisher.close()


class FakeDecodeFleet:
    """The router's WorkerClient handle for the fake decode worker: prefill happens "locally" there."""

    def __init__(self, cmd_addr: str, max_num_seqs: int):
        import msgspec
        import zmq

        self._sock = zmq.Context.instance().socket(zmq.PUSH)
        self._sock.bind(cmd_addr)
        self._encode = msgspec.msgpack.Encoder().encode
        self.max_num_seqs = max_num_seqs
        self.running = 0

    def submit_local(self, req) -> int | None:
        """Accepted; 0 prompt tokens found in a prefix cache (it keeps none)."""
        self._sock.send(self._encode(("add", req, "")))
        return 0

    def abort(self, request_id: str) -> None:
        self._sock.send(self._encode(("abort", None, request_id)))

    def stats(self):
        from cluster.wire.messages import WorkerStats

        big = 1 << 30
        return WorkerStats("fake-decode", "decode", True, free_blocks=big, total_blocks=big,
                           max_num_seqs=self.max_num_seqs, graph_buckets=(self.max_num_seqs,))

    def close(self) -> None:
        self._sock.send(self._encode(("stop", None, "")))
        self._sock.close(linger=1000)


# -- clients (their own processes) ----------------------------------------------------------------
async def _user(host: str, port: int, body: bytes, t_start: float, t_end: float, stats: dict, gaps: array) -> None:
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
               b"Accept: text/event-stream\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(body)) + body
    perf = time.perf_counter
    while perf() < t_end:
        reader, writer = await asyncio.open_connection(host, port)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        writer.write(request)
        last = None
        tail = b""
        try:
            while True:
                buf = await reader.read(1 << 16)
                now = perf()
                if not buf:
                    break
                data = tail + buf
                n = data.count(b"data: {")
                tail = data[-16:]
                n -= tail.count(b"data: {")  # counted again with the next read
                if n:
                    if t_start <= now <= t_end:
                        stats["events"] += n
                        if last is not None:
                            gaps.append(now - last)
                            for _ in range(n - 1):
                                gaps.append(0.0)
                    last = now
                if b"data: [DONE]" in data:
                    if t_start <= now <= t_end:
                        stats["requests"] += 1
                    break
        finally:
            writer.close()


def client_main(host: str, port: int, users: int, body: bytes, t_start: float, t_end: float, out: str) -> None:
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    stats = {"events": 0, "requests": 0}
    gaps = array("d")

    async def main():
        await asyncio.gather(*(_user(host, port, body, t_start, t_end, stats, gaps) for _ in range(users)))
    # perf_counter is per machine (CLOCK_MONOTONIC): the parent's window applies here as is.
    asyncio.run(main())
    with open(out + ".gaps", "wb") as f:
        gaps.tofile(f)
    Path(out).write_text(json.dumps(stats))


# -- one measurement --------------------------------------------------------------------------------
def measure(args, k: int, model_dir: str, poll_stats: bool = False) -> dict:
    from cluster.process.process_template import ProcessTemplate
    from deploy.api_server import PRELOAD, APIServerPool
    from router.requests.admission import AdmissionController, AdmissionLimits
    from router.stats.metrics import RouterMetrics
    from router.router import Router, RouterConfig, WorkerClient
    from router.channel.server import RouterServer

    tmp = tempfile.mkdtemp(prefix="pdserve-bench-")
    ctx = mp.get_context("spawn")
    rs = RouterServer(f"ipc://{tmp}/router", "127.0.0.1", RouterMetrics(MODEL), gateways_expected=k)
    fleet = FakeDecodeFleet(f"ipc://{tmp}/fake-decode", max_num_seqs=args.streams * 2)
    fake = ctx.Process(target=fake_decode_main, args=(f"ipc://{tmp}/fake-decode", rs.stats_sink, args.step_ms / 1e3,
                                                       model_dir), daemon=True)
    fake.start()
    router = Router([], [WorkerClient("fake-decode", "decode", fleet)],
                    AdmissionController(AdmissionLimits(max_model_len=1 << 20, block_size=16,
                                                        max_waiting_requests=1 << 20)),
                    RouterConfig(stats_interval_s=0.5))
    rs.attach(router)
    listen = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listen.bind(("127.0.0.1", 0))
    listen.listen(4096)
    port = listen.getsockname()[1]
    os.mkdir(f"{tmp}/metrics")
    pool = APIServerPool(k, listen, dict(router_address=rs.address, model_dir=model_dir, served_model_name=MODEL,
                                         max_model_len=1 << 20, api_key=None, max_body_bytes=1 << 20,
                                         token_timeout_s=60.0, drain_timeout_s=5.0, sink_host="127.0.0.1"),
                         f"{tmp}/metrics", ProcessTemplate.shared(PRELOAD))
    pool.start()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    ready = threading.Event()

    async def serve():
        await rs.start()
        while not rs.ready:
            await asyncio.sleep(0.05)
        ready.set()
        await stop.wait()
        await rs.stop()
    t = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    t.start()
    try:
        if not ready.wait(300):  # K processes import FastAPI and transformers at once
            raise RuntimeError("the API servers did not come up")
        body = json.dumps({"model": MODEL, "prompt": [10, 11, 12, 13, 14, 15, 16, 17], "max_tokens": args.max_tokens,
                           "stream": True, "ignore_eos": True, "temperature": 0}).encode()
        procs = max(1, min(args.client_procs, args.streams))
        t0 = time.perf_counter() + 2.0  # every client process is up by then
        t_start, t_end = t0 + args.warmup, t0 + args.warmup + args.duration
        outs, clients = [], []
        for i in range(procs):
            users = args.streams // procs + (1 if i < args.streams % procs else 0)
            out = f"{tmp}/client-{i}.json"
            outs.append(out)
            clients.append(ctx.Process(target=client_main, args=("127.0.0.1", port, users, body, t_start, t_end, out)))
        for c in clients:
            c.start()
        poller = None
        polls = []
        if poll_stats:
            poller = threading.Thread(target=_poll_stats, args=(port, t_end, polls), daemon=True)
            poller.start()
        for c in clients:
            c.join(args.warmup + args.duration + 120)
        if poller is not None:
            poller.join(10)
        events = requests = 0
        gaps = array("d")
        for out in outs:
            st = json.loads(Path(out).read_text())
            events += st["events"]
            requests += st["requests"]
            with open(out + ".gaps", "rb") as f:
                gaps.frombytes(f.read())
        row = {"api_servers": k, "events_per_s": round(events / args.duration, 1),
               "itl_p50_ms": round(percentile(gaps, 50) * 1e3, 3) if gaps else None,
               "itl_p99_ms": round(percentile(gaps, 99) * 1e3, 3) if gaps else None,
               "itl_mean_ms": round(statistics.fmean(gaps) * 1e3, 3) if gaps else None,
               "tokens_per_s": round(requests * args.max_tokens / args.duration, 1),
               "offered_tokens_per_s": round(args.streams * 1e3 / args.step_ms, 1),
               "streams": args.streams, "step_ms": args.step_ms, "client_procs": procs,
               "stats_polling": poll_stats}
        if poll_stats:
            row["stats_polls"] = len(polls)
            row["stats_poll_ms_p50"] = round(percentile(polls, 50) * 1e3, 2) if polls else None
        return row
    finally:
        loop.call_soon_threadsafe(stop.set)
        t.join(15)
        pool.stop()
        fleet.close()
        fake.join(5)
        if fake.is_alive():
            fake.kill()
        listen.close()
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


def _poll_stats(port: int, t_end: float, polls: list) -> None:
    """What `pdserve loadtest` does while it runs: GET /stats from the last cursor every 0.25 s."""
    import httpx

    cursor = 0
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
        while time.perf_counter() < t_end:
            t = time.perf_counter()
            cursor = c.get("/stats", params={"cursor": cursor}).json()["cursor"]
            polls.append(time.perf_counter() - t)
            time.sleep(0.25)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_gateway", description=__doc__.split("\n\n")[0])
    p.add_argument("--api-servers", default=None, help="comma-separated K values (default: 1,2 on < 6 cores, else 1,2,4)")
    p.add_argument("--streams", type=int, default=256, help="concurrent streaming requests")
    p.add_argument("--step-ms", type=float, default=2.5, help="fake decode step: one token per stream per step")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--duration", type=float, default=20.0, help="measured seconds per K")
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--client-procs", type=int, default=None,
                   help="client processes (default: what the cores leave after K + 2, at least 1)")
    p.add_argument("--no-stats-check", action="store_true", help="skip the run with the /stats poller")
    p.add_argument("--model", default=None, help="tokenizer directory (default: the demo model's)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "gateway_cpu.json"))
    args = p.parse_args(argv)
    cpus = os.cpu_count() or 1
    ks = [int(x) for x in (args.api_servers or ("1,2" if cpus < 6 else "1,2,4")).split(",")]
    if args.model is None:
        from cluster.model.demo import ensure_demo_model

        args.model = str(ensure_demo_model())
    load_before = os.getloadavg()[0]
    rows = []
    for k in ks:
        a = argparse.Namespace(**vars(args))
        a.client_procs = args.client_procs or max(1, cpus - k - 2)
        row = measure(a, k, args.model)
        rows.append(row)
        print(f"K={k}: {row['events_per_s']:.0f} events/s, {row['tokens_per_s']:.0f} tokens/s "
              f"(offered {row['offered_tokens_per_s']:.0f}), ITL p50 {row['itl_p50_ms']} ms p99 {row['itl_p99_ms']} ms",
              flush=True)
    polled = None
    if not args.no_stats_check:
        k = ks[-1]
        a = argparse.Namespace(**vars(args))
        a.client_procs = args.client_procs or max(1, cpus - k - 2)
        polled = measure(a, k, args.model, poll_stats=True)
        base = next(r for r in rows if r["api_servers"] == k)
        change = (polled["itl_p99_ms"] / base["itl_p99_ms"] - 1) * 100 if base["itl_p99_ms"] else None
        polled["itl_p99_change_pct"] = None if change is None else round(change, 2)
        print(f"K={k} with /stats polled every 0.25 s: ITL p99 {polled['itl_p99_ms']} ms "
              f"({polled['itl_p99_change_pct']:+.1f}% vs without), p50 {polled['itl_p50_ms']} ms", flush=True)
    scaling = None
    if len(rows) > 1 and rows[0]["events_per_s"]:
        scaling = round(rows[-1]["events_per_s"] / rows[0]["events_per_s"], 3)
    result = {"config": {"streams": args.streams, "step_ms": args.step_ms, "max_tokens": args.max_tokens,
                         "duration_s": args.duration, "warmup_s": args.warmup, "cpus": cpus,
                         # Other processes on the machine take cores from the ones measured here.
                         "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
                         "python": sys.version.split()[0], "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
              "rows": rows, "events_per_s_scaling_first_to_last_k": scaling, "stats_polling": polled}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
