"""Gateway: what one gateway process's endpoints share, and its lifecycle and drain.

It holds the tokenizer, the channel to the router (router/channel/client.py), the token stream its
requests' text arrives on (router/streams/token_stream.py), the metrics and the requests in flight
(`active`). `start_generation` submits one `GenerateRequest` naming this process's token sink
(`reply_to`) to the router, which admits and places it (a refusal raises its error class here,
before any byte of the response is sent); `end` lets a request go, however it ended, and aborts it
on every worker unless one finished it.

The event loop never runs work whose cost a client chooses beyond the body it parses: prompts, chat
templates, bad words and /tokenize, /detokenize run on the tokenizer threads (`off_loop`; the Rust
tokenizer releases the GIL, a template yields it every switch interval), so one huge request cannot
stop this process's streams or its heartbeats (router/channel/client.py sends those from a thread
besides). Prompts of token ids only are a bounds check no longer than their parse and stay on the
loop (OpenAIServing.needs_tokenizer: the thread hop was ~0.4 ms of a CPU gateway's TTFT).

Structured output: `check_constraint` runs the grammar engine's parse of a request's schema, regex or
grammar (cluster.structured.GrammarCompiler.check: no compile, results cached) on a thread, so a bad
one is a 400 naming its HTTP field before the request is admitted. At most GRAMMAR_CHECKS_MAX checks
run or wait at once (more: 429), and one that takes longer than GRAMMAR_CHECK_TIMEOUT_S is a 400 (its
thread finishes the parse and keeps its slot until then; the spec's size and repetition bounds,
cluster/structured/structured_output.py, keep that to seconds). `start` imports the engine
(xgrammar, seconds) before this process tells the router it is up, so /ready waits for it and the
first structured request does not pay it.

Drain (SIGTERM, or the router says so): new requests get 503 and /ready turns false, the requests in
flight may finish for up to the drain timeout, and whatever still runs then ends with a clear error
event (`end_all`). `stop_requests` does the same at once (a stop).
"""

from __future__ import annotations

import asyncio
import collections
import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

from cluster.errors import InvalidRequestError
from cluster.wire.messages import GenerateRequest
from cluster.sampling.sampling_params import SamplingParams
from cluster.structured import GrammarCompiler, StructuredOutput
from cluster.wire.stream_messages import StreamDelta
from router.channel.client import RouterClient
from router.channel.messages import Drain, PrefillDone, RequestFailed
from router.errors import DrainingError, OverloadedError
from router.stats.metrics import GatewayMetrics
from router.openai.errors import api_error, model_not_found
from router.openai.gateway_config import GatewayConfig
from router.openai.generation import Generation, GenerationLink
from router.streams.token_stream import TokenStreamReceiver

TOKENIZER_THREADS = 2
GRAMMAR_CHECK_THREADS = 2
GRAMMAR_CHECKS_MAX = 8  # running or waiting at once on one gateway process; more is a 429
GRAMMAR_CHECK_TIMEOUT_S = 10.0
T = TypeVar("T")


