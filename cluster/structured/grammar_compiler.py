"""GrammarCompiler: a worker's (or the engine's) grammar service, off its serving loop.

- `check(so)`: before a request is admitted; raises InvalidRequestError (a 400) for a schema, regex
  or grammar the backend cannot compile. Parses only (a millisecond for a 50-field schema), results
  cached by key.
- `grammar_for(so, request_id, prior_tokens)`: a RequestGrammar whose compiled grammar comes from a
  thread pool; compiled grammars are cached by `so.key` (LRU, at most CACHE_ENTRIES of them and
  CACHE_BYTES of their host memory), so a schema every request sends is compiled once per worker and
  later requests are ready at once. A compile longer than COMPILE_TIMEOUT_S fails its request, and
  is stopped: each pool thread compiles in a child process of its own (cluster.structured.
  compile_process), killed at the deadline, so a grammar that would compile for minutes holds a
  thread no longer than that (a backend that cannot export itself compiles on the thread).
- At most `max_compiling` distinct grammars compile or wait for a thread at once (2 per thread): a
  request that needs one more gets CapacityError (a 429, Retry-After 1) at once, instead of waiting
  behind grammars that may each take the whole compile deadline. A grammar already cached, or
  compiling for another request, is never refused.
- The backend itself (its tokenizer tables: a second for a 128k vocabulary, and xgrammar's import)
  is built on the pool by the first request that needs it, never on a caller's thread.
- `on_ready` is called (on a pool thread) when a compile finishes: the decode loop wakes to schedule
  the request. `take_failed()` returns (request id, error) of the requests whose grammar failed
  after admission (compile error, refused replay) for the owner to end with that error.
"""

from __future__ import annotations

import queue
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

from cluster.errors import CapacityError, InvalidRequestError
from cluster.structured.compile_process import START_TIMEOUT_S, CompileProcess
from cluster.structured.grammar import GrammarBackend
from cluster.structured.registry import DEFAULT_BACKEND, get_grammar_backend
from cluster.structured.request_grammar import RequestGrammar
from cluster.structured.structured_output import PARAM, StructuredOutput

COMPILE_THREADS = 2
CACHE_ENTRIES = 256  # compiled grammars kept per worker ...
CACHE_BYTES = 1 << 30  # ... and the host memory they may hold (a schema over a 128k vocabulary: MBs)
COMPILE_TIMEOUT_S = 60.0
COMPILES_PER_THREAD = 2  # distinct grammars compiling or queued per compile thread, then 429
_CHECKED_ENTRIES = 4096


