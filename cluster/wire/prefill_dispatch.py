"""PrefillDispatch: a prompt's PrefillTask, router -> prefill worker, as one signed ZMQ frame.

The router's dispatch was a Ray actor call per prompt (2.2 ms from the router's call to the task on
the prefill worker, on one H200 host: the largest host part of a short prompt's TTFT). The task now
goes as a msgpack frame on a PUSH socket to the prefill worker's PULL socket
(prefill_worker/dispatch_inbox.py), with a MAC under the cluster's secret bound to the worker's id and
incarnation (cluster/wire/frame_auth.py). Its answer still comes back through Ray
(PrefillWorkerAPI.result, which fails at once when the actor dies, as the submit call did): it is
read after the KV left, off the first token's path. `call_id` joins the two: one per dispatch of one
router, never reused (a walk that comes back to a worker dispatches the same request id again).
"""

from __future__ import annotations

import msgspec

from cluster.wire.messages import PrefillTask


class PrefillDispatch(msgspec.Struct, frozen=True):
    call_id: int
    task: PrefillTask


encode_dispatch = msgspec.msgpack.Encoder().encode
decode_dispatch = msgspec.msgpack.Decoder(PrefillDispatch).decode
