"""The API-server processes: K gateways serving one port (the pattern of vLLM's `--api-server-count`).

The launcher binds the listening socket once (a port in use is a one-line error there, and port 0 is
resolved before any child starts) and hands that same socket to K processes that run
`python -m deploy.api_server`, forked from the launcher's process template (cluster/process/: what
they import, PRELOAD, is imported once there); the kernel gives each new connection to one of them, and a
connection stays with its process for its whole life, so a request's tokens only ever go to the
process holding it (its token sink is the request's `reply_to`). Each process runs uvicorn on uvloop
with the httptools parser and the FastAPI app of router/openai/, with its own token sink and its
own channel to the one router (router/channel/client.py). Its settings come on stdin as JSON, so the
API key and the cluster's secret (its token sink's MAC key, cluster/wire/frame_auth.py) never show in `ps`.

A child drains on SIGTERM or when the router says so (the launcher got SIGTERM), exits at once on
SIGINT, and stops by itself if the launcher goes away (its parent, the template, exits with the
launcher: its parent pid changes).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import threading
import time

import msgspec
import uvicorn

from cluster.errors import PdserveError
from cluster.process.process_template import PIPE, ProcessTemplate
from cluster.process.template_child import TemplateChild
from cluster.sampling.generation_defaults import SamplingDefaults
from cluster.model.config import ModelArchConfig
from cluster.text.tokenizer import load_tokenizer
from cluster.worker.startup_heap import freeze_startup_heap
from deploy.bounded_http import BoundedHttpToolsProtocol
from router.channel.client import RouterClient
from router.channel.messages import Drain
from router.stats.metrics import GatewayMetrics
from router.openai.gateway import Gateway
from router.openai.gateway_config import GatewayConfig
from router.openai.routes import build_app
from router.streams.token_stream import TokenStreamReceiver

log = logging.getLogger("pdserve.api_server")

# What an API server imports before it serves (~2.5 s of CPU: torch, through transformers and xgrammar):
# its processes are forked from a template that imported them (APIServerPool). Not prometheus_client:
# it reads PROMETHEUS_MULTIPROC_DIR, each process's own, at import. transformers.core_model_loading is
# what the tokenizer's AutoConfig lookup imports (torch.distributed.tensor: ~0.8 s).
PRELOAD = ("torch", "transformers", "transformers.models.auto.tokenization_auto",
           "transformers.models.auto.configuration_auto", "transformers.core_model_loading", "xgrammar",
           "fastapi", "uvicorn", "uvloop", "httptools", "zmq", "msgspec", "pydantic")

# Connections and requests one API-server process holds at once (uvicorn answers 503 past it): far
# above what its loop streams well (~10k events/s), far below what exhausts its file descriptors.
LIMIT_CONCURRENCY = 4096


class APIServerSpec(msgspec.Struct, frozen=True):
    """What one API-server process needs (sent on its stdin)."""

    index: int
    router_address: str
    model_dir: str
    served_model_name: str
    max_model_len: int
    api_key: str | None
    max_body_bytes: int
    token_timeout_s: float
    drain_timeout_s: float
    sink_host: str  # interface its token sink binds (the decode workers connect to it)
    listen_fd: int
    parent_pid: int
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    log_level: str = "WARNING"
    cluster_secret: bytes = b""  # its token sink takes frames under this MAC key only (cluster/wire/frame_auth.py)
    chat_template: str | None = None  # --chat-template's text (None: the tokenizer's own)
    sampling_defaults: dict = {}  # cluster.sampling.generation_defaults.SamplingDefaults' fields that are set
    dtype: str = ""  # what the workers serve with (deploy.preflight.ServedModel.precision): /v1/models says it
    quantization: str = ""
    kv_cache_dtype: str = ""

    def __repr__(self) -> str:
        # The API key and the cluster's secret never show in a log line or a traceback.
        shown = ", ".join(f"{f}={getattr(self, f)!r}" for f in self.__struct_fields__
                          if f not in ("api_key", "cluster_secret"))
        return f"APIServerSpec({shown}, api_key=<hidden>, cluster_secret=<hidden>)"

    __str__ = __repr__

    @property
    def gateway_id(self) -> str:
        return f"api-{self.index}"


def default_api_servers(cpus: int | None = None) -> int:
    """A quarter of the cores, 1 to 4: one API-server process saturates about one core at its limit
    (~10k+ streamed events/s), and the rest of the machine runs the decode and prefill workers' host
    threads, the router and, in a load test, the clients. Four carry the token rate of one H200."""
    if cpus is None:
        cpus = os.cpu_count() or 1
    return min(4, max(1, cpus // 4))


class APIServerPool:
    """Starts, watches and stops the K API-server processes of one launcher. They are forked from
    `template` (cluster/process/process_template.py: torch, transformers, xgrammar, FastAPI and
    uvicorn imported once), on a thread of their own: `start()` returns at once, while the template
    may still be importing, so the workers' model loads start at the same time."""

    def __init__(self, count: int, listen_sock: socket.socket, spec: dict, metrics_dir: str,
                 template: ProcessTemplate):
        self.count = count
        self.listen_sock = listen_sock
        self.spec = spec
        self.metrics_dir = metrics_dir
        self.template = template
        self.procs: list[TemplateChild] = []
        self.start_error: str | None = None
        self._starter: threading.Thread | None = None

    def start(self) -> None:
        fd = self.listen_sock.fileno()
        env = {"PROMETHEUS_MULTIPROC_DIR": self.metrics_dir, "PYTHONUNBUFFERED": "1"}

        def start_all() -> None:
            try:
                for i in range(self.count):
                    # parent_pid: the template's, whose child it is; it ends when the launcher does.
                    spec = APIServerSpec(index=i, listen_fd=fd, parent_pid=self.template.pid, **self.spec)
                    proc = self.template.spawn("deploy.api_server", stdin=PIPE, pass_fds=(fd,), env=env)
                    proc.stdin.write(msgspec.json.encode(spec))
                    proc.stdin.close()
                    self.procs.append(proc)
            except (OSError, RuntimeError) as e:
                self.start_error = f"cannot start the API servers: {e}"
                log.error("%s", self.start_error)

        self._starter = threading.Thread(target=start_all, name="api-server-start", daemon=True)
        self._starter.start()

    def _started(self, timeout_s: float | None = None) -> bool:
        if self._starter is not None:
            self._starter.join(timeout_s)
            return not self._starter.is_alive()
        return True

    def exited(self) -> list[tuple[int, int]]:
        """(index, exit code) of the processes that have ended; (count, 1) for one that could not start."""
        if not self._started(0):
            return []
        dead = [(i, p.returncode) for i, p in enumerate(self.procs) if p.poll() is not None]
        return dead + [(len(self.procs), 1)] if self.start_error else dead

    def alive(self) -> int:
        return sum(p.poll() is None for p in self.procs)

    def wait(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        return not self.alive()

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGINT (stop now), then SIGKILL what is left."""
        self._started()  # (a start in progress finishes first: none is left behind)
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        if not self.wait(timeout_s):
            for p in self.procs:
                if p.poll() is None:
                    p.kill()
            self.wait(5.0)


# -- the child process ------------------------------------------------------------------------------
def _watch_parent(parent_pid: int, server) -> None:
    """The launcher is gone (killed): nothing routes this process's requests any more."""
    while not server.should_exit:
        if os.getppid() != parent_pid:
            log.error("the launcher (pid %d) went away; stopping", parent_pid)
            server.should_exit = True
            return
        time.sleep(0.5)


def serve(spec: APIServerSpec) -> None:
    tokens = TokenStreamReceiver(spec.sink_host, token_timeout_s=spec.token_timeout_s, secret=spec.cluster_secret)
    client = RouterClient(spec.router_address, spec.gateway_id, tokens.address)
    metrics = GatewayMetrics(spec.served_model_name)
    tokens.on_rejected = lambda: metrics.frame_rejected("token_stream")
    gw = Gateway(GatewayConfig(model_name=spec.served_model_name, max_model_len=spec.max_model_len,
                               api_key=spec.api_key, max_body_bytes=spec.max_body_bytes,
                               token_timeout_s=spec.token_timeout_s,
                               vocab_size=ModelArchConfig.from_dir(spec.model_dir).vocab_size,
                               tool_call_parser=spec.tool_call_parser,
                               enable_auto_tool_choice=spec.enable_auto_tool_choice,
                               sampling_defaults=SamplingDefaults(**spec.sampling_defaults),
                               dtype=spec.dtype or None, quantization=spec.quantization or None,
                               kv_cache_dtype=spec.kv_cache_dtype or None),
                 load_tokenizer(spec.model_dir, spec.chat_template), client, tokens, metrics)

    class DrainingServer(uvicorn.Server):
        """uvicorn, except that SIGTERM drains this process's requests before it stops, and a stop
        (SIGINT, or SIGTERM during a drain) first ends every request with an error event and [DONE]
        (a stream is never cut mid-body); a third signal stops at once."""

        stopping = False

        def handle_exit(self, sig, frame):
            loop = gw.loop
            if loop is None or self.should_exit:
                return super().handle_exit(sig, frame)
            if sig == signal.SIGTERM and not gw.draining:
                loop.call_soon_threadsafe(gw.client.on_drain, Drain(spec.drain_timeout_s))
                return
            if not self.stopping:
                self.stopping = True
                loop.call_soon_threadsafe(lambda: loop.create_task(self.end_then_exit(), name="stop"))
                return
            super().handle_exit(sig, frame)

        async def end_then_exit(self):
            n = await gw.stop_requests("the server is shutting down; the request did not finish", 3.0)
            if n:
                log.warning("%s: stopping, %d requests ended with an error event", spec.gateway_id, n)
            await asyncio.sleep(0.1)  # their last events leave before the connections close
            self.should_exit = True

    # Connections past LIMIT_CONCURRENCY get 503; an idle keep-alive connection closes after 5 s; a
    # request's head is bounded in size and time (deploy/bounded_http.py).
    config = uvicorn.Config(build_app(gw), loop="uvloop", http=BoundedHttpToolsProtocol, lifespan="on",
                            log_level="warning", access_log=False, timeout_graceful_shutdown=5,
                            limit_concurrency=LIMIT_CONCURRENCY, timeout_keep_alive=5)
    server = DrainingServer(config)

    def drained(left: int) -> None:
        if left:
            log.warning("%s: drain timeout, %d requests ended with an error event", spec.gateway_id, left)
        # Give the last error events a moment to leave before the connections close.
        asyncio.get_running_loop().call_later(0.2, setattr, server, "should_exit", True)
    gw.on_drained = drained
    threading.Thread(target=_watch_parent, args=(spec.parent_pid, server), daemon=True).start()
    sock = socket.socket(fileno=spec.listen_fd)
    heap = freeze_startup_heap()  # built: nothing of the above is collected again (cluster/worker/startup_heap.py)
    log.info("%s: startup heap frozen: %s", spec.gateway_id, heap)
    server.run(sockets=[sock])


def main() -> int:
    spec = msgspec.json.decode(sys.stdin.buffer.read(), type=APIServerSpec)
    logging.basicConfig(level=spec.log_level, format=f"%(asctime)s %(levelname)s api-{spec.index} %(name)s: %(message)s")
    try:
        serve(spec)
    except PdserveError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # SIGINT: uvicorn stopped, then re-raised it
        pass
    return 0


if __name__ == "__main__":
    code = main()
    # Served and closed: the interpreter's teardown (torch's and the tokenizer's thread pools) would
    # take seconds more, which the launcher's stop would wait for.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
