"""The decode worker's host side at large batch, on CPU, against a simulated device.

A real `DecodeWorker` (the demo model's scheduler, block manager, graph runner's host half, local
prefill scheduling, token publisher with its detokenizer and ZMQ sinks) drives a device that takes
`--step-ms` per decode step and `--prefill-ms-per-token` (+ `--prefill-overhead-ms`) per local
prefill pass, without computing anything: a launch returns at once, reading its tokens waits (off
the GIL, like a CUDA event) until the simulated device is done, exactly as the GPU loop does. So what
the records show beyond the step is the host's own cost: the loop's per-row Python, the publisher
competing for the interpreter, the prefill's syncs. The gateway end (token and stats sinks) runs in
another process, as it does when serving.

Per batch size, in the JSON (`--out`): median step interval over step duration, the mean parts of
the interval (step, prefill, idle, host gap), the loop's host time per step and the publisher's lag,
and the tokens the sinks received per second against rows / step time.

    python -m benchmarks.bench_host_loop --batch-sizes 64,256 --step-ms 2.7 --seconds 10 --out /tmp/host.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

from cluster.wire.messages import GenerateRequest
from cluster.sampling.sampling_params import SamplingParams
from cluster.worker.worker_config import WorkerConfig


class SimulatedDevice:
    """A device timeline: work queued at `now` starts when the device is free and takes its time."""

    def __init__(self):
        self.free_at = time.perf_counter()
        self._lock = threading.Lock()

    def enqueue(self, seconds: float) -> tuple[float, float]:
        with self._lock:
            start = max(time.perf_counter(), self.free_at)
            self.free_at = start + seconds
            return start, self.free_at

    @staticmethod
    def wait_until(t: float) -> float:
        dt = t - time.perf_counter()
        if dt > 0:
            time.sleep(dt)  # releases the GIL, as a CUDA event's synchronize does
        return max(0.0, dt)


def simulate(worker, step_s: float, prefill_overhead_s: float, prefill_per_token_s: float) -> SimulatedDevice:
    """Makes `worker` run on a SimulatedDevice: no forward pass, device times as given."""
    dev = SimulatedDevice()
    runner = worker.graph_runner
    runner._forward = lambda b, width, features=False: None  # the host half of a step stays real
    real_launch = runner.launch
    prev = {"start": None}

    def launch(rows):
        h = real_launch(rows)
        start, end = dev.enqueue(step_s)
        h.ran_in_launch_s = 0.0
        h.gpu_time_s = step_s
        h.interval_s = None if prev["start"] is None else start - prev["start"]
        prev["start"] = start
        real_tokens = h.tokens

        def tokens():
            h.wait_s = dev.wait_until(end)
            return real_tokens()

        h.tokens = tokens
        return h

    runner.launch = launch
    vocab = worker.arch.vocab_size

    def prefill(chunks, wants):
        n = sum(len(c.token_ids) for c in chunks)
        _, end = dev.enqueue(prefill_overhead_s + n * prefill_per_token_s)
        # The pass runs on the device in order with the steps; the host returns at once (its
        # first-token draw is what waits, in the worker).
        prefill.pending_end = end
        return torch.zeros(len(chunks), vocab), [None] * len(chunks)

    prefill.pending_end = 0.0
    worker.prefill_runner.prefill_with_prompt_logprobs = prefill
    # The local prefill's first-token draw (decode_worker/local_prefill.py draws it by this name).
    import decode_worker.local_prefill as lp

    real_sample = lp.sample_tokens_async

    class Drawn:  # the first-token draw: reading it waits for the pass on the device
        def __init__(self, inner, end):
            self.inner, self.end = inner, end

        def result(self):
            dev.wait_until(self.end)
            return self.inner.result()

    lp.sample_tokens_async = lambda *a, **kw: Drawn(real_sample(*a, **kw), prefill.pending_end)
    return dev


_SECRET = b"bench-host-loop:" * 2  # the sinks' process and the worker's (no launcher draws one here)


def _sinks(token_addr_q, stop, out_q) -> None:
    """The gateways' end, in its own process: counts tokens, collects the step records."""
    import zmq

    from cluster.wire.frame_auth import STATS_SINK, TOKEN_STREAM, FrameVerifier
    from cluster.wire.stream_messages import decode_step_records, decode_stream_batch

    # The worker runs without a launcher: the bench's own secret (an empty one is refused).
    tok_check, st_check = FrameVerifier(_SECRET, TOKEN_STREAM), FrameVerifier(_SECRET, STATS_SINK)
    ctx = zmq.Context()
    tok = ctx.socket(zmq.PULL)
    st = ctx.socket(zmq.PULL)
    token_addr_q.put((f"tcp://127.0.0.1:{tok.bind_to_random_port('tcp://127.0.0.1')}",
                      f"tcp://127.0.0.1:{st.bind_to_random_port('tcp://127.0.0.1')}"))
    poller = zmq.Poller()
    poller.register(tok, zmq.POLLIN)
    poller.register(st, zmq.POLLIN)
    arrivals, finished, records = [], 0, []
    while not stop.is_set():
        for sock, _ in poller.poll(50):
            if sock is tok:
                b = decode_stream_batch(tok_check.open(tok.recv_multipart()))
                now = time.time()
                n = sum(len(d.token_ids) for d in b.deltas)
                finished += sum(1 for d in b.deltas if d.finish_reason)
                arrivals.append((now, n))
            else:
                for r in decode_step_records(st_check.open(st.recv_multipart())).records:
                    records.append((r.t, r.batch_size, r.step_time_s, r.interval_s, r.prefill_s, r.idle_s, r.gap_s,
                                    r.host_s, r.publish_lag_s))
    out_q.put((arrivals, finished, records))


