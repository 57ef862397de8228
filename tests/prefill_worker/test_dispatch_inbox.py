"""DispatchInbox (the prefill worker's end) with PrefillDispatcher (the router's): a task sent as a
signed frame reaches the worker's submit on the inbox's thread, its result call finds it whichever
came first, and frames not for this worker (no secret, another incarnation, garbage, too many) are
dropped and counted, their result calls failing instead of hanging."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future

import pytest
import zmq

from cluster.sampling.sampling_params import SamplingParams
from cluster.wire.frame_auth import PREFILL_DISPATCH, FrameSigner
from cluster.wire.messages import GenerateRequest, PrefillResult, PrefillTask
from prefill_worker.dispatch_inbox import DispatchError, DispatchInbox
from router.workers.prefill_dispatcher import PrefillDispatcher

SECRET = bytes(range(32))


def task(rid: str = "r") -> PrefillTask:
    return PrefillTask(GenerateRequest(rid, (1, 2, 3), SamplingParams(max_tokens=3), 0, 0.0))


class Worker:
    """PrefillWorker.submit's contract: returns a future at once; here resolved when the test says."""

    def __init__(self, resolve_at_once: bool = True):
        self.resolve_at_once = resolve_at_once
        self.error: Exception | None = None  # submit raises it
        self.tasks: list[tuple[PrefillTask, str, Future]] = []

    def submit(self, t: PrefillTask) -> Future:
        if self.error is not None:
            raise self.error
        f: Future = Future()
        self.tasks.append((t, threading.current_thread().name, f))
        if self.resolve_at_once:
            f.set_result(PrefillResult(t.request.request_id, 7, 0.0, 0.0, 0.0, 0))
        return f


@pytest.fixture
def pair():
    worker = Worker()
    inbox = DispatchInbox("127.0.0.1", "p0/a", worker.submit, SECRET, "p0.inc-a", arrival_wait_s=0.5).start()
    d = PrefillDispatcher("p0", SECRET)
    yield worker, inbox, d
    d.close()
    inbox.close()


