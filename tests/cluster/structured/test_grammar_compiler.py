"""GrammarCompiler and RequestGrammar: compiles off the caller's thread, caches by key, replays tokens
accepted while compiling, reports failures; fill_bitmasks equals row-by-row fills."""

import threading
import time

import pytest
import torch

from cluster.errors import CapacityError, InvalidRequestError
from cluster.structured import GrammarCompiler, StructuredOutput, fill_bitmasks
from cluster.structured.grammar import GrammarBackend, GrammarMatcher, bitmask_words
from cluster.structured.registry import register_grammar_backend
from cluster.text.tokenizer import load_tokenizer

VOCAB = 512
EOS = (1, 4)


class _CountingMatcher(GrammarMatcher):
    """Accepts tokens in increasing order only."""

    def __init__(self):
        self.last = -1

    def accept_token(self, token_id):
        if token_id <= self.last:
            return False
        self.last = token_id
        return True

    def fill_bitmask(self, out, row):
        out[row] = -1  # not used by these tests

    def is_terminated(self):
        return self.last == VOCAB - 1


class GatedBackend(GrammarBackend):
    """compile() waits for `gate`; the spec "boom" fails to compile."""

    gate = threading.Event()
    compiled: list = []

    @classmethod
    def check(cls, so):
        if so.spec == "bad":
            raise InvalidRequestError("invalid regex: bad", "structured_output")

    def __init__(self, tokenizer, vocab_size, stop_token_ids):
        self.vocab_size = vocab_size

    def compile(self, so):
        assert self.gate.wait(30)
        GatedBackend.compiled.append((so.key, threading.current_thread().name))
        if so.spec == "boom":
            raise RuntimeError("boom")
        return so.key

    def matcher(self, compiled):
        return _CountingMatcher()

    def nbytes(self, compiled):
        return 100


register_grammar_backend("gated", lambda: GatedBackend)


@pytest.fixture
def gated():
    GatedBackend.gate.clear()
    GatedBackend.compiled = []
    woke = []
    c = GrammarCompiler(lambda: None, VOCAB, EOS, backend="gated", on_ready=lambda: woke.append(1))
    yield c, woke
    GatedBackend.gate.set()
    c.close()


def test_compiles_off_the_callers_thread_and_caches_by_key(gated):
    c, woke = gated
    so = StructuredOutput.regex("a+")
    g1 = c.grammar_for(so, "r1")
    g2 = c.grammar_for(StructuredOutput.regex("a+"), "r2", prior_tokens=(5,))
    assert not g1.ready() and not g2.ready()  # compiling: the caller was not held up
    assert g2.accept(9)  # kept for the replay
    GatedBackend.gate.set()
    assert g1.wait(10) and g2.wait(10)
    assert len(GatedBackend.compiled) == 1 and GatedBackend.compiled[0][1].startswith("grammar-compile")
    assert woke  # the owner's loop was woken
    assert g2.matcher.last == 9 and not g2.accept(7) and g2.error  # replayed 5, 9; then 7 is refused
    assert c.take_failed() == [("r2", g2.error)] and c.take_failed() == []
    assert c.grammar_for(so, "r3").wait(1) and len(GatedBackend.compiled) == 1  # cached


def test_a_replay_the_grammar_refuses_and_a_failed_compile_are_reported(gated):
    c, _ = gated
    GatedBackend.gate.set()
    g = c.grammar_for(StructuredOutput.regex("b"), "r1", prior_tokens=(9, 3))
    assert not g.wait(10) and "generated earlier" in g.error
    boom = c.grammar_for(StructuredOutput.regex("boom"), "r2")
    assert not boom.wait(10) and "failed to compile" in boom.error
    assert {rid for rid, _ in c.take_failed()} == {"r1", "r2"}
    c.grammar_for(StructuredOutput.regex("boom"), "r3").wait(10)  # a failed compile is not cached: tried again
    assert [k for k, _ in GatedBackend.compiled].count(("regex", "boom")) == 2


def test_the_cache_is_bounded_by_bytes_and_a_slow_compile_fails_its_request():
    GatedBackend.gate.set()
    GatedBackend.compiled = []
    c = GrammarCompiler(lambda: None, VOCAB, EOS, backend="gated", cache_bytes=250)
    try:
        for spec in ("a", "b", "c", "a"):  # 100 bytes each: the third pushes "a" out, so it compiles again
            assert c.grammar_for(StructuredOutput.regex(spec), spec).wait(10)
        assert [k[1] for k, _ in GatedBackend.compiled] == ["a", "b", "c", "a"]
        GatedBackend.gate.clear()
        c.compile_timeout_s = 0.2
        slow = c.grammar_for(StructuredOutput.regex("slow"), "slow")
        assert not slow.wait(0.5) and "too long" in slow.error
        assert c.take_failed() == [("slow", slow.error)]
    finally:
        GatedBackend.gate.set()
        c.close()


def test_check_is_a_400_and_cached(gated):
    c, _ = gated
    for _ in range(2):
        with pytest.raises(InvalidRequestError, match="invalid regex"):
            c.check(StructuredOutput.regex("bad"))
    c.check(StructuredOutput.regex("good"))


