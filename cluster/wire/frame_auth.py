"""FrameSigner / FrameVerifier: the cluster's own sockets take frames only from holders of its secret.

The token streams (decode worker -> gateway), the stats sink (decode worker -> router), the KV
transport's control inbox (prefill -> decode worker), the prefill dispatch (router -> prefill
worker) and its answers (prefill worker -> router) are ZMQ PUSH/PULL sockets on the cluster's
network. Every frame on them is a two-part ZMQ message, [tag, payload]:

    tag = sender (8 random bytes, one per signer) | counter (8 bytes, little endian) | MAC (16 bytes)
    MAC = BLAKE2b-128 keyed with the cluster's secret, personalised with the channel's name, over
          sender | counter | payload

The launcher draws the secret (32 random bytes) at start and hands it to each process it starts:
to the workers through Ray (WorkerConfig, TransportSpec), to the API servers on their stdin. A frame
from a process without it, altered, meant for another channel, or replayed (its counter not above
the last one accepted from that sender: one sender's frames arrive in order on one connection, ZMQ
keeps that order) is dropped and counted; nothing of it is decoded. The payloads stay as they are
(msgpack): the MAC authenticates, it does not hide; the cluster's network is trusted to be private
for confidentiality (as with NCCL/gloo traffic), not for integrity.

Why a MAC per frame and not ZMQ CURVE: one keyed hash per frame (~1 us in Python for a token-stream
frame, benchmarks/bench_frame_auth.py), no handshake, no ZAP authenticator thread per process, and the
drop is ours to count; CURVE would also encrypt every byte and needs the key exchange and ZAP set up
on each of the six socket types.

An empty secret is refused (`require_secret`: the cluster fails closed): only a test run that sets
PDSERVE_TEST_EMPTY_SECRET=1 (tests/conftest.py, for pieces built without a launcher) may sign and
check with an empty key, which anyone can forge.

A receiver may bind its frames to itself (`receiver`, e.g. a decode worker's id and incarnation): the
MAC covers it, so a frame captured on its way to one receiver, or to an earlier incarnation of it, is
no frame for another (its replay counters start afresh with each incarnation).
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import os
import struct
from collections import OrderedDict

TAG_BYTES = 32
_MAC_BYTES = 16
_HEAD = struct.Struct("<8sQ")
_SENDERS_KEPT = 4096  # replay counters remembered (least recently seen senders are forgotten)

# Channel names (the MAC's personalisation: a frame of one channel is no frame of another).
TOKEN_STREAM = b"pdserve-tokens"
STATS_SINK = b"pdserve-steps"
KV_CONTROL = b"pdserve-kv-ctl"
PREFILL_DISPATCH = b"pdserve-dispatch"
PREFILL_ANSWER = b"pdserve-answer"


_TEST_EMPTY_SECRET = "PDSERVE_TEST_EMPTY_SECRET"


def new_cluster_secret() -> bytes:
    return os.urandom(32)


def require_secret(secret: bytes, what: str) -> bytes:
    """The secret, as bytes; raises if it is empty, unless this is a test run that allows it."""
    secret = bytes(secret)
    if not secret and os.environ.get(_TEST_EMPTY_SECRET) != "1":
        raise ValueError(f"{what} needs the cluster's secret: an empty one would accept forged frames "
                         "(the launcher draws one; tests that build pieces without it set "
                         f"{_TEST_EMPTY_SECRET}=1)")
    return secret


def _person(channel: bytes, receiver: bytes) -> tuple[bytes, bytes]:
    """(personalisation, what the MAC is prefixed with): the channel's name, and the receiver's."""
    return channel, struct.pack("<H", len(receiver)) + receiver


class FrameSigner:
    """One sender's signer (not thread-safe: one per socket or per sending thread)."""

    def __init__(self, secret: bytes, channel: bytes, receiver: bytes = b""):
        self._key = require_secret(secret, "a frame signer")
        self._channel, self._receiver = _person(channel, receiver)
        self._sender = os.urandom(8)
        self._counter = itertools.count(1)

    def sign(self, payload: bytes) -> list[bytes]:
        """The two parts to send (socket.send_multipart)."""
        head = _HEAD.pack(self._sender, next(self._counter))
        h = hashlib.blake2b(self._receiver, digest_size=_MAC_BYTES, key=self._key, person=self._channel)
        h.update(head)
        h.update(payload)
        return [head + h.digest(), payload]


class FrameVerifier:
    """One receiving socket's check. `rejected` counts the frames it dropped."""

    def __init__(self, secret: bytes, channel: bytes, receiver: bytes = b""):
        self._key = require_secret(secret, "a frame verifier")
        self._channel, self._receiver = _person(channel, receiver)
        self._last: OrderedDict[bytes, int] = OrderedDict()  # sender -> last counter accepted
        self.rejected = 0

    def open(self, parts) -> memoryview | bytes | None:
        """The payload of a received multipart frame (bytes or zmq.Frame parts), or None (dropped,
        counted) if it does not carry a valid MAC under the cluster's secret or replays an older one."""
        if len(parts) != 2:
            self.rejected += 1
            return None
        tag, payload = (p.buffer if hasattr(p, "buffer") else p for p in parts)
        if len(tag) != TAG_BYTES:
            self.rejected += 1
            return None
        tag = bytes(tag)
        head, mac = tag[:-_MAC_BYTES], tag[-_MAC_BYTES:]
        h = hashlib.blake2b(self._receiver, digest_size=_MAC_BYTES, key=self._key, person=self._channel)
        h.update(head)
        h.update(payload)
        if not hmac.compare_digest(h.digest(), mac):
            self.rejected += 1
            return None
        sender, counter = _HEAD.unpack(head)
        last = self._last.get(sender, 0)
        if counter <= last:  # a replay (or a reordering ZMQ never makes on one connection)
            self.rejected += 1
            return None
        self._last[sender] = counter
        self._last.move_to_end(sender)
        if len(self._last) > _SENDERS_KEPT:
            self._last.popitem(last=False)
        return payload
