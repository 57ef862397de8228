"""DispatchInbox (the prefill worker's end) with PrefillDispatcher and PrefillAnswers (the router's): a
task sent as a signed frame reaches the worker's submit on the inbox's thread and its answer comes
back as a frame; frames not for their receiver (no secret, another incarnation or router, garbage,
replays, too many) are dropped and counted; a worker's lifeline ending fails what waits for it."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future

import pytest
import zmq

from cluster.sampling.sampling_params import SamplingParams
from cluster.wire.frame_auth import PREFILL_ANSWER, PREFILL_DISPATCH, FrameSigner
from cluster.wire.messages import GenerateRequest, PrefillResult, PrefillTask
from cluster.wire.prefill_dispatch import PrefillAnswer, PrefillDispatch, encode_answer, encode_dispatch
from cluster.wire.socket_bounds import MAX_DISPATCH_FRAME
from prefill_worker.dispatch_inbox import DispatchInbox
from router.workers.prefill_answers import PrefillAnswers
from router.workers.prefill_dispatcher import PrefillCallFailed, PrefillDispatcher

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


class Lifeline:
    """The worker's PrefillWorkerAPI.lifeline as the router calls it: pending until the test ends it."""

    def __init__(self):
        self.calls: list[str] = []
        self.end: asyncio.Future | None = None

    async def __call__(self, incarnation: str) -> str:
        self.calls.append(incarnation)
        self.end = asyncio.get_running_loop().create_future()
        return await self.end


class ActorDied(Exception):
    """Stands for Ray's RayActorError."""


def pusher(endpoint: str) -> zmq.Socket:
    """A raw PUSH socket to `endpoint`: frames as anyone on the cluster's network can send them."""
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def inbox_for(worker: Worker, incarnation: str = "inc-a", **kw) -> DispatchInbox:
    return DispatchInbox("127.0.0.1", "p0", incarnation, worker.submit, SECRET, **kw).start()


def run(main, *inboxes: DispatchInbox, follow: bool = True):
    """Runs the test's coroutine with a router side (answers, dispatcher, lifeline), which follows the
    first inbox's worker first if `follow`; closes the router side and the inboxes after."""
    async def wrapped():
        answers = PrefillAnswers("127.0.0.1", SECRET)
        life = Lifeline()
        d = PrefillDispatcher("p0", answers, life, is_death=lambda e: isinstance(e, ActorDied))
        try:
            if follow and inboxes:
                d.follow({"dispatch": inboxes[0].endpoint, "incarnation": inboxes[0].incarnation})
            return await main(answers, d, life)
        finally:
            answers.close()
    try:
        return asyncio.run(wrapped())
    finally:
        for inbox in inboxes:
            inbox.close()


async def until(cond, timeout: float = 5.0) -> None:
    """Until cond(), yielding to the loop at least once (the tasks the step before made have started)."""
    deadline = time.monotonic() + timeout
    await asyncio.sleep(0)
    while not cond():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.005)


async def a_dispatch_waiting(d: PrefillDispatcher, life: Lifeline, worker: Worker) -> asyncio.Future:
    """Sends task "a"; returns its answer's future once the worker holds it and the lifeline is pending."""
    _, answer = d.send(task("a"))
    await until(lambda: worker.tasks and life.end is not None)
    return answer


def test_no_endpoint_no_frame_then_the_task_reaches_submit_on_the_inbox_thread_and_the_answer_comes_back():
    worker = Worker()
    inbox = inbox_for(worker)

    async def main(answers, d, life):
        assert d.send(task()) is None  # no stats yet: the caller dispatches through Ray
        d.follow({"incarnation": "inc-a"})  # a worker without a dispatch socket: still none
        assert d.send(task()) is None
        d.follow({"dispatch": inbox.endpoint, "incarnation": "inc-a"})
        call_id, answer = d.send(task("r1"))
        result = await asyncio.wait_for(answer, 5)
        assert result.request_id == "r1" and result.first_token == 7
        assert life.calls == ["inc-a"]  # one lifeline for the incarnation followed
        d.follow({"dispatch": inbox.endpoint, "incarnation": "inc-a"})  # the next stats: nothing new
        assert life.calls == ["inc-a"] and answers.taken == 1
        return call_id

    assert run(main, inbox, follow=False) == 1
    (t, thread, _), = worker.tasks
    assert t == task("r1") and thread.startswith("dispatch-")  # not the actor's loop, not Ray's
    assert inbox.received == 1 and inbox.answered == 1 and inbox.rejected == 0


