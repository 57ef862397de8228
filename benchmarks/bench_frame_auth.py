"""The cost of authenticating the cluster's own frames (cluster/wire/frame_auth.py), on the CPU, per frame.

The token stream carries every token of the cluster: each decode step's deltas for one gateway go out
as one StreamBatch frame, signed by the decode worker's publisher thread and checked by the gateway's
event loop. This measures, for token-stream frames of 1, 8, 64 and 256 deltas (a step's batch for one
gateway) and a KV control Begin, the time to sign and to verify one frame next to the time to encode
and decode it (what each side already spends), as microseconds per frame and per delta.

    python -m benchmarks.bench_frame_auth --out loadtest/results/frame_auth_cpu.json
    python -m benchmarks.bench_frame_auth --dry-run        # a few iterations (the test suite runs it)
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

from cluster.wire.frame_auth import KV_CONTROL, TOKEN_STREAM, FrameSigner, FrameVerifier, new_cluster_secret


def _per_call_us(fn, iters: int) -> float:
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - t0) / iters * 1e6)
    return best


def _stream_frame(n: int) -> bytes:
    from cluster.wire.stream_messages import StreamBatch, StreamDelta, encode

    deltas = tuple(StreamDelta(f"cmpl-{i:032x}", (1000 + i,), " word") for i in range(n))
    return encode(StreamBatch("decode-0", 12345, deltas))


def measure(iters: int) -> dict:
    from cluster.wire.stream_messages import decode_stream_batch
    from cluster.transport.channel import Begin, _DECODER, _ENCODER

    secret = new_cluster_secret()
    rows = []
    cases = [(f"token_stream_{n}", n, _stream_frame(n), decode_stream_batch, TOKEN_STREAM) for n in (1, 8, 64, 256)]
    begin = _ENCODER.encode(Begin("prefill-0", 7, True, 123456789, [(i, f"cmpl-{i:032x}", 1500, b"\0" * 376)
                                                                    for i in range(4)]))
    cases.append(("kv_control_begin", 4, begin, _DECODER.decode, KV_CONTROL))
    for name, n, payload, decode, channel in cases:
        signer, verifier = FrameSigner(secret, channel), FrameVerifier(secret, channel)
        frames = [signer.sign(payload) for _ in range(iters * 3 + 8)]
        it = iter(frames)
        sign_us = _per_call_us(lambda: signer.sign(payload), iters)
        verify_us = _per_call_us(lambda: verifier.open(next(it)), iters)
        decode_us = _per_call_us(lambda: decode(payload), iters)
        assert verifier.rejected == 0
        rows.append(dict(frame=name, deltas=n, bytes=len(payload), sign_us=round(sign_us, 3),
                         verify_us=round(verify_us, 3), decode_us=round(decode_us, 3),
                         auth_us_per_delta=round((sign_us + verify_us) / n, 4),
                         auth_over_decode=round((sign_us + verify_us) / decode_us, 3)))
    return dict(python=platform.python_version(), machine=platform.machine(), iters=iters, rows=rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--dry-run", action="store_true", help="a few iterations: checks the benchmark runs")
    ap.add_argument("--out", default=None, help="JSON file to write")
    args = ap.parse_args(argv)
    result = measure(50 if args.dry_run else args.iters)
    print(f"{'frame':>18} {'deltas':>6} {'bytes':>6} {'sign us':>8} {'verify us':>9} {'decode us':>9} "
          f"{'auth/delta us':>13} {'auth/decode':>11}")
    for r in result["rows"]:
        print(f"{r['frame']:>18} {r['deltas']:>6} {r['bytes']:>6} {r['sign_us']:>8.2f} {r['verify_us']:>9.2f} "
              f"{r['decode_us']:>9.2f} {r['auth_us_per_delta']:>13.3f} {r['auth_over_decode']:>11.2f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
