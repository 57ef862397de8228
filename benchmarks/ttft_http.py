"""Where the TTFT goes outside the server's core parts (issue 35): one user, streamed completions of
`--prompt-tokens` token ids, sent back to back by each client in turn against one gateway, each
request joined with its `/stats` record (by the response's id) to split its TTFT into steps:

    client_send    the client's start -> the gateway received the request (ttft_points.received: the
                   ASGI app's first line; the client building and writing the request, the loopback,
                   uvicorn's HTTP parse)
    intake         received -> arrival (routing, the body's parse and validation, tokenization: the
                   gateway's work before it submits the request to the router)
    core           arrival -> first_token (admission ... delivery: the parts the router already splits)
    write          first_token -> written (the first token's SSE frame encoded and handed to the socket)
    client_read    written -> the client parsed the frame (the loopback, the client's HTTP/SSE parse)

(with a server older than the `received`/`written` stamps, client_send includes intake and
client_read includes write). Clients: `raw` (asyncio streams, the request's bytes prepared before its
start, the chunked body parsed by hand; on the CPU host it costs more CPU than sse), `sse` (benchmarks.ttft_cases.
stream_request, the project's load client: benchmarks.sse_connection, httptools), `httpx` (httpx, the
request built before its start: the load client before sse_connection) and `httpx_inline` (httpx building
the request inside the timing, as ttft_cases did before that).
All time the first token as a user sees it: to the moment the bytes of the SSE event carrying it
were read and parsed.

    python -m benchmarks.ttft_http --start-cluster --requests 300 --out /tmp/ttft_http.json   # CPU, demo model
    python -m benchmarks.ttft_http --url http://127.0.0.1:8000 --vocab-size 128256 --out ttft_http.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import httpx

from benchmarks.sse_connection import SSEConnection
from benchmarks.ttft_cases import _ids, _run_loop, stream_request
from loadtest.records import token_chunks
from loadtest.report import percentile

STEPS = ("client_send", "intake", "core", "write", "client_read")
SERVE_ARGS = ["--device", "cpu", "--dtype", "float32", "--cpu-num-blocks", "1024", "--max-model-len", "1024",
              "--api-servers", "1", "--prefill-placement", "static", "--local-prefill-threshold", "0",
              "--enable-prefix-caching"]


def _body(model: str, prompt: list[int], output_tokens: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": output_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


class RawClient:
    """One keep-alive HTTP/1.1 connection; the request's bytes are built before its start."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def connect(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    def request(self, body: dict) -> bytes:
        data = json.dumps(body, separators=(",", ":")).encode()
        return (f"POST /v1/completions HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode() + data

    async def stream(self, raw: bytes) -> tuple[float, float, str | None]:
        """-> (start, first token's event parsed, response id), time.time() each."""
        r, w = self.reader, self.writer
        t0 = time.time()
        w.write(raw)
        head = await r.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(head[:200])
        first, rid, buf = None, None, b""
        while True:
            size = int((await r.readuntil(b"\r\n")).split(b";")[0], 16)
            chunk = await r.readexactly(size + 2)
            if size == 0:
                break
            buf += chunk[:-2]
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                if first is None and ev.startswith(b"data: {"):
                    d = json.loads(ev[6:])
                    if d.get("choices"):
                        first, rid = time.time(), d["id"]
        return t0, first, rid


async def run_raw(url: str, model: str, n: int, prompt_tokens: int, output_tokens: int, vocab: int, seed: int):
    host, port = url.split("//")[1].split(":")
    c = RawClient(host, int(port))
    await c.connect()
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        raw = c.request(_body(model, _ids(rng, prompt_tokens, vocab), output_tokens))
        out.append(await c.stream(raw))
    c.writer.close()
    return out


def _wall(got: tuple[float, float, str] | str) -> tuple[float, float, str | None]:
    """(start, first token: perf_counter) -> the same on the wall clock (the /stats stamps' clock)."""
    if isinstance(got, str):
        raise RuntimeError(got)
    wall, perf = time.time(), time.perf_counter()
    t0, first, rid = got
    return wall + (t0 - perf), wall + (first - perf), rid


async def run_sse(url, model, n, prompt_tokens, output_tokens, vocab, seed):
    """benchmarks.ttft_cases' client and timing rule (stream_request on an SSEConnection)."""
    rng = random.Random(seed)
    conn = SSEConnection(url)
    await conn.connect()
    try:
        return [_wall(await stream_request(conn, _body(model, _ids(rng, prompt_tokens, vocab), output_tokens)))
                for _ in range(n)]
    finally:
        conn.close()


async def _httpx_stream(client: httpx.AsyncClient, body: dict) -> tuple[float, float, str | None]:
    """httpx with the request built before its start, every SSE line read and parsed."""
    request = client.build_request("POST", "/v1/completions", json=body)
    t0 = time.perf_counter()
    lines: list[tuple[float, bytes]] = []
    r = await client.send(request, stream=True)
    try:
        async for line in r.aiter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                lines.append((time.perf_counter(), line.encode()))
    finally:
        await r.aclose()
    carried, _, err = token_chunks(lines)
    if not carried or err is not None:
        raise RuntimeError(f"no token chunk: {err!r}")
    return _wall((t0, carried[0][0], json.loads(lines[0][1][5:]).get("id", "")))


async def _httpx_stream_inline(client: httpx.AsyncClient, body: dict) -> tuple[float, float, str | None]:
    """The load client's rule before this benchmark: the request built (JSON, headers) inside the timing."""
    t0 = time.time()
    first, rid = None, None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {"):
                d = json.loads(line[6:])
                if d.get("choices"):
                    first, rid = time.time(), d["id"]
    return t0, first, rid


async def _run_httpx(stream, url, model, n, prompt_tokens, output_tokens, vocab, seed):
    rng = random.Random(seed)
    out = []
    async with httpx.AsyncClient(base_url=url, timeout=60.0) as client:
        for _ in range(n):
            out.append(await stream(client, _body(model, _ids(rng, prompt_tokens, vocab), output_tokens)))
    return out


async def run_httpx(*args):
    return await _run_httpx(_httpx_stream, *args)


async def run_httpx_inline(*args):
    return await _run_httpx(_httpx_stream_inline, *args)


def fetch_records(url: str) -> dict[str, dict]:
    recs, cursor = {}, 0
    while True:
        d = httpx.get(f"{url}/stats", params={"cursor": cursor, "limit": 20000}, timeout=30).json()
        for r in d["requests"]:
            recs[r["request_id"]] = r
        cursor = d["cursor"]
        if not d["more"]:
            return recs


def steps(t0: float, t1: float, rec: dict) -> dict[str, float]:
    """One request's steps in ms (STEPS; without the server's received/written stamps, the client's
    steps absorb intake and write)."""
    p = rec["ttft_points"]  # router.stats.step_stats.TTFTPoints.named: each point named after the part it ends
    times = list(p.values())
    arrival = p["intake"] if "received" in p else p["arrival"]
    first_token = times[-2] if "write" in p else times[-1]
    received, written = times[0], times[-1]
    return {"client_ms": (t1 - t0) * 1e3, "server_ms": rec["ttft_ms"],
            "client_send": (received - t0) * 1e3, "intake": (arrival - received) * 1e3,
            "core": (first_token - arrival) * 1e3, "write": (written - first_token) * 1e3,
            "client_read": (t1 - written) * 1e3}


def summarize(rows: list[dict]) -> dict:
    keys = ["client_ms", "server_ms", *STEPS]
    return {"requests": len(rows),
            **{f"{k}_p50": percentile([r[k] for r in rows], 50) for k in keys},
            **{f"{k}_p99": percentile([r[k] for r in rows], 99) for k in keys}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ttft_http", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=None, help="a running gateway (else --start-cluster)")
    ap.add_argument("--start-cluster", action="store_true", help="serve the demo model on CPU for the run")
    ap.add_argument("--requests", type=int, default=300, help="per client and round")
    ap.add_argument("--rounds", type=int, default=2, help="each round runs every client once, in turn")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=4)
    ap.add_argument("--vocab-size", type=int, default=500)
    ap.add_argument("--clients", default="raw,sse,httpx,httpx_inline")
    ap.add_argument("--label", default="", help="names the run in the JSON (the tree measured)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    cluster = None
    if args.start_cluster:
        from loadtest.run import ClusterProcess

        work = Path(args.out).resolve().parent / "ttft_http_raw"
        work.mkdir(parents=True, exist_ok=True)
        cluster = ClusterProcess(argparse.Namespace(model=None, prefill_workers=1, decode_workers=1,
                                                    serve_arg=SERVE_ARGS), work)
        cluster.wait_ready(600, {})
        url = cluster.url
    else:
        url = (args.url or "http://127.0.0.1:8000").rstrip("/")
    runners = {"raw": run_raw, "sse": run_sse, "httpx": run_httpx, "httpx_inline": run_httpx_inline}
    clients = args.clients.split(",")
    results: dict[str, list] = {c: [] for c in clients}
    cpu_s = dict.fromkeys(clients, 0.0)  # this process's CPU while each client ran: the client's own cost
    try:
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        for c in clients:  # warm-up: connections, caches
            _run_loop(runners[c](url, model, 20, args.prompt_tokens, args.output_tokens, args.vocab_size, 99))
        for rnd in range(args.rounds):
            for i, c in enumerate(clients):
                cpu0 = time.process_time()
                results[c] += _run_loop(runners[c](url, model, args.requests, args.prompt_tokens, args.output_tokens,
                                                   args.vocab_size, 1000 * rnd + i))
                cpu_s[c] += time.process_time() - cpu0
        time.sleep(1.0)  # the last Finish reaches the router's stats
        recs = fetch_records(url)
    finally:
        if cluster is not None:
            cluster.stop()
    doc = {"label": args.label, "url": url, "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
           "steps": list(STEPS), "clients": {}}
    for c in clients:
        rows = [steps(t0, t1, recs[rid]) for t0, t1, rid in results[c] if rid in recs]
        doc["clients"][c] = summarize(rows)
        doc["clients"][c]["unmatched"] = len(results[c]) - len(rows)
        doc["clients"][c]["client_cpu_ms_per_request"] = round(cpu_s[c] * 1e3 / max(1, len(results[c])), 3)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(f"{'client':>12} {'n':>4} {'cpu/req':>8} {'client p50/p99':>15} {'server p50/p99':>15} "
          + " ".join(f"{s:>12}" for s in STEPS))
    for c, s in doc["clients"].items():
        print(f"{c:>12} {s['requests']:4d} {s['client_cpu_ms_per_request']:8.2f} "
              f"{s['client_ms_p50']:7.2f}/{s['client_ms_p99']:<7.2f} {s['server_ms_p50']:7.2f}/{s['server_ms_p99']:<7.2f} "
              + " ".join(f"{s[k + '_p50']:5.2f}/{s[k + '_p99']:<6.2f}" for k in STEPS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