@pytest.mark.parametrize("how", ["submit_raises", "prompt_fails"])
def test_a_failed_prompt_reaches_its_dispatcher_as_an_error(how):
    worker = Worker(resolve_at_once=False)
    if how == "submit_raises":
        worker.error = RuntimeError("no room")
    inbox = inbox_for(worker)

    async def main(answers, d, life):
        _, answer = d.send(task())
        if how == "prompt_fails":
            await until(lambda: worker.tasks)
            worker.tasks[0][2].set_exception(RuntimeError("no room"))
        with pytest.raises(PrefillCallFailed, match="RuntimeError: no room"):
            await asyncio.wait_for(answer, 5)

    run(main, inbox)


def test_the_answer_waits_for_the_prompt_and_each_answer_finds_its_own_dispatch():
    worker = Worker(resolve_at_once=False)
    inbox = inbox_for(worker)

    async def main(answers, d, life):
        (_, a), (_, b) = d.send(task("a")), d.send(task("b"))
        await until(lambda: len(worker.tasks) == 2)
        await asyncio.sleep(0.05)
        assert not a.done() and not b.done()  # no answer before the prompt's end
        worker.tasks[1][2].set_result(PrefillResult("b", 2, 0.0, 0.0, 0.0, 0))  # the second ends first
        assert (await asyncio.wait_for(b, 5)).first_token == 2 and not a.done()
        worker.tasks[0][2].set_result(PrefillResult("a", 1, 0.0, 0.0, 0.0, 0))
        assert (await asyncio.wait_for(a, 5)).first_token == 1

    run(main, inbox)


def test_a_worker_that_dies_fails_what_waits_for_it_and_takes_no_frame_until_it_answers_again():
    worker = Worker(resolve_at_once=False)
    inbox = inbox_for(worker)

    async def main(answers, d, life):
        answer = await a_dispatch_waiting(d, life, worker)
        died = ActorDied("the actor died")
        life.end.set_exception(died)  # what Ray's lifeline call raises when the actor dies
        with pytest.raises(ActorDied) as got:
            await asyncio.wait_for(answer, 5)
        assert got.value is died  # the dead actor's own error: the router's health marks it dead at once
        assert d.send(task("b")) is None  # through Ray (which fails at once, or reaches a restarted one)
        d.follow({"dispatch": inbox.endpoint, "incarnation": "inc-a"})  # it answered stats again
        await until(lambda: life.calls == ["inc-a", "inc-a"])
        _, again = d.send(task("c"))
        await until(lambda: len(worker.tasks) == 2)
        worker.tasks[1][2].set_result(PrefillResult("c", 4, 0.0, 0.0, 0.0, 0))
        assert (await asyncio.wait_for(again, 5)).request_id == "c"
        worker.tasks[0][2].set_result(PrefillResult("a", 1, 0.0, 0.0, 0.0, 0))  # a's late answer: nobody waits
        await until(lambda: answers.dropped == 1)

    run(main, inbox)


def test_a_lifeline_call_that_fails_without_a_death_fails_nothing():
    """Only a dead actor's error (or the worker's own end) fails what waits: any other failure of the
    lifeline call leaves the answers to come, and the next stats answer re-arms it."""
    worker = Worker(resolve_at_once=False)
    inbox = inbox_for(worker)

    async def main(answers, d, life):
        answer = await a_dispatch_waiting(d, life, worker)
        assert len(inbox._routers) == 1  # the answer's socket, connected while the prompt runs
        life.end.set_exception(RuntimeError("the call failed"))
        await until(lambda: d.send(task("x")) is None)  # through Ray until re-armed
        worker.tasks[0][2].set_result(PrefillResult("a", 1, 0.0, 0.0, 0.0, 0))
        assert (await asyncio.wait_for(answer, 5)).request_id == "a"
        d.follow({"dispatch": inbox.endpoint, "incarnation": "inc-a"})
        await until(lambda: life.calls == ["inc-a", "inc-a"])
        assert d.send(task("b")) is not None

    run(main, inbox)


def test_a_worker_registered_again_closes_its_old_dispatcher_and_call_ids_never_repeat():
    worker = Worker(resolve_at_once=False)
    inbox = inbox_for(worker)

    async def main(answers, d, life):
        first, waiting = d.send(task("a"))
        await until(lambda: worker.tasks)
        again = PrefillDispatcher("p0", answers, Lifeline(), is_death=lambda e: isinstance(e, ActorDied))
        with pytest.raises(PrefillCallFailed):
            await asyncio.wait_for(waiting, 5)  # the old one is closed: nothing waits on it forever
        again.follow({"dispatch": inbox.endpoint, "incarnation": "inc-a"})
        second, answer = again.send(task("b"))
        assert second != first
        await until(lambda: len(worker.tasks) == 2)
        worker.tasks[0][2].set_result(PrefillResult("a", 1, 0.0, 0.0, 0.0, 0))  # the old call's answer
        await until(lambda: answers.dropped == 1)  # matches no call of the new dispatcher
        assert not answer.done()
        worker.tasks[1][2].set_result(PrefillResult("b", 2, 0.0, 0.0, 0.0, 0))
        assert (await asyncio.wait_for(answer, 5)).request_id == "b"

    run(main, inbox)


