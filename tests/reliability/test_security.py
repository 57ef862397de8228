"""Security of the cluster's own sockets (no cluster needed; the API key on /v1 is tested against a
real gateway in test_bad_input.py): the KV rendezvous store listens on the internal address only and
refuses a wildcard one; the token stream and the transport control plane never unpickle anything."""

from __future__ import annotations

import asyncio
import os
import pickle
import re
import time
from pathlib import Path

import msgpack
import psutil
import pytest

from cluster.errors import PdserveError
from deploy.kv_transport_group import rendezvous_store
from cluster.messages import KVHeader

ROOT = Path(__file__).resolve().parents[2]


def _listening(port: int) -> set[str]:
    return {c.laddr.ip for c in psutil.Process(os.getpid()).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


@pytest.mark.parametrize("host", ["0.0.0.0", "::", ""])
def test_store_refuses_a_wildcard_address(host):
    with pytest.raises(PdserveError, match="internal address"):
        rendezvous_store(host)


def test_store_listens_on_the_internal_address_only():
    import datetime

    import torch.distributed as dist

    store = rendezvous_store("127.0.0.1")
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


def test_token_stream_never_unpickles(tmp_path):
    import zmq

    from cluster.stream_messages import StreamBatch, StreamDelta, encode
    from router.token_stream import TokenStreamReceiver

    marker = tmp_path / "pwned"

    async def main():
        rx = TokenStreamReceiver("127.0.0.1")
        mailbox = rx.register("r1")
        rx.start()
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(rx.address)
        push.send(pickle.dumps(_Boom(str(marker))))  # a malicious frame ...
        push.send(msgpack.packb({"garbage": [1, 2]}))  # ... a malformed one ...
        push.send(encode(StreamBatch("decode-0", 1, (StreamDelta("r1", (5, 6), "ab"),))))  # ... a good one
        delta = await asyncio.wait_for(mailbox.next(), 10)
        push.close()
        ctx.term()
        await rx.stop()
        return delta

    assert asyncio.run(main()).token_ids == (5, 6)
    assert not marker.exists()


def test_kv_control_channel_never_unpickles(tmp_path):
    """The decode side's KV control inbox takes msgpack maps only: a pickle frame and malformed ones
    are dropped (nothing executed, the control thread goes on) and a real transfer still lands."""
    import uuid

    import torch
    import zmq

    from cluster.messages import Reservation
    from cluster.transport.factory import TransportSpec, create_transport

    marker = tmp_path / "pwned"
    spec = TransportSpec("local", namespace=f"sec-{uuid.uuid4().hex[:8]}", heartbeat_s=0.05)
    dst, src = torch.zeros(2, 2, 8, 4, 1, 4), torch.randn(2, 2, 8, 4, 1, 4)
    src[:, :, 0] = 0
    td = create_transport(spec, dst, "d", "decode")
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(td._inbox.endpoint)
    push.send(pickle.dumps(_Boom(str(marker))))  # a malicious frame ...
    push.send(msgpack.packb([1, 2, 3]))  # ... malformed ones ...
    push.send(msgpack.packb({"t": "b", "p": 7}))
    deadline = time.monotonic() + 10
    while td._inbox.dropped < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert td._inbox.dropped == 3 and not marker.exists() and td._control.is_alive()
    tp = create_transport(spec, src, "p", "prefill")
    res = Reservation("r", "d", (3, 4), 0)
    td.expect(res, "p")
    from cluster.logprobs import PrefillLogprobs, TokenLogprobs

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


def test_no_pickle_on_our_sockets():
    """The modules that own a socket or the store (gateway, router, token stream and publisher, KV
    transports, messages) do not import pickle, cloudpickle or dill, nor call torch.load."""
    files = [*ROOT.glob("router/**/*.py"), *ROOT.glob("cluster/transport/*.py"), ROOT / "cluster/messages.py",
             ROOT / "cluster/stream_messages.py", ROOT / "deploy/api_server.py",
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