class Gateway:
    def __init__(self, cfg: GatewayConfig, tokenizer, client: RouterClient, token_stream: TokenStreamReceiver,
                 metrics: GatewayMetrics):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.client = client
        self.token_stream = token_stream
        self.metrics = metrics
        self.active: dict[str, Generation] = {}
        # Requests that finished before their current placement's PrefillDone came: their reply may
        # still wait for it (Generation.settle). Kept until it comes, or UNSETTLED_KEEP_S (a router
        # gone meanwhile never sends it), oldest first in `_unsettled_order`.
        self._unsettled: dict[str, Generation] = {}
        self._unsettled_order: collections.deque[tuple[float, str]] = collections.deque()
        self._link = GenerationLink(metrics, client, token_stream, self.end)
        self._rng = random.Random()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.draining = False  # set by drain(): new requests get 503, /ready is false
        self.on_drained = lambda left: None  # the API-server process stops its HTTP server here
        # Only its admission check runs here (nothing is compiled: the workers compile).
        self.grammars = GrammarCompiler(lambda: tokenizer, cfg.vocab_size or 0, ())
        self._tokenizer_pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenize")
        self._check_pool = ThreadPoolExecutor(GRAMMAR_CHECK_THREADS, thread_name_prefix="grammar-check")
        self._checks = 0  # grammar checks running or waiting (changed on the loop only)
        client.on_failed = self._request_failed
        client.on_prefilled = self._prefilled
        client.on_drain = self._drain_requested
        client.status = lambda: (token_stream.open_streams, len(asyncio.all_tasks()), self.draining)

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        # Before the router counts this process up (/ready): the grammar engine's import and first check.
        await self.loop.run_in_executor(None, self.grammars.check, StructuredOutput.json_schema({"type": "object"}))
        self.token_stream.start()
        await self.client.start()

    async def stop(self) -> None:
        for gen in list(self.active.values()):
            self.end(gen, abort=True)
        await self.client.stop()
        await self.token_stream.stop()
        self.grammars.close()
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        self._check_pool.shutdown(wait=False, cancel_futures=True)

    @property
    def ready(self) -> bool:
        """The router is ready (every worker polled, a decode worker healthy) and every gateway
        process is up, and this one is not draining."""
        st = self.client.state
        return (not self.draining and self.client.connected and st is not None and st.ready
                and st.gateways_up >= st.gateways_expected)

    # -- requests ---------------------------------------------------------------------------------
    def check_accepting(self) -> None:
        if self.draining:
            # Raised as its APIError, answered without counting it in request_rejected (the
            # router's DrainingError, raised through the error handlers, is counted).
            raise api_error(DrainingError())

    def check_model(self, name: str) -> None:
        if name != self.cfg.model_name:
            raise model_not_found(name)

    async def off_loop(self, fn: Callable[..., T], *args) -> T:
        """fn(*args) on a tokenizer thread (tokenization, chat templates: see the module docstring)."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, fn, *args)

    async def check_constraint(self, so: StructuredOutput, param: str) -> None:
        """A 400 naming `param` unless the grammar engine can compile `so` (on a thread: the check
        parses the schema); a 429 while GRAMMAR_CHECKS_MAX checks are in progress, a 400 past
        GRAMMAR_CHECK_TIMEOUT_S."""
        if self._checks >= GRAMMAR_CHECKS_MAX:
            raise OverloadedError(f"{GRAMMAR_CHECKS_MAX} structured-output checks are in progress on this "
                                  "server; retry shortly")
        self._checks += 1
        loop = asyncio.get_running_loop()
        job = self._check_pool.submit(self.grammars.check, so)
        # The slot is held until the thread is done with it (a timed-out parse still runs).
        job.add_done_callback(lambda _: self._release_check(loop))
        try:
            await asyncio.wait_for(asyncio.wrap_future(job), GRAMMAR_CHECK_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise InvalidRequestError(f"{param}: the grammar engine could not parse it within "
                                      f"{GRAMMAR_CHECK_TIMEOUT_S:g}s; simplify it", param) from None
        except InvalidRequestError as e:
            raise InvalidRequestError(str(e), param) from None

    def _release_check(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the check's thread, when it is done (or cancelled before it ran)."""
        try:
            loop.call_soon_threadsafe(self._check_done)
        except RuntimeError:  # the loop is closed: the gateway stopped
            pass

    def _check_done(self) -> None:
        self._checks -= 1

    def kv_capacity_tokens(self) -> int:
        """The largest healthy decode worker's KV cache, in tokens (0 before the router said)."""
        st = self.client.state
        return st.kv_capacity_tokens if st is not None else 0

    async def start_generation(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                               seed: int | None = None, received: float | None = None) -> Generation:
        """`seed`: the sampling seed if not params.seed (choice i of a seeded request: seed + i);
        `received`: when the HTTP app got the request (middleware.ReceivedStamp), else None."""
        if seed is None:
            seed = params.seed if params.seed is not None else self._rng.randrange(2**63)
        req = GenerateRequest(request_id, tuple(prompt_ids), params, seed, time.time(),
                              reply_to=self.token_stream.address, received_time=received)
        mailbox = self.token_stream.register(request_id)  # before the router places it
        gen = Generation(self._link, req, mailbox)
        self.active[request_id] = gen
        try:
            await self.client.submit(req)
            gen.admitted = True
        except BaseException:
            # Refused (nothing to undo), or the client left while it was being placed: the router
            # undoes whatever placement it made.
            self.end(gen, abort=True)
            raise
        return gen

    def end(self, gen: Generation, abort: bool) -> None:
        """The request is over for this gateway (safe to call twice)."""
        if self.active.pop(gen.request_id, None) is None:
            return
        self._keep_for_notice(gen, abort)
        if abort and gen.admitted:
            # Cancelled (the client left, a sibling choice failed, drain) or failed: counted here, once,
            # with the tokens it streamed; a request a worker finished was counted by pieces().
            self.metrics.finished("error" if gen.finish_reason == "error" else "abort", gen.prompt_tokens,
                                  gen.completion_tokens)
            self.metrics.generation_tokens.inc(gen.completion_tokens)
        self.token_stream.unregister(gen.worker_request_id)
        self.client.finish(gen.request_id, abort, gen.first_token_time, gen.completion_tokens, gen.first_written_time)

    UNSETTLED_KEEP_S = 30.0

    def _keep_for_notice(self, gen: Generation, abort: bool) -> None:
        """A request that ended complete but unsettled keeps receiving its PrefillDone (its usage)."""
        now = time.monotonic()
        order = self._unsettled_order
        while order and now - order[0][0] > self.UNSETTLED_KEEP_S:
            self._unsettled.pop(order.popleft()[1], None)
        if not abort and not gen.settled:
            self._unsettled[gen.request_id] = gen
            order.append((now, gen.request_id))

    # -- what the router pushes -------------------------------------------------------------------
    def _request_failed(self, msg: RequestFailed) -> None:
        """A worker of the request died or failed it: drop that placement's late tokens, then let
        the reader see the failure (it asks the router to migrate the request)."""
        self.token_stream.push(StreamDelta(msg.worker_request_id, (), "", "error", msg.error))
        self.token_stream.unregister(msg.worker_request_id)

    def _prefilled(self, msg: PrefillDone) -> None:
        gen = self.active.get(msg.request_id) or self._unsettled.get(msg.request_id)
        if gen is not None:
            gen.prefill_done(msg.worker_request_id, msg.cached_tokens)
            if gen.settled:  # an ended request's entry goes once its own placement's notice came
                self._unsettled.pop(msg.request_id, None)

    def _drain_requested(self, msg: Drain) -> None:
        if not self.draining:
            self.draining = True
            asyncio.get_running_loop().create_task(self._drain_then_notify(msg.timeout_s), name="drain")

    # -- drain and stop ---------------------------------------------------------------------------
    async def _drain_then_notify(self, timeout_s: float) -> None:
        left = await self.drain(timeout_s)
        self.on_drained(left)

    async def drain(self, timeout_s: float) -> int:
        """Stops admission, then waits up to `timeout_s` for the in-flight requests to finish;
        returns how many were still running (each ends with a clear error event)."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.active and loop.time() < deadline:
            await asyncio.sleep(0.05)
        left = len(self.active)
        self.end_all(f"the server shut down (drain timeout {timeout_s:g}s) before the request finished")
        return left

    def end_all(self, error: str) -> None:
        """Ends every request in flight with `error`: an error event and [DONE] on a stream, a 500 on a
        non-streaming request; each is aborted on its workers. New requests get 503 from now on."""
        self.draining = True
        for gen in list(self.active.values()):
            gen.closing = True
            self.token_stream.push(StreamDelta(gen.worker_request_id, (), "", "error", error))

    async def stop_requests(self, error: str, timeout_s: float) -> int:
        """A stop (a second SIGTERM, SIGINT): `end_all`, then waits up to `timeout_s` for the requests
        to hand their last events to their responses; returns how many were ended."""
        n = len(self.active)
        self.end_all(error)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.active and loop.time() < deadline:
            await asyncio.sleep(0.02)
        return n