class GrammarCompiler:
    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int, stop_token_ids: Sequence[int],
                 backend: str = DEFAULT_BACKEND, threads: int = COMPILE_THREADS, cache_entries: int = CACHE_ENTRIES,
                 cache_bytes: int = CACHE_BYTES, compile_timeout_s: float = COMPILE_TIMEOUT_S,
                 on_ready: Callable[[], None] | None = None, max_compiling: int | None = None):
        """`load_tokenizer()` returns the HF tokenizer (called once, on the pool). `max_compiling`:
        distinct grammars compiling or queued at once (default COMPILES_PER_THREAD per thread)."""
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self.backend_name = backend
        self.cache_entries, self.cache_bytes = cache_entries, cache_bytes
        self.compile_timeout_s = compile_timeout_s
        self.on_ready = on_ready
        self._threads = threads
        self.max_compiling = max_compiling if max_compiling is not None else COMPILES_PER_THREAD * threads
        self._compiling = 0  # compiles submitted and not done (under the lock)
        self.refused = 0  # requests refused with a 429 because max_compiling were compiling
        self._pool: ThreadPoolExecutor | None = None
        self._backend: Future | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._sizes: dict[tuple[str, str], int] = {}  # bytes of the cached grammars that are compiled
        self._cached_bytes = 0
        self._checked: OrderedDict[tuple[str, str], str | None] = OrderedDict()  # key -> error, None: fine
        self._failed: list[tuple[str, str]] = []
        self._processes: queue.Queue[CompileProcess] | None = None  # idle compile processes (one per thread)
        self.compiles = 0  # grammars compiled (cache misses)

    # -- admission ----------------------------------------------------------------------------------
    def check(self, so: StructuredOutput) -> None:
        with self._lock:
            if so.key in self._checked:
                self._checked.move_to_end(so.key)
                err = self._checked[so.key]
                if err is not None:
                    raise InvalidRequestError(err, PARAM)
                return
        try:
            get_grammar_backend(self.backend_name).check(so)
            err = None
        except InvalidRequestError as e:
            err = str(e)
        with self._lock:
            self._checked[so.key] = err
            while len(self._checked) > _CHECKED_ENTRIES:
                self._checked.popitem(last=False)
        if err is not None:
            raise InvalidRequestError(err, PARAM)

    def grammar_for(self, so: StructuredOutput, request_id: str, prior_tokens: Sequence[int] = ()) -> RequestGrammar:
        """The request's grammar (compiling, or ready if its key is cached); `prior_tokens`: what it
        generated before it came here (replayed into the matcher). Call check(so) first."""
        with self._lock:
            fut = self._cache.get(so.key)
            new = fut is None
            if new:
                if self._compiling >= self.max_compiling:
                    self.refused += 1
                    raise CapacityError(f"{self._compiling} structured-output grammars are compiling on this worker "
                                        "(its limit); retry shortly, or reuse a schema already sent")
                self._compiling += 1
                backend = self._backend_future()
                fut = self._cache[so.key] = self._executor().submit(self._compile, backend, so)
            else:
                self._cache.move_to_end(so.key)
        if new:
            # Outside the lock: a compile already over runs its callback here, and it takes the lock.
            fut.add_done_callback(lambda f, key=so.key: self._compiled(key, f))
        # A compile process enforces compile_timeout_s itself, from when its compile starts; the
        # request's own deadline leaves room for starting that process (seconds: xgrammar's import).
        in_thread = self._processes is None and self._backend is not None and self._backend.done()
        timeout_s = self.compile_timeout_s + (0.0 if in_thread else START_TIMEOUT_S)
        return RequestGrammar(request_id, fut, prior_tokens, self._grammar_failed, timeout_s)

    def take_failed(self) -> list[tuple[str, str]]:
        """(request id, error) of the grammars that failed since the last call (cheap when none did)."""
        if not self._failed:
            return []
        with self._lock:
            out, self._failed = self._failed, []
        return out

    def prepare(self) -> Future:
        """Starts building the backend now (e.g. during a worker's warm-up); returns its future."""
        with self._lock:
            return self._backend_future()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        while self._processes is not None and not self._processes.empty():
            self._processes.get_nowait().close()  # one still compiling exits when its pipe closes

    # -- the pool -----------------------------------------------------------------------------------
    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="grammar-compile")
        return self._pool

    def _backend_future(self) -> Future:
        # NOTE: submitted before any compile task, so a compile waiting on it never starves the pool.
        if self._backend is None:
            self._backend = self._executor().submit(self._make_backend)
        return self._backend

    def _make_backend(self) -> GrammarBackend:
        backend = get_grammar_backend(self.backend_name)(self._load_tokenizer(), self.vocab_size, self.stop_token_ids)
        export = backend.export()
        if export is not None:
            procs: queue.Queue[CompileProcess] = queue.Queue()
            for _ in range(self._threads):
                procs.put(CompileProcess(self.backend_name, self.vocab_size, export))
            self._processes = procs
        return backend

    def _compile(self, backend_future: Future, so: StructuredOutput):
        backend = backend_future.result()
        if self._processes is None:
            compiled = backend.compile(so)
        else:
            proc = self._processes.get()  # never waits: one per pool thread
            try:
                compiled = backend.deserialize(proc.compile(so.kind, so.spec, self.compile_timeout_s))
            finally:
                self._processes.put(proc)
        with self._lock:
            self.compiles += 1
        return backend, compiled

    def _compiled(self, key, fut: Future) -> None:
        with self._lock:
            self._compiling -= 1  # (also for a compile cancelled by close())
            if self._cache.get(key) is fut:
                if fut.exception() is not None:
                    del self._cache[key]  # not cached: a later request tries again
                else:
                    backend, compiled = fut.result()
                    self._sizes[key] = backend.nbytes(compiled)
                    self._cached_bytes += self._sizes[key]
            self._evict()
        if self.on_ready is not None:
            self.on_ready()

    def _evict(self) -> None:
        """Under the lock: drops the least recently used grammars past the cache's bounds (requests
        holding one keep it; the next request for that key compiles it again)."""
        while self._cache and (len(self._cache) > self.cache_entries or self._cached_bytes > self.cache_bytes):
            key, _ = self._cache.popitem(last=False)
            self._cached_bytes -= self._sizes.pop(key, 0)

    def _grammar_failed(self, g: RequestGrammar) -> None:
        with self._lock:
            self._failed.append((g.request_id, g.error))
        if self.on_ready is not None:
            self.on_ready()
