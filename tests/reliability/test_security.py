"""Security of the cluster's own sockets (no cluster needed; the API key on /v1 is tested against a
real gateway in test_bad_input.py): the KV rendezvous store listens on the internal address only and
refuses a wildcard one; the token stream, the stats sink and the transport control plane take frames
carrying a MAC under the cluster's secret only (the rest are dropped and counted; in a real cluster:
test_internal_channels.py) and never unpickle anything."""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import re
import time
from pathlib import Path

import msgpack
import psutil
import pytest

from cluster.errors import PdserveError
from cluster.transport.rendezvous_store import start_store
from cluster.wire.messages import KVHeader

ROOT = Path(__file__).resolve().parents[2]


def _listening(port: int) -> set[str]:
    return {c.laddr.ip for c in psutil.Process(os.getpid()).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


@pytest.mark.parametrize("host", ["0.0.0.0", "::", ""])
def test_store_refuses_a_wildcard_address(host):
    with pytest.raises(PdserveError, match="internal address"):
        start_store(host)


def test_store_listens_on_the_internal_address_only():
    import datetime

    import torch.distributed as dist

    store = start_store("127.0.0.1")
    assert _listening(store.port) == {"127.0.0.1"}  # a plain TCPStore master would listen on '::'
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=10),
                           use_libuv=True)
    client.set("k", b"v")
    assert store.get("k") == b"v"


def test_config_refuses_a_wildcard_token_stream_host():
    from deploy.config import ClusterConfig

    for host in ("0.0.0.0", "::", "*"):
        with pytest.raises(PdserveError, match="token_stream_host"):
            ClusterConfig.load(overrides={"token_stream_host": host})
    assert ClusterConfig.load(overrides={"token_stream_host": "10.0.0.5"}).token_stream_host == "10.0.0.5"