def run_batch(n: int, seconds: float, step_ms: float, prefill_overhead_ms: float, prefill_per_token_ms: float,
              prompt_tokens: int, output_tokens: int, model_dir: str) -> dict:
    from decode_worker.decode_worker import DecodeWorker

    ctx = mp.get_context("spawn")
    addr_q, out_q, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    sinks = ctx.Process(target=_sinks, args=(addr_q, stop, out_q), daemon=True)
    sinks.start()
    token_addr, stats_addr = addr_q.get(timeout=240)  # a spawned child's start: minutes when starved (a dry run at nice 10)
    cfg = WorkerConfig(model_dir=model_dir, dtype="float32", max_num_seqs=n, use_cuda_graph=False,
                       cpu_num_blocks=n * ((prompt_tokens + output_tokens) // 16 + 2) + 16,
                       max_model_len=prompt_tokens + output_tokens + 16, cluster_secret=_SECRET)
    worker = DecodeWorker("d0", cfg, stats_sink=stats_addr)
    simulate(worker, step_ms / 1e3, prefill_overhead_ms / 1e3, prefill_per_token_ms / 1e3)
    params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
    submitted = 0
    # Text prompts (the load test's default), so the detokenizer runs its usual (Rust) path.
    from cluster.text.tokenizer import load_tokenizer

    words = load_tokenizer(model_dir).encode(" ".join(["the sea was calm and the wind came over the water"] * 40))
    base = list(words[: prompt_tokens - 1])

    def submit():
        nonlocal submitted
        prompt = tuple([0] + base[submitted % 7:] + base[: submitted % 7])
        if worker.submit_local(GenerateRequest(f"r{submitted}", prompt, params, 0, time.time(),
                                               reply_to=token_addr)) is not None:
            submitted += 1

    t0 = time.time()
    try:
        while time.time() - t0 < seconds:
            # A closed loop of n users: a finished request is replaced by a new one.
            with worker._lock:
                live = worker.scheduler.num_seqs
            for _ in range(n - live):
                submit()
            time.sleep(0.002)
    finally:
        time.sleep(0.3)
        stop.set()
        arrivals, finished, records = out_q.get(timeout=60)
        sinks.join(timeout=10)
        worker.shutdown()
    t_lo = t0 + seconds / 3  # steady state: the first third warms up
    recs = [r for r in records if r[0] >= t_lo and r[3] is not None and r[1] >= 0.9 * n]
    toks = sum(k for t, k in arrivals if t >= t_lo)
    span = max(1e-9, (max((t for t, _ in arrivals), default=t_lo)) - t_lo)
    row = {"batch_size": n, "steps": len(recs), "step_ms": step_ms, "tokens_per_s": toks / span}
    if recs:
        med = lambda i: statistics.median(r[i] for r in recs) * 1e3  # noqa: E731
        mean = lambda i: statistics.fmean(r[i] for r in recs) * 1e3  # noqa: E731
        row.update(interval_ms=med(3), interval_mean_ms=mean(3), interval_over_step=med(3) / step_ms,
                   parts_mean_ms={"step": mean(2), "prefill": mean(4), "idle": mean(5), "gap": mean(6)},
                   host_ms=med(7), publish_lag_ms=med(8),
                   rows_per_s=statistics.fmean(r[1] for r in recs) / (step_ms / 1e3))
        row["delivered_over_capacity"] = row["tokens_per_s"] / row["rows_per_s"]
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_host_loop", description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", default="64,256")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--step-ms", type=float, default=2.7, help="device time per decode step (1B at 256: 2.7)")
    ap.add_argument("--prefill-overhead-ms", type=float, default=0.5)
    ap.add_argument("--prefill-ms-per-token", type=float, default=0.002)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=256)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from cluster.model.demo import ensure_demo_model

    torch.set_num_threads(1)
    model_dir = str(ensure_demo_model())
    rows = []
    for n in (int(x) for x in args.batch_sizes.split(",")):
        row = run_batch(n, args.seconds, args.step_ms, args.prefill_overhead_ms, args.prefill_ms_per_token,
                        args.prompt_tokens, args.output_tokens, model_dir)
        rows.append(row)
        print(f"batch {n:4d}: step {args.step_ms:.2f} ms, interval {row.get('interval_ms', float('nan')):.2f} ms "
              f"(x{row.get('interval_over_step', float('nan')):.2f}), parts {row.get('parts_mean_ms')}, host "
              f"{row.get('host_ms', float('nan')):.2f} ms, publisher lag {row.get('publish_lag_ms', float('nan')):.2f} ms, "
              f"delivered {row['tokens_per_s']:.0f} tok/s = {row.get('delivered_over_capacity', float('nan')):.0%} "
              f"of rows/step", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"config": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