def test_fill_bitmasks_equals_row_by_row(demo_model_dir):
    c = GrammarCompiler(lambda: load_tokenizer(demo_model_dir), VOCAB, EOS)
    try:
        specs = [StructuredOutput.regex("[a-c]+x"), StructuredOutput.choice(["alpha", "beta"]),
                 StructuredOutput.json_schema({"type": "object", "properties": {"k": {"type": "boolean"}}})]
        gs = [c.grammar_for(so, f"r{i}") for i, so in enumerate(specs)]
        assert all(g.wait(300) for g in gs)  # the first compiles start their compile processes (an import of xgrammar)
        tok = load_tokenizer(demo_model_dir)
        assert all(gs[0].accept(t) for t in tok.encode("ab", add_special_tokens=False))
        w = bitmask_words(VOCAB)
        batch = torch.full((5, w), 7, dtype=torch.int32)
        fill_bitmasks(gs, batch, [4, 0, 2])
        for g, r in zip(gs, [4, 0, 2]):
            one = torch.zeros(1, w, dtype=torch.int32)
            g.matcher.fill_bitmask(one, 0)
            assert torch.equal(batch[r], one[0])
        assert (batch[[1, 3]] == 7).all()  # rows not named are left alone
    finally:
        c.close()


def test_compiles_in_a_child_process_killed_at_the_deadline(demo_model_dir):
    """The xgrammar backend compiles in a child process: the grammar it sends back gives the masks of
    one compiled in-process; a compile past the deadline fails its request and its child is killed
    (not left compiling), and the next compile runs in a new child."""
    import os
    import time

    from cluster.model.config import ModelArchConfig
    from cluster.structured.xgrammar_backend import XGrammarBackend

    tok, arch = load_tokenizer(demo_model_dir), ModelArchConfig.from_dir(demo_model_dir)
    gc = GrammarCompiler(lambda: tok, arch.vocab_size, arch.eos_token_ids, threads=1, compile_timeout_s=1.5)
    try:
        def ready(so, rid):
            g = gc.grammar_for(so, rid)
            deadline = time.monotonic() + 300
            while not g.ready() and g.error is None and time.monotonic() < deadline:
                time.sleep(0.02)
            return g

        so = StructuredOutput.regex("(ab|cd)+e")
        g = ready(so, "r1")
        assert g.matcher is not None, g.error
        local = XGrammarBackend(tok, arch.vocab_size, arch.eos_token_ids)
        mine, theirs = (torch.zeros(1, bitmask_words(arch.vocab_size), dtype=torch.int32) for _ in range(2))
        g.matcher.fill_bitmask(mine, 0)
        local.matcher(local.compile(so)).fill_bitmask(theirs, 0)
        assert torch.equal(mine, theirs) and mine.any()
        proc = gc._processes.queue[0]  # threads=1: the one compile process
        child = proc.pid
        assert child is not None

        # maxLength 1024: hundreds of ms to seconds of xgrammar compile (within the repetition bounds),
        # by the machine's speed; a 50 ms deadline is past on any machine (the deadline is read per compile).
        gc.compile_timeout_s = 0.05
        t0 = time.monotonic()
        slow = ready(StructuredOutput.json_schema({"type": "string", "maxLength": 1024}), "r2")
        assert slow.matcher is None and "compile" in slow.error and time.monotonic() - t0 < 60
        deadline = time.monotonic() + 10
        while proc.pid is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(ProcessLookupError):
            os.kill(child, 0)  # killed and reaped

        assert ready(StructuredOutput.regex("x+"), "r3").matcher is not None
    finally:
        gc.close()


def test_distinct_grammars_past_the_compile_slots_get_a_429_at_once(gated):
    """Issue 37: every compile slot busy with a distinct grammar (here gated: think of each taking the
    whole deadline); the next distinct one is refused with a 429 at once instead of queueing behind
    them; the same grammars, and any once compiled, are still served; after the compiles, room again."""
    c, _ = gated
    busy = [c.grammar_for(StructuredOutput.regex(f"a{{{k}}}"), f"r{k}") for k in range(c.max_compiling)]
    t0 = time.monotonic()
    with pytest.raises(CapacityError) as refused:
        c.grammar_for(StructuredOutput.regex("b+"), "r-new")
    assert time.monotonic() - t0 < 0.5 and "compiling on this worker" in str(refused.value)
    e = refused.value  # what the gateway answers (router/openai/errors.py::api_error reads these)
    assert (e.http_status, e.openai_type, e.openai_code, e.retry_after_s) == (429, "rate_limit_error",
                                                                               "rate_limit_exceeded", 1)
    same = c.grammar_for(StructuredOutput.regex("a{0}"), "r-same")  # compiling already: shares it
    GatedBackend.gate.set()
    assert all(g.wait(10) for g in busy) and same.wait(10)
    deadline = time.monotonic() + 10
    while c._compiling and time.monotonic() < deadline:  # (the done callbacks run on the pool)
        time.sleep(0.01)
    assert c.grammar_for(StructuredOutput.regex("b+"), "r-again").wait(10) and c.refused == 1