class _Boom:
    """Unpickling this would create a file: proof that nothing on our sockets unpickles."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


SECRET = b"s" * 32


def test_token_stream_never_unpickles(tmp_path):
    """Even under a valid MAC (a peer holding the key), a pickle frame is only data: dropped, nothing
    executed, the next good frame delivered."""
    import zmq

    from cluster.wire.frame_auth import TOKEN_STREAM, FrameSigner
    from cluster.wire.stream_messages import StreamBatch, StreamDelta, encode
    from router.streams.token_stream import TokenStreamReceiver

    marker = tmp_path / "pwned"

    async def main():
        rx = TokenStreamReceiver("127.0.0.1", secret=SECRET)
        mailbox = rx.register("r1")
        rx.start()
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(rx.address)
        signer = FrameSigner(SECRET, TOKEN_STREAM)
        push.send_multipart(signer.sign(pickle.dumps(_Boom(str(marker)))))  # a malicious frame ...
        push.send_multipart(signer.sign(msgpack.packb({"garbage": [1, 2]})))  # ... a malformed one ...
        push.send_multipart(signer.sign(encode(StreamBatch("decode-0", 1, (StreamDelta("r1", (5, 6), "ab"),)))))
        delta = await asyncio.wait_for(mailbox.next(), 10)
        push.close()
        ctx.term()
        await rx.stop()
        return delta

    assert asyncio.run(main()).token_ids == (5, 6)
    assert not marker.exists()


def test_kv_control_channel_never_unpickles(tmp_path):
    """The decode side's KV control inbox takes msgpack maps only: a pickle frame and malformed ones
    are dropped, unsigned or signed (nothing executed, the control thread goes on) and a real
    transfer still lands."""
    import uuid

    import torch
    import zmq

    from cluster.wire.frame_auth import KV_CONTROL, FrameSigner
    from cluster.wire.messages import Reservation
    from cluster.transport.factory import TransportSpec, create_transport

    marker = tmp_path / "pwned"
    spec = TransportSpec("local", namespace=f"sec-{uuid.uuid4().hex[:8]}", heartbeat_s=0.05, secret=SECRET)
    dst, src = torch.zeros(2, 2, 8, 4, 1, 4), torch.randn(2, 2, 8, 4, 1, 4)
    src[:, :, 0] = 0
    td = create_transport(spec, dst, "d", "decode")
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(td._inbox.endpoint)
    signer = FrameSigner(SECRET, KV_CONTROL, f"d.{td.incarnation}".encode())  # (bound to its receiver)
    push.send(pickle.dumps(_Boom(str(marker))))  # a malicious frame without the key ...
    push.send_multipart(signer.sign(pickle.dumps(_Boom(str(marker)))))  # ... and with it ...
    push.send_multipart(signer.sign(msgpack.packb([1, 2, 3])))  # ... malformed ones ...
    push.send_multipart(signer.sign(msgpack.packb({"t": "b", "p": 7})))
    deadline = time.monotonic() + 10
    while td._inbox.dropped < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert td._inbox.dropped == 4 and td.frames_rejected == 1 and not marker.exists() and td._control.is_alive()
    tp = create_transport(spec, src, "p", "prefill")
    res = Reservation("r", "d", (3, 4), 0)
    td.expect(res, "p")
    from cluster.sampling.logprobs import PrefillLogprobs, TokenLogprobs

    lp = PrefillLogprobs(TokenLogprobs(-0.5, (9, 7), (-0.5, -1.5)), (None, TokenLogprobs(-2.0)))
    tp.send(res, KVHeader("r", 0, 4, 9, logprobs=lp), [5], 10.0)  # ... and a real transfer still lands
    arrivals = []
    while not arrivals and time.monotonic() < deadline:
        arrivals = td.poll_arrivals()
        time.sleep(0.01)
    assert arrivals and arrivals[0].error is None and torch.equal(dst[:, :, 3], src[:, :, 5])
    assert arrivals[0].header.first_token == 9 and arrivals[0].header.logprobs == lp  # typed, in the Commit
    push.close()
    tp.close(), td.close()


# -- internal channels admit only the cluster (issue 29 item 4) ----------------------------------------

def _forgeries(payload: bytes, channel: bytes) -> list[list[bytes]]:
    """What a process without the key can send: the bare payload, a MAC under another key, a MAC for
    another channel, a tag cut short, three parts."""
    from cluster.wire.frame_auth import KV_CONTROL, STATS_SINK, TOKEN_STREAM, FrameSigner

    other = next(c for c in (TOKEN_STREAM, STATS_SINK, KV_CONTROL) if c != channel)
    return [[payload], FrameSigner(b"x" * 32, channel).sign(payload), FrameSigner(SECRET, other).sign(payload),
            [b"short", payload], [*FrameSigner(SECRET, channel).sign(payload), b"extra"]]


def test_frame_auth_accepts_the_clusters_frames_only_and_no_replay():
    from cluster.wire.frame_auth import TOKEN_STREAM, FrameSigner, FrameVerifier

    v = FrameVerifier(SECRET, TOKEN_STREAM)
    a, b = FrameSigner(SECRET, TOKEN_STREAM), FrameSigner(SECRET, TOKEN_STREAM)
    f1, f2, g1 = a.sign(b"one"), a.sign(b"two"), b.sign(b"other sender")
    assert bytes(v.open(f1)) == b"one" and bytes(v.open(g1)) == b"other sender" and bytes(v.open(f2)) == b"two"
    assert v.rejected == 0
    assert v.open(f1) is None and v.open(f2) is None  # replayed
    tampered = [f1[0], b"onf"]
    assert v.open(tampered) is None
    for parts in _forgeries(b"payload", TOKEN_STREAM):
        assert v.open(parts) is None
    assert v.rejected == 3 + 5


def test_token_stream_drops_and_counts_frames_without_the_key():
    """A process on the cluster's network without the key cannot push text into anyone's stream: its
    frames (and a replay of a real one) are dropped before they are decoded, and counted."""
    import zmq

    from cluster.wire.frame_auth import TOKEN_STREAM, FrameSigner
    from cluster.wire.stream_messages import StreamBatch, StreamDelta, encode
    from router.streams.token_stream import TokenStreamReceiver

    async def main():
        rx = TokenStreamReceiver("127.0.0.1", secret=SECRET)
        counted = []
        rx.on_rejected = lambda: counted.append(1)
        mailbox = rx.register("r1")
        rx.start()
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(rx.address)
        forged = encode(StreamBatch("decode-0", 1, (StreamDelta("r1", (66,), "injected"),)))
        real = FrameSigner(SECRET, TOKEN_STREAM).sign(encode(StreamBatch("decode-0", 2, (StreamDelta("r1", (5,), "a"),))))
        push.send_multipart(real)
        for parts in _forgeries(forged, TOKEN_STREAM):
            push.send_multipart(parts)
        push.send_multipart(real)  # a replay of the real one
        last = FrameSigner(SECRET, TOKEN_STREAM).sign(encode(StreamBatch("decode-0", 3, (StreamDelta("r1", (6,), "b", "length"),))))
        push.send_multipart(last)
        got = []
        while not got or got[-1].finish_reason is None:
            got.append(await asyncio.wait_for(mailbox.next(), 10))
        push.close()
        ctx.term()
        await rx.stop()
        return got, rx.frames_rejected, len(counted)

    got, rejected, counted = asyncio.run(main())
    assert [t for d in got for t in d.token_ids] == [5, 6] and "injected" not in "".join(d.text for d in got)
    assert rejected == counted == 6


def test_stats_sink_drops_and_counts_frames_without_the_key(tmp_path):
    import zmq

    from cluster.wire.frame_auth import STATS_SINK, FrameSigner
    from cluster.wire.stream_messages import DecodeStepRecord, StepRecordBatch, encode
    from router.channel.server import RouterServer
    from router.stats.metrics import RouterMetrics

    async def main():
        rs = RouterServer(f"ipc://{tmp_path}/router", "127.0.0.1", RouterMetrics("m"), secret=SECRET)
        task = asyncio.ensure_future(rs._collect_steps())
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(rs.stats_sink)
        forged = encode(StepRecordBatch((DecodeStepRecord("decode-9", 1, 0.0, 999, 1024, 1.0),)))
        for parts in _forgeries(forged, STATS_SINK):
            push.send_multipart(parts)
        real = encode(StepRecordBatch((DecodeStepRecord("decode-0", 1, 0.0, 3, 4, 0.01),)))
        push.send_multipart(FrameSigner(SECRET, STATS_SINK).sign(real))
        deadline = time.monotonic() + 10
        while not json.loads(rs.step_stats.since(0, 10))["decode_steps"] and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        steps = json.loads(rs.step_stats.since(0, 10))["decode_steps"]
        text = rs.metrics.render().decode()
        task.cancel()
        push.close()
        rs.close()
        return steps, text

    steps, text = asyncio.run(main())
    assert [s["worker_id"] for s in steps] == ["decode-0"]
    assert 'pdserve:frames_rejected_total{channel="stats_sink",model_name="m"} 5.0' in text


def test_no_pickle_on_our_sockets():
    """The modules that own a socket or the store (gateway, router, token stream and publisher, KV
    transports, messages) do not import pickle, cloudpickle or dill, nor call torch.load."""
    files = [*ROOT.glob("router/**/*.py"), *ROOT.glob("cluster/transport/*.py"), ROOT / "cluster/wire/messages.py",
             ROOT / "cluster/wire/stream_messages.py", ROOT / "deploy/api_server.py",
             ROOT / "decode_worker/token_publisher.py", ROOT / "prefill_worker/prefill_worker.py"]
    assert len(files) > 10
    bad = re.compile(r"^\s*(import|from)\s+(pickle|cPickle|cloudpickle|dill)\b|pickle\.loads?\(|torch\.load\(|"
                     r"recv_pyobj|send_pyobj", re.M)
    offenders = [str(f.relative_to(ROOT)) for f in files if bad.search(f.read_text())]
    assert not offenders, offenders


def test_api_key_compare_is_constant_time():
    src = (ROOT / "router/openai/middleware.py").read_text()
    check = src[src.index("def check_api_key"):]
    check = check[:check.index("\n\n")]
    assert "hmac.compare_digest" in check and "==" not in check