def test_a_worker_that_shuts_down_fails_what_waits_with_why():
    worker = Worker(resolve_at_once=False)
    inbox = inbox_for(worker)

    async def main(answers, d, life):
        _, answer = d.send(task())
        await until(lambda: life.end is not None)
        life.end.set_result("shut down")
        with pytest.raises(PrefillCallFailed, match="prefill worker p0 shut down"):
            await asyncio.wait_for(answer, 5)

    run(main, inbox)


def test_a_restarted_worker_gets_a_new_socket_and_the_old_ones_dispatches_fail():
    worker = Worker(resolve_at_once=False)
    old, new = inbox_for(worker), inbox_for(worker, "inc-c")

    async def main(answers, d, life):
        d.follow({"dispatch": old.endpoint, "incarnation": "inc-a"})
        _, waiting = d.send(task("a"))
        await until(lambda: worker.tasks and life.calls == ["inc-a"])  # its lifeline pending
        d.follow({"dispatch": new.endpoint, "incarnation": "inc-c"})
        with pytest.raises(PrefillCallFailed, match="restarted"):
            await asyncio.wait_for(waiting, 5)
        _, answer = d.send(task("c"))
        await until(lambda: len(worker.tasks) == 2)
        worker.tasks[1][2].set_result(PrefillResult("c", 4, 0.0, 0.0, 0.0, 0))
        assert (await asyncio.wait_for(answer, 5)).request_id == "c"
        worker.tasks[0][2].set_result(PrefillResult("a", 1, 0.0, 0.0, 0.0, 0))  # the old incarnation's answer
        await until(lambda: answers.dropped == 1)
        assert life.calls == ["inc-a", "inc-c"]

    run(main, old, new, follow=False)
    assert old.received == 1 and new.received == 1


@pytest.mark.parametrize("sender", ["another_incarnation", "no_secret", "replayed", "not_a_task"])
def test_frames_not_for_this_worker_are_dropped_and_counted(sender):
    worker = Worker()
    inbox = inbox_for(worker)

    async def main(answers, d, life):
        sock = pusher(inbox.endpoint)
        try:
            if sender == "another_incarnation":  # what a router still connected to the last one sends
                d.follow({"dispatch": inbox.endpoint, "incarnation": "inc-old"})
                _, answer = d.send(task())
                await until(lambda: inbox.rejected == 1)
                await asyncio.sleep(0.05)
                assert not answer.done()  # (its lifeline ends it: that incarnation is gone)
            else:
                key = b"x" * 32 if sender == "no_secret" else SECRET
                signer = FrameSigner(key, PREFILL_DISPATCH, b"p0.inc-a")
                payload = (b"\x93garbage" if sender == "not_a_task"
                           else encode_dispatch(PrefillDispatch(5, task(), answers.endpoint, answers.reply_id)))
                frame = signer.sign(payload)
                sock.send_multipart(frame)
                if sender == "replayed":  # the first copy is taken, its replay is not
                    await until(lambda: inbox.answered == 1)
                    sock.send_multipart(frame)
                await until(lambda: inbox.rejected + inbox.dropped == 1)
        finally:
            sock.close()

    run(main, inbox, follow=False)
    assert inbox.received == (1 if sender == "replayed" else 0) == len(worker.tasks)
    assert inbox.rejected + inbox.dropped == 1


def test_unanswered_dispatches_are_bounded_and_one_past_it_is_answered_at_once():
    worker = Worker(resolve_at_once=False)
    inbox = inbox_for(worker, max_calls=2)

    async def main(answers, d, life):
        sent = [d.send(task(rid))[1] for rid in "abc"]
        with pytest.raises(PrefillCallFailed, match="DispatchFull"):
            await asyncio.wait_for(sent[2], 5)
        assert inbox.received == 2 and inbox.dropped == 1 and not sent[0].done()
        worker.tasks[0][2].set_result(PrefillResult("a", 1, 0.0, 0.0, 0.0, 0))
        await asyncio.wait_for(sent[0], 5)
        _, d4 = d.send(task("d"))  # room again: one was answered
        await until(lambda: len(worker.tasks) == 3)
        for _, _, f in worker.tasks[1:]:
            f.set_result(PrefillResult("x", 1, 0.0, 0.0, 0.0, 0))
        await asyncio.wait_for(asyncio.gather(sent[1], d4), 5)

    run(main, inbox)


