"""The cluster's ZMQ channels under attack (issue 37 items 2-5), each on the real component with real
sockets: frames too large to hold before their MAC is checked, a flood of forgeries (counted, logged
once), a dead gateway beside a live one, another local user at a worker's internal channels (the
publisher process, the tensor-parallel step and RPC channels), a control frame replayed to another
receiver or incarnation, an empty secret, the secret in a repr."""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import time

import pytest
import zmq

from cluster.wire.frame_auth import KV_CONTROL, FrameSigner
from cluster.wire.socket_bounds import MAX_KV_CONTROL_FRAME, check_private_endpoint, private_endpoint
from cluster.transport.channel import Abort, Inbox, Outbox

SECRET = b"k" * 32


def _recv_all(inbox: Inbox, n: int, timeout: float = 5.0) -> list:
    got, deadline = [], time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got += inbox.recv(0.05)
    return got


def test_an_oversized_frame_is_never_held_and_the_channel_serves_on():
    inbox = Inbox("127.0.0.1", "big", SECRET, receiver="d.1")
    attacker = zmq.Context.instance().socket(zmq.PUSH)
    attacker.setsockopt(zmq.LINGER, 0)
    attacker.connect(inbox.endpoint)
    big = b"\0" * (MAX_KV_CONTROL_FRAME + 1)
    for _ in range(4):  # 4 x 64 MiB: the receiver drops the connection at the first frame's size
        attacker.send_multipart([b"t" * 32, big])
    real = Outbox(inbox.endpoint, SECRET, receiver="d.1")
    real.send(Abort("p", 1, "r1"))
    got = _recv_all(inbox, 1)
    assert [m.request_id for m in got] == ["r1"]
    assert inbox.rejected == 0  # nothing of the big frames reached the MAC check: ZMQ refused them
    attacker.close(0), real.close(), inbox.close()


def test_a_flood_of_forgeries_is_counted_and_logged_once(caplog):
    inbox = Inbox("127.0.0.1", "flood", SECRET, receiver="d.1")
    attacker = zmq.Context.instance().socket(zmq.PUSH)
    attacker.connect(inbox.endpoint)
    forger = FrameSigner(b"x" * 32, KV_CONTROL, b"d.1")
    with caplog.at_level(logging.WARNING, logger="cluster.transport.channel"):
        for i in range(2000):
            attacker.send_multipart(forger.sign(b"junk%d" % i))
        real = Outbox(inbox.endpoint, SECRET, receiver="d.1")
        real.send(Abort("p", 1, "after-the-flood"))
        got = _recv_all(inbox, 1)
    assert [m.request_id for m in got] == ["after-the-flood"] and inbox.rejected == 2000
    assert len([r for r in caplog.records if "MAC" in r.getMessage()]) <= 1
    attacker.close(0), real.close(), inbox.close()


def test_a_frame_replayed_to_another_receiver_or_incarnation_is_dropped():
    old, other, now = (Inbox("127.0.0.1", n, SECRET, receiver=r) for n, r in
                       (("old", "d.1"), ("other", "e.2"), ("now", "d.2")))
    sent = Outbox(old.endpoint, SECRET, receiver="d.1")
    captured = []
    spy = zmq.Context.instance().socket(zmq.PULL)  # what an observer of the network captured
    spy_ep = f"tcp://127.0.0.1:{spy.bind_to_random_port('tcp://127.0.0.1')}"
    tap = Outbox(spy_ep, SECRET, receiver="d.1")
    tap.send(Abort("p", 1, "r1"))
    assert spy.poll(5000)
    captured = spy.recv_multipart()
    for target in (other, now):
        replay = zmq.Context.instance().socket(zmq.PUSH)
        replay.connect(target.endpoint)
        replay.send_multipart(captured)
        time.sleep(0.2)
        assert target.recv(0.2) == [] and target.rejected == 1
        replay.close(0)
    sent.send(Abort("p", 2, "r2"))
    assert [m.request_id for m in _recv_all(old, 1)] == ["r2"]  # (the frame's own receiver takes it)
    for s in (sent, tap):
        s.close()
    spy.close(0)
    for i in (old, other, now):
        i.close()


def test_a_dead_gateway_does_not_stop_the_others(demo_model_dir):
    """Two gateways' sinks; one is gone (nobody listens). The live one gets every frame, at once."""
    from cluster.wire.messages import GenerateRequest, TokenBatch, TokenDelta
    from cluster.sampling.sampling_params import SamplingParams
    from cluster.text.tokenizer import load_tokenizer
    from cluster.wire.frame_auth import TOKEN_STREAM, FrameVerifier
    from cluster.wire.stream_messages import decode_stream_batch
    from decode_worker.token_publisher import TokenPublisher

    live = zmq.Context.instance().socket(zmq.PULL)
    live_ep = f"tcp://127.0.0.1:{live.bind_to_random_port('tcp://127.0.0.1')}"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_ep = f"tcp://127.0.0.1:{s.getsockname()[1]}"  # (closed again: nobody listens there)
    pub = TokenPublisher("d0", load_tokenizer(demo_model_dir), secret=SECRET)
    params = SamplingParams(max_tokens=100)
    pub.register(GenerateRequest("a", (1, 2), params, 0, 0.0, reply_to=live_ep))
    pub.register(GenerateRequest("b", (1, 2), params, 0, 0.0, reply_to=dead_ep))
    t0 = time.monotonic()
    for step in range(50):
        pub.publish(TokenBatch("d0", step, (TokenDelta("a", (5,)), TokenDelta("b", (6,)))))
    got, check = 0, FrameVerifier(SECRET, TOKEN_STREAM)
    while got < 50 and time.monotonic() - t0 < 10:
        if live.poll(100):
            batch = decode_stream_batch(check.open(live.recv_multipart()))
            got += sum(len(d.token_ids) for d in batch.deltas if d.request_id == "a")
    assert got == 50 and time.monotonic() - t0 < 5
    pub.close()
    live.close(0)


