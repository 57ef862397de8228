"""The KV-block rules of cluster/kv/kv_blocks.py, the chat default max_tokens of cluster/kv/request_limits.py
and the router's ZMQ receive loop (router/streams/receive_loop.py), each written once: every user gives the
rule's answer, and no module spells the arithmetic again (a source check)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
import zmq

from cluster.kv.block_pool import PrefixCachingBlockPool
from cluster.errors import InvalidRequestError
from cluster.kv.kv_blocks import blocks_for_tokens, decode_held_blocks, decode_held_tokens
from cluster.kv.request_limits import check_request_fits, default_max_tokens, largest_max_tokens
from cluster.sampling.sampling_params import SamplingParams
from cluster.engine.sequence import Sequence
from decode_worker.block_manager import BlockManager
from router.requests.admission import AdmissionController, AdmissionLimits
from router.streams.receive_loop import received

ROOT = Path(__file__).resolve().parents[3]
SERVING = ("cluster", "prefill_worker", "decode_worker", "router", "deploy")


def test_blocks_for_tokens_rounds_up_and_a_decode_worker_holds_one_more_token():
    assert [blocks_for_tokens(n, 16) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]
    assert decode_held_tokens(15) == 16 and decode_held_blocks(15, 16) == 1 and decode_held_blocks(16, 16) == 2


@pytest.mark.parametrize("n", [1, 15, 16, 17, 100])
def test_every_user_counts_blocks_by_the_rule(n):
    bs = 16
    admission = AdmissionController(AdmissionLimits(max_model_len=4096, block_size=bs))
    blocks = BlockManager(64, bs)
    assert (PrefixCachingBlockPool(64, bs).blocks_for_tokens(n) == blocks.blocks_for_tokens(n)
            == admission.blocks_for(n) == blocks_for_tokens(n, bs))
    # What the router reserves for a prompt of n tokens is what the decode worker's block manager takes.
    assert admission.decode_blocks_for(n) == decode_held_blocks(n, bs)
    seq = Sequence("r", list(range(1, n + 1)), SamplingParams(max_tokens=4), seed=0)
    assert blocks.allocate_prompt(seq)
    assert len(seq.block_table) == decode_held_blocks(n, bs)
    # A pool of exactly that many blocks fits prompt + max_tokens tokens; one token more does not.
    check_request_fits(n, 4, 4096, block_size=bs, kv_blocks=blocks_for_tokens(n + 4, bs))
    with pytest.raises(InvalidRequestError):
        check_request_fits(n, 4, 4096, block_size=bs, kv_blocks=blocks_for_tokens(n + 4, bs) - 1)


def _spelled_again() -> list[str]:
    ceil = re.compile(r"-\(-[^\n]*//\s*[\w.]*block_size\)")  # -(-n // block_size): the rounding again
    plus_one = re.compile(r"blocks_for\([^)\n]*\+ 1\)")  # blocks_for(prompt + 1): the decode slot again
    bad = []
    for pkg in SERVING:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            if f.name == "kv_blocks.py":
                continue
            for i, line in enumerate(f.read_text().splitlines(), 1):
                if ceil.search(line) or plus_one.search(line):
                    bad.append(f"{f.relative_to(ROOT)}:{i}: {line.strip()}")
    return bad


def test_no_module_spells_the_block_rules_again():
    assert _spelled_again() == []


@pytest.mark.parametrize("prompt", [1, 100, 999, 1000])
@pytest.mark.parametrize("kv_tokens", [None, 640, 4096])
def test_the_chat_default_max_tokens_is_the_most_the_fit_check_accepts(prompt, kv_tokens):
    max_model_len, bs = 1024, 16
    room = largest_max_tokens(prompt, max_model_len, kv_tokens)
    kv_blocks = None if kv_tokens is None else kv_tokens // bs
    if room >= 1:
        check_request_fits(prompt, room, max_model_len, block_size=bs, kv_blocks=kv_blocks)
    with pytest.raises(InvalidRequestError):
        check_request_fits(prompt, max(room, 0) + 1, max_model_len, block_size=bs, kv_blocks=kv_blocks)
    assert default_max_tokens(prompt, max_model_len, kv_tokens, None) == max(1, room)
    assert default_max_tokens(prompt, max_model_len, kv_tokens, 7) == max(1, min(room, 7))  # the model's own cap


class _FakeSocket:
    def __init__(self, reads):
        self.reads, self.closed = list(reads), False

    async def read(self):
        r = self.reads.pop(0)
        if r == "closed":
            self.closed = True
            raise zmq.ZMQError(zmq.ENOTSOCK)
        if isinstance(r, BaseException):
            raise r
        return r


def test_the_receive_loop_skips_bad_frames_and_ends_when_the_socket_closes(caplog):
    sock = _FakeSocket(["a", None, ValueError("malformed"), zmq.ZMQError(zmq.EAGAIN), "b", "closed", "never"])

    async def collect():
        return [m async for m in received(sock, sock.read, "test frame")]

    assert asyncio.run(collect()) == ["a", "b"]
    assert sock.reads == ["never"]
    assert "dropping a malformed test frame" in caplog.text and "receiving a test frame failed" in caplog.text
