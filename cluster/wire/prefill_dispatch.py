"""PrefillDispatch / PrefillAnswer: a prompt's PrefillTask, router -> prefill worker, and its answer,
prefill worker -> router, each as one signed ZMQ frame.

The router's dispatch was a Ray actor call per prompt (2.2 ms from the router's call to the task on
the prefill worker, on one H200 host: the largest host part of a short prompt's TTFT). The task goes
as a msgpack frame on a PUSH socket to the prefill worker's PULL socket
(prefill_worker/dispatch_inbox.py), with a MAC under the cluster's secret bound to the worker's id and
incarnation (cluster/wire/frame_auth.py).

Its answer comes back the same way, to the router's answer socket that the frame names (`reply_to`,
router/workers/prefill_answers.py), bound to that router (`reply_id`). It was a Ray call per prompt
(`result`) until 2026-12: sent with the frame, it reached the worker while the prompt's pass was
being launched and took the GIL from it (the pass's host time went from 0.9 to 1.6 ms on the H200).
What the Ray call also gave, a failure at once when the actor dies, now comes from one Ray call per
worker incarnation that returns only when the worker shuts down (PrefillWorkerAPI.lifeline): the
router fails every dispatch still unanswered when it ends.

`call_id` joins a dispatch and its answer: one per dispatch of one router to one worker, never reused
(a walk that comes back to a worker dispatches the same request id again).
"""

from __future__ import annotations

import msgspec

from cluster.wire.messages import PrefillResult, PrefillTask


class PrefillDispatch(msgspec.Struct, frozen=True):
    call_id: int
    task: PrefillTask
    reply_to: str = ""  # the router's answer socket (an empty one: nobody waits for the answer)
    reply_id: str = ""  # ... and the receiver its answers' MAC binds (router/workers/prefill_answers.py)


class PrefillAnswer(msgspec.Struct, frozen=True):
    """The answer of dispatch `call_id` of `worker_id` (incarnation `incarnation`): once the prompt's
    KV left (`result`, ok or not), or `error` when the worker could not take the task at all."""

    worker_id: str
    incarnation: str
    call_id: int
    result: PrefillResult | None = None
    error: str | None = None  # "<exception type>: <message>"


encode_dispatch = msgspec.msgpack.Encoder().encode
decode_dispatch = msgspec.msgpack.Decoder(PrefillDispatch).decode
encode_answer = msgspec.msgpack.Encoder().encode
decode_answer = msgspec.msgpack.Decoder(PrefillAnswer).decode
