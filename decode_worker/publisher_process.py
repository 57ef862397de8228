"""PublisherProcess: the decode worker's TokenPublisher in a process of its own (SGLang's detokenizer
process), so detokenizing and sending every token of a large batch never competes with the decode
loop for the interpreter.

The decode worker talks to it as to a TokenPublisher (register, forget, publish, drain, close); each
call is one msgpack frame (msgspec, the messages' own dataclasses, no pickle) on a ZMQ PUSH socket to
the process, in call order, so a request is registered before its first delta arrives there. The
process runs the unchanged TokenPublisher (decode_worker/token_publisher.py): it detokenizes, applies
stop strings, sends each gateway its requests' text and the router its step records. Two things come
back on a ZMQ socket of the worker's: stop-string matches (the worker drops the request: `on_stop`)
and the frames of requests without a gateway (`drain()`: tests and in-process use), which the
process sends like any gateway's, to the worker's own sink.

    loop thread:  publish(batch) -> encode (~0.1 ms at 256 rows) -> PUSH   (never blocks)
    publisher process:  PULL -> TokenPublisher -> gateways' sinks, router's stats sink
                                               -> stop matches, local frames -> worker's PULL

The worker's three sockets (frames to the process, its control frames back, the local frames) are
ipc:// paths in a directory only this user can enter (cluster/wire/socket_bounds.py), and the process
connects only to such paths: no other local user can take the worker's frames (prompts, tokens) off
its PUSH socket, nor send a stop for any request id to its control socket.

The process is started with the worker (`python -m decode_worker.publisher_process`, the worker's
interpreter and environment) and says when it is ready; it exits when told to, or when the worker's
process is gone, and its last control frame says bye, once every frame it sent is out of it (the
worker's halt() and close() wait for that event, not for a poll of the process). A publisher process that died is reported (`alive`): the worker says it is
unhealthy, so the router moves its requests.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import subprocess
import sys
import threading
from collections import deque
from typing import Callable

import msgspec

from cluster.wire.messages import GenerateRequest, TokenBatch

log = logging.getLogger(__name__)

# Frame kinds, worker -> process
_REGISTER, _FORGET, _BATCH, _CLOSE, _HALT = b"R", b"F", b"B", b"C", b"H"
# process -> worker (control socket); _BYE: its last frame, once everything it sent anywhere is out of it
_READY, _STOP, _BYE = b"r", b"s", b"x"
_SEND_WAIT_MS = 5000  # how long a frame waits for the process's connection (only before a frame got through)
_HWM = 1_000_000  # frames queued toward the process before a send would fail (it is stuck or gone)


class PublisherProcess:
    """A TokenPublisher's interface over a child process running one."""

    def __init__(self, worker_id: str, model_dir: str, stats_sink: str | None = None,
                 on_stop: Callable[[str], None] | None = None, keep_local: int = 100_000,
                 start_timeout_s: float = 120.0, secret: bytes = b""):
        """secret: the cluster's (cluster/wire/frame_auth.py): the process signs every frame under it; it
        reaches the process on its stdin, never on its command line."""
        import zmq

        from cluster.wire.frame_auth import TOKEN_STREAM, FrameVerifier
        from cluster.wire.socket_bounds import MAX_INTERNAL_FRAME, MAX_TOKEN_FRAME, bound, private_endpoint
        from cluster.wire.stream_messages import decode_stream_batch

        self.worker_id = worker_id
        self.on_stop = on_stop
        self._decode_local = decode_stream_batch
        self._verify_local = FrameVerifier(secret, TOKEN_STREAM)  # its frames back to us are signed too
        self._encode = msgspec.msgpack.Encoder().encode
        ctx = zmq.Context.instance()
        self._out = bound(ctx.socket(zmq.PUSH), MAX_INTERNAL_FRAME, _HWM)
        self._out.setsockopt(zmq.LINGER, 2000)
        out_addr = private_endpoint("pub-in")
        self._out.bind(out_addr)
        self._control = bound(ctx.socket(zmq.PULL), MAX_INTERNAL_FRAME)
        control_addr = private_endpoint("pub-ctl")
        self._control.bind(control_addr)
        self._local_sock = bound(ctx.socket(zmq.PULL), MAX_TOKEN_FRAME)
        self.local_address = private_endpoint("pub-local")
        self._local_sock.bind(self.local_address)
        self._lock = threading.Lock()  # the PUSH socket: callers' threads and the decode loop send
        self._local: deque = deque(maxlen=keep_local)
        self._local_cv = threading.Condition()
        self._closed = False
        self._halted = False
        self._peer_seen = False  # a frame has reached the process's connection (see _send)
        self._gone = threading.Event()  # the process said bye (or exited without): it sends nothing more
        cmd = [sys.executable, "-m", "decode_worker.publisher_process", "--worker-id", worker_id,
               "--model-dir", str(model_dir), "--input", out_addr, "--control", control_addr,
               "--parent-pid", str(os.getpid())]
        if stats_sink:
            cmd += ["--stats-sink", stats_sink]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE)
        self.proc.stdin.write(secret.hex().encode() + b"\n")
        self.proc.stdin.close()
        self._start_timeout_s = start_timeout_s
        self._thread: threading.Thread | None = None

    def wait_ready(self) -> None:
        """Returns once the process has loaded its tokenizer and listens (it starts at construction,
        so the worker can load its model meanwhile); nothing may be sent before."""
        if self._thread is not None:
            return
        if not self._control.poll(int(self._start_timeout_s * 1000)) or self._control.recv() != _READY:
            self.proc.kill()
            raise RuntimeError(f"the token publisher process of {self.worker_id} did not start "
                               f"(exit code {self.proc.poll()})")
        self._thread = threading.Thread(target=self._receive, name=f"publisher-returns-{self.worker_id}",
                                        daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return not self._gone.is_set() and self.proc.poll() is None

    # -- the TokenPublisher interface (any thread) -------------------------------------------------
    def register(self, req: GenerateRequest) -> None:
        """Before the request can produce a token (reserve / submit_local). A request without a gateway
        (reply_to None) has its frames sent back here, for drain()."""
        if req.reply_to is None:
            req = dataclasses.replace(req, reply_to=self.local_address)
        self._send(_REGISTER + self._encode(req))

    def forget(self, request_id: str) -> None:
        self._send(_FORGET + request_id.encode())

    def publish(self, batch: TokenBatch) -> None:
        self._send(_BATCH + self._encode(batch))

    def drain(self, timeout: float = 0.0):
        """The StreamBatches of requests without a reply_to so far (waits up to `timeout` for one)."""
        with self._local_cv:
            if not self._local and timeout > 0:
                self._local_cv.wait(timeout)
            out = list(self._local)
            self._local.clear()
            return out

    def halt(self, timeout_s: float = 5.0) -> None:
        """Fault injection ("restart", a crash): the process sends every batch it was given so far
        (TokenPublisher.halt) and exits; later frames are dropped here. Returns once it said bye, which
        it does only once those batches' frames are out of it (TokenPublisher._run's end): till then
        `alive` holds, after it does not."""
        self._send(_HALT)
        self._halted = True
        if self._thread is not None:  # (it hears the bye; it also ends, and says so, if the process dies)
            if not self._gone.wait(timeout_s):
                log.error("token publisher process of %s did not halt in %.0f s", self.worker_id, timeout_s)
            return
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.error("token publisher process of %s did not halt in %.0f s", self.worker_id, timeout_s)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._thread is None:
                raise RuntimeError("never ready")  # nothing can reach it: stop it
            self._send(_CLOSE)
            self.proc.wait(timeout=10)
        except (subprocess.TimeoutExpired, Exception):  # noqa: BLE001 - a stuck child is killed
            self.proc.kill()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for s in (self._out, self._control, self._local_sock):
            s.close(linger=0)

    def _send(self, frame: bytes) -> None:
        import zmq

        with self._lock:
            if self._halted:
                return  # a halted publisher takes nothing more (TokenPublisher.halt)
            try:
                # NOTE: does not block the caller (the decode loop) while the process takes frames.
                self._out.send(frame, zmq.NOBLOCK)
                self._peer_seen = True
            except zmq.Again:
                # HAZARD: a bound PUSH raises Again while no peer has finished its handshake, and the
                # process's READY (another socket) can arrive first: the worker's first frames would be
                # lost (a request that never streams). So, until a frame has gone through, wait a bounded
                # time for the peer. After that, Again means _HWM queued frames: the process is stuck,
                # and the frame is dropped at once (its requests time out), never stalling the loop.
                if not self._peer_seen and self._out.poll(_SEND_WAIT_MS, zmq.POLLOUT):
                    self._out.send(frame, zmq.NOBLOCK)
                    self._peer_seen = True
                else:
                    log.error("token publisher process of %s is not taking frames; one dropped", self.worker_id)
            except zmq.ZMQError:
                if not self._closed:
                    raise

    # -- what comes back --------------------------------------------------------------------------
    def _receive(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._control, zmq.POLLIN)
        poller.register(self._local_sock, zmq.POLLIN)
        while not self._closed:
            try:
                # After the bye only what is still on its way to the local sink: then this thread ends
                # (close() joins it without waiting out a poll).
                ready = dict(poller.poll(10 if self._gone.is_set() else 200))
            except zmq.ZMQError:
                self._gone.set()
                return
            if self._local_sock in ready:
                payload = self._verify_local.open(self._local_sock.recv_multipart())
                if payload is None:
                    log.warning("token publisher of %s: a local frame without a valid MAC dropped", self.worker_id)
                else:
                    batch = self._decode_local(payload)
                    with self._local_cv:
                        self._local.append(batch)
                        self._local_cv.notify_all()
            if self._control in ready:
                msg = self._control.recv()
                if msg[:1] == _BYE:
                    self._gone.set()
                elif msg[:1] == _STOP and self.on_stop is not None:
                    try:
                        self.on_stop(msg[1:].decode())
                    except Exception:  # noqa: BLE001 - one request's abort must not end the returns
                        log.exception("on_stop failed")
            if not ready and not self.alive:
                if not self._gone.is_set() and not self._closed:
                    log.error("token publisher process of %s exited with %s", self.worker_id, self.proc.returncode)
                self._gone.set()
                return
        self._gone.set()


def make_publisher(worker_id: str, cfg, stats_sink: str | None, on_stop, where: str):
    """A decode worker's token publisher (`cfg`: its WorkerConfig): in a process of its own ("process",
    the served path: it never competes with the decode loop for the interpreter), or on a thread of the
    caller's ("thread")."""
    if where not in ("process", "thread"):
        raise ValueError(f"token_publisher must be 'process' or 'thread', got {where!r}")
    if where == "process":
        return PublisherProcess(worker_id, cfg.model_dir, stats_sink, on_stop=on_stop, secret=cfg.cluster_secret)
    from cluster.text.tokenizer import load_tokenizer
    from decode_worker.token_publisher import TokenPublisher

    return TokenPublisher(worker_id, load_tokenizer(cfg.model_dir), stats_sink, on_stop=on_stop,
                          secret=cfg.cluster_secret)


def publisher_tokenizer(model_dir: str):
    """The tokenizer the process decodes with: the cached Rust one (cluster/text/decode_tokenizer.py: no
    transformers or torch import, ~0.1 s) once any process of this machine loaded the checkpoint's
    tokenizer, else transformers' (3-9 s of CPU), which also caches it for the next start."""
    from cluster.text.decode_tokenizer import DecodeTokenizer

    tok = DecodeTokenizer.cached(model_dir)
    if tok is None:
        from cluster.text.tokenizer import load_tokenizer

        tok = load_tokenizer(model_dir)
    return tok


def _serve(args) -> None:
    """The process: a TokenPublisher fed from the worker's frames."""
    import zmq

    from cluster.wire.socket_bounds import MAX_INTERNAL_FRAME, bound, check_private_endpoint
    from decode_worker.token_publisher import TokenPublisher

    ctx = zmq.Context.instance()
    control = ctx.socket(zmq.PUSH)
    control.setsockopt(zmq.LINGER, 1000)
    control.connect(check_private_endpoint(args.control))
    control_lock = threading.Lock()

    def stopped(request_id: str) -> None:  # the publisher's thread
        with control_lock:
            control.send(_STOP + request_id.encode())

    secret = bytes.fromhex(sys.stdin.readline().strip())  # the worker writes it first (never in argv)
    pub = TokenPublisher(args.worker_id, publisher_tokenizer(args.model_dir), args.stats_sink, on_stop=stopped,
                         secret=secret)
    inbox = bound(ctx.socket(zmq.PULL), MAX_INTERNAL_FRAME, _HWM)
    inbox.connect(check_private_endpoint(args.input))
    decode_request = msgspec.msgpack.Decoder(GenerateRequest).decode
    decode_batch = msgspec.msgpack.Decoder(TokenBatch).decode
    with control_lock:
        control.send(_READY)
    try:
        while True:
            if not inbox.poll(1000):
                if os.getppid() != args.parent_pid:  # the worker is gone: nobody will tell us to stop
                    return
                continue
            frame = inbox.recv()
            kind, body = frame[:1], frame[1:]
            if kind == _BATCH:
                pub.publish(decode_batch(body))
            elif kind == _REGISTER:
                pub.register(decode_request(body))
            elif kind == _FORGET:
                pub.forget(body.decode())
            elif kind == _CLOSE:
                return
            elif kind == _HALT:
                pub.halt()  # sends what it holds, then takes nothing more
                return
    finally:
        pub.close()  # its frames are out of this process once it returns (TokenPublisher._run's end)
        with control_lock:
            try:
                control.send(_BYE, zmq.NOBLOCK)  # after every stop: the worker's PULL takes them in order
            except zmq.ZMQError:
                pass  # the worker is gone
        # The frames sent on `control` go out before the process exits (within its linger).
        ctx.destroy(linger=1000)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m decode_worker.publisher_process")
    ap.add_argument("--worker-id", required=True)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--input", required=True)
    ap.add_argument("--control", required=True)
    ap.add_argument("--stats-sink", default=None)
    ap.add_argument("--parent-pid", type=int, required=True)
    logging.basicConfig(level=logging.WARNING)
    _serve(ap.parse_args(argv))


if __name__ == "__main__":
    main()