def wait_until(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_no_endpoint_no_frame_then_the_task_reaches_submit_on_the_inbox_thread(pair):
    worker, inbox, d = pair
    assert d.send(task()) is None  # no stats yet: the caller dispatches through Ray
    d.follow({"incarnation": "inc-a"})  # a worker without a dispatch socket: still none
    assert d.send(task()) is None
    d.follow({"dispatch": inbox.endpoint, "incarnation": "inc-a"})
    call_id, inc = d.send(task("r1"))
    assert inc == "inc-a"
    result = asyncio.run(inbox.result(call_id))
    assert result.request_id == "r1" and result.first_token == 7
    (t, thread, _), = worker.tasks
    assert t == task("r1") and thread.startswith("dispatch-")  # not the actor's loop, not Ray's
    assert inbox.received == 1 and inbox.rejected == 0


def test_the_result_call_may_come_before_its_frame_and_waits_for_the_prompt():
    worker = Worker(resolve_at_once=False)
    inbox = DispatchInbox(None, "p0/b", worker.submit, SECRET, "p0.b").start()  # in-process endpoint
    d = PrefillDispatcher("p0", SECRET)
    d.follow({"dispatch": inbox.endpoint, "incarnation": "b"})

    async def main():
        waiting = asyncio.ensure_future(inbox.result(1))  # the Ray call overtook the frame
        await asyncio.sleep(0.05)
        assert d.send(task("early")) == (1, "b")
        while not worker.tasks:
            await asyncio.sleep(0.005)
        assert not waiting.done()  # the prompt runs: no arrival deadline once its frame came
        worker.tasks[0][2].set_result(PrefillResult("early", 3, 0.0, 0.0, 0.0, 0))
        return await waiting

    try:
        assert asyncio.run(main()).first_token == 3
        assert not inbox._calls  # answered calls are not kept
    finally:
        d.close()
        inbox.close()


def test_a_failed_prompt_reaches_its_result_call(pair):
    worker, inbox, d = pair
    worker.error = RuntimeError("no room")
    d.follow({"dispatch": inbox.endpoint, "incarnation": "inc-a"})
    call_id, _ = d.send(task())
    with pytest.raises(RuntimeError, match="no room"):
        asyncio.run(inbox.result(call_id))


@pytest.mark.parametrize("sender", ["another_incarnation", "no_secret", "replayed", "not_a_task"])
def test_frames_not_for_this_worker_are_dropped_and_their_result_call_fails(pair, sender):
    worker, inbox, d = pair
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(inbox.endpoint)
    try:
        if sender == "another_incarnation":  # what a router still connected to the last one sends
            d.follow({"dispatch": inbox.endpoint, "incarnation": "inc-old"})
            call_id, _ = d.send(task())
        else:
            from cluster.wire.prefill_dispatch import PrefillDispatch, encode_dispatch
            call_id = 5
            key = b"x" * 32 if sender == "no_secret" else SECRET
            signer = FrameSigner(key, PREFILL_DISPATCH, b"p0.inc-a")
            payload = b"\x93garbage" if sender == "not_a_task" else encode_dispatch(PrefillDispatch(call_id, task()))
            frame = signer.sign(payload)
            sock.send_multipart(frame)
            if sender == "replayed":  # the first copy is taken, its replay is not
                wait_until(lambda: inbox.received == 1)
                asyncio.run(inbox.result(call_id))
                sock.send_multipart(frame)
                wait_until(lambda: inbox.rejected == 1)
                call_id = 6  # (the replay would have been this call's frame)
        with pytest.raises(DispatchError, match="did not reach this worker"):
            asyncio.run(inbox.result(call_id))
        assert inbox.received == (1 if sender == "replayed" else 0)
        assert inbox.rejected + inbox.dropped == 1
    finally:
        sock.close()


def test_a_restarted_worker_gets_a_new_socket_and_the_old_one_nothing_more(pair):
    worker, old, d = pair
    new = DispatchInbox("127.0.0.1", "p0/c", worker.submit, SECRET, "p0.inc-c").start()
    try:
        d.follow({"dispatch": old.endpoint, "incarnation": "inc-a"})
        asyncio.run(old.result(d.send(task("a"))[0]))
        d.follow({"dispatch": new.endpoint, "incarnation": "inc-c"})
        call_id, inc = d.send(task("c"))
        assert inc == "inc-c" and asyncio.run(new.result(call_id)).request_id == "c"
        assert [t.request.request_id for t, _, _ in worker.tasks] == ["a", "c"] and old.received == 1
    finally:
        new.close()


def test_calls_kept_are_bounded_and_unasked_answers_forgotten():
    worker = Worker()
    inbox = DispatchInbox("127.0.0.1", "p0/d", worker.submit, SECRET, "p0.d", arrival_wait_s=0.2, max_calls=2).start()
    d = PrefillDispatcher("p0", SECRET)
    d.follow({"dispatch": inbox.endpoint, "incarnation": "d"})
    try:
        for rid in "abc":  # nobody asks for these answers (their Ray calls lost)
            d.send(task(rid))
        wait_until(lambda: inbox.received + inbox.dropped == 3)
        assert inbox.received == 2 and inbox.dropped == 1  # the third found the ledger full
        time.sleep(0.25)  # the two answers are older than arrival_wait_s now
        call_id, _ = d.send(task("d"))
        assert asyncio.run(inbox.result(call_id)).request_id == "d"  # room again: the old ones forgotten
        assert not inbox._calls
    finally:
        d.close()
        inbox.close()


def test_an_oversized_frame_is_never_held_and_the_socket_serves_on(pair):
    from cluster.wire.socket_bounds import MAX_DISPATCH_FRAME

    worker, inbox, d = pair
    attacker = zmq.Context.instance().socket(zmq.PUSH)
    attacker.setsockopt(zmq.LINGER, 0)
    attacker.connect(inbox.endpoint)
    try:
        attacker.send_multipart([b"t" * 32, b"\0" * (MAX_DISPATCH_FRAME + 1)])  # ZMQ drops the peer at its size
        d.follow({"dispatch": inbox.endpoint, "incarnation": "inc-a"})
        call_id, _ = d.send(task("after"))
        assert asyncio.run(inbox.result(call_id)).request_id == "after"
        assert inbox.rejected == 0  # nothing of the big frame reached the MAC check
    finally:
        attacker.close()


def test_the_actor_runs_a_submit_and_an_attach_or_abort_one_at_a_time():
    """The inbox's thread submits while the actor's loop attaches and aborts: an attach that ran
    between a submit's look at the ledger of calls ahead and its job being queued would be held for a
    prompt already taken (calls_ahead.py), and the prompt would wait for its reservation for ever."""
    from prefill_worker.actor import PrefillWorkerActor

    inside, release, order = threading.Event(), threading.Event(), []

    class SlowWorker:
        def submit(self, t):
            inside.set()
            release.wait(5)
            order.append("submit")
            return Future()

        def attach(self, rid, reservation):
            order.append("attach")

        def abort(self, rid):
            order.append("abort")

    actor = PrefillWorkerActor.__new__(PrefillWorkerActor)  # (its state without a model)
    actor.worker, actor._intake = SlowWorker(), threading.Lock()
    submitter = threading.Thread(target=actor._submit, args=(task(),))
    submitter.start()
    assert inside.wait(5)
    others = [threading.Thread(target=actor.attach, args=("r", None)), threading.Thread(target=actor.abort, args=("r",))]
    for t in others:
        t.start()
    time.sleep(0.1)
    assert order == []  # both wait for the submit
    release.set()
    for t in [submitter, *others]:
        t.join(5)
    assert order[0] == "submit" and sorted(order[1:]) == ["abort", "attach"]