def _connect_as_another_user(path: str) -> int:
    """Forks a child that drops to uid/gid 65534 and connects to the unix socket at `path`: 0 if it
    could, 13 if the permissions refused it."""
    pid = os.fork()
    if pid == 0:  # the child: no Python-level cleanup, no threads of the parent
        code = 1
        try:
            os.setgid(65534)
            os.setuid(65534)
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(path)
            code = 0
        except PermissionError:
            code = 13
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.skipif(os.getuid() != 0, reason="switching to another user needs root")
def test_another_local_user_cannot_reach_a_workers_internal_channels():
    from cluster.distributed.rank_rpc import RankRPC
    from cluster.distributed.step_channel import StepSubscriber

    sub, rpc = StepSubscriber(), RankRPC(1)
    pull = zmq.Context.instance().socket(zmq.PULL)
    pub_ep = private_endpoint("pub-ctl")  # as the publisher process's control socket is made
    pull.bind(pub_ep)
    for ep in (sub.endpoint, rpc.endpoint, pub_ep):
        assert _connect_as_another_user(ep[len("ipc://"):]) == 13, ep
    # The same connect to a socket in a directory open to others succeeds: the test can fail.
    open_dir = tempfile.mkdtemp()
    os.chmod(open_dir, 0o777)
    probe = zmq.Context.instance().socket(zmq.PULL)
    probe.bind(f"ipc://{open_dir}/probe")
    os.chmod(f"{open_dir}/probe", 0o777)
    assert _connect_as_another_user(f"{open_dir}/probe") == 0
    for s in (pull, probe):
        s.close(0)
    sub.close(), rpc.close()


def test_internal_channels_connect_only_to_private_paths(tmp_path):
    """A forged endpoint in a group's store (another user's socket, a TCP port) is refused."""
    from cluster.distributed.step_channel import StepPublisher

    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    for forged in ("tcp://127.0.0.1:5555", f"ipc://{shared}/x", "ipc:///nonexistent/x"):
        with pytest.raises(PermissionError):
            check_private_endpoint(forged)
        with pytest.raises(PermissionError):
            StepPublisher([forged])
    ep = private_endpoint("ok")
    assert check_private_endpoint(ep) == ep
    st = os.stat(os.path.dirname(ep[len("ipc://"):]))
    assert st.st_uid == os.getuid() and st.st_mode & 0o777 == 0o700


def test_the_publisher_process_connects_only_to_private_paths():
    """Given TCP endpoints (what another local user could listen on), the process refuses them before
    it sends or takes a frame (its entry point, in this process)."""
    import argparse

    from decode_worker.publisher_process import _serve

    args = argparse.Namespace(worker_id="d0", model_dir="/nonexistent", input="tcp://127.0.0.1:1",
                              control="tcp://127.0.0.1:2", stats_sink=None, parent_pid=os.getpid())
    with pytest.raises(PermissionError, match="ipc://"):
        _serve(args)


def test_an_empty_secret_is_refused_outside_tests(monkeypatch):
    from cluster.wire.frame_auth import FrameVerifier
    from cluster.transport.authenticated_store import AuthenticatedStore

    monkeypatch.delenv("PDSERVE_TEST_EMPTY_SECRET", raising=False)
    import torch.distributed as dist

    for build in (lambda: FrameSigner(b"", KV_CONTROL), lambda: FrameVerifier(b"", KV_CONTROL),
                  lambda: Inbox(None, "empty", b""), lambda: AuthenticatedStore(dist.HashStore(), b"")):
        with pytest.raises(ValueError, match="secret"):
            build()


def test_the_secret_is_in_no_repr():
    from cluster.distributed.tp_group import TPRendezvous
    from cluster.transport.transport_spec import TransportSpec
    from cluster.worker.worker_config import WorkerConfig
    from deploy.api_server import APIServerSpec

    secret = bytes(range(1, 33))
    spec = APIServerSpec(index=0, router_address="ipc:///x", model_dir="m", served_model_name="m",
                         max_model_len=64, api_key="the-api-key", max_body_bytes=1, token_timeout_s=1.0,
                         drain_timeout_s=1.0, sink_host="127.0.0.1", listen_fd=3, parent_pid=1, cluster_secret=secret)
    for obj in (TransportSpec("local", secret=secret), WorkerConfig("m", cluster_secret=secret),
                TPRendezvous("127.0.0.1", 1, "ns", 2, secret=secret), spec):
        text = repr(obj) + str(obj)
        assert repr(secret)[2:12] not in text and secret.hex() not in text, text
    assert "the-api-key" not in repr(spec) and "index=0" in repr(spec)