def test_an_oversized_frame_is_never_held_and_the_socket_serves_on():
    worker = Worker()
    inbox = inbox_for(worker)
    attacker = pusher(inbox.endpoint)

    async def main(answers, d, life):
        attacker.send_multipart([b"t" * 32, b"\0" * (MAX_DISPATCH_FRAME + 1)])  # ZMQ drops the peer at its size
        d.follow({"dispatch": inbox.endpoint, "incarnation": "inc-a"})
        _, answer = d.send(task("after"))
        assert (await asyncio.wait_for(answer, 5)).request_id == "after"

    try:
        run(main, inbox, follow=False)
        assert inbox.rejected == 0  # nothing of the big frame reached the MAC check
    finally:
        attacker.close()


def test_an_answer_that_cannot_be_sent_is_counted_and_the_inbox_serves_on():
    worker = Worker()
    inbox = inbox_for(worker)
    sock = pusher(inbox.endpoint)
    try:
        signer = FrameSigner(SECRET, PREFILL_DISPATCH, b"p0.inc-a")
        sock.send_multipart(signer.sign(encode_dispatch(PrefillDispatch(1, task("x"), "nowhere", "r"))))
        sock.send_multipart(signer.sign(encode_dispatch(PrefillDispatch(2, task("y")))))  # nobody waits
        deadline = time.monotonic() + 5
        while inbox.received < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert inbox.received == 2 and inbox.answers_lost == 1 and inbox.answered == 0
    finally:
        sock.close()
        inbox.close()


@pytest.mark.parametrize("forger", ["no_secret", "for_another_router", "replayed"])
def test_answers_not_for_this_router_are_dropped_and_counted(forger):
    worker = Worker(resolve_at_once=False)
    inbox = inbox_for(worker)
    rejected = []

    async def main(_, d, life):
        answers = d._answers
        answers._on_rejected = lambda: rejected.append(1)
        d.follow({"dispatch": inbox.endpoint, "incarnation": "inc-a"})
        call_id, answer = d.send(task("a"))
        await until(lambda: worker.tasks)
        key = b"x" * 32 if forger == "no_secret" else SECRET
        receiver = b"router-other" if forger == "for_another_router" else answers.reply_id.encode()
        forged = FrameSigner(key, PREFILL_ANSWER, receiver).sign(encode_answer(PrefillAnswer(
            "p0", "inc-a", call_id, PrefillResult("a", 666, 0.0, 0.0, 0.0, 0))))
        sock = pusher(answers.endpoint)
        try:
            if forger == "replayed":  # a genuine answer's frame, sent a second time
                worker.tasks[0][2].set_result(PrefillResult("a", 1, 0.0, 0.0, 0.0, 0))
                assert (await asyncio.wait_for(answer, 5)).first_token == 1
                genuine = FrameSigner(SECRET, PREFILL_ANSWER, answers.reply_id.encode())
                frame = genuine.sign(encode_answer(PrefillAnswer("p0", "inc-a", 2, PrefillResult("b", 2, 0, 0, 0, 0))))
                call_id, answer = d.send(task("b"))
                sock.send_multipart(frame)
                assert (await asyncio.wait_for(answer, 5)).first_token == 2
                call_id, answer = d.send(task("c"))  # (what waits now)
                sock.send_multipart(frame)
            else:
                sock.send_multipart(forged)
            await until(lambda: rejected)
            await asyncio.sleep(0.05)
            assert not answer.done()
        finally:
            sock.close()

    run(main, inbox, follow=False)
    assert len(rejected) == 1


def test_the_actors_lifeline_ends_at_shutdown_and_refuses_another_incarnation():
    from prefill_worker.actor import PrefillWorkerActor

    class Stopped:
        transport = None

        def shutdown(self):
            pass

    actor = PrefillWorkerActor.__new__(PrefillWorkerActor)  # (its state without a model)
    actor.worker, actor.incarnation, actor.dispatch, actor._lifeline = Stopped(), "inc-a", None, None
    actor.worker.worker_id = "p0"

    async def main():
        with pytest.raises(RuntimeError, match="restarted"):
            await actor.lifeline("inc-old")
        first, second = (asyncio.ensure_future(actor.lifeline("inc-a")) for _ in range(2))
        await asyncio.sleep(0.05)
        first.cancel()  # one router gone: the other's wait goes on
        await asyncio.sleep(0.05)
        assert not second.done()
        await asyncio.to_thread(actor.shutdown)  # (from another thread: Ray may run it anywhere)
        return await asyncio.wait_for(second, 5)

    assert asyncio.run(main()) == "shut down"


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
