"""PrefillWorker with structured output over the in-process transport: a bad schema fails the request
at submit; a prompt whose grammar is still compiling waits while the prompts behind it go ahead; its
first token is the engine's (sampled under the grammar's mask)."""

import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "cluster" / "transport"))
import harness  # noqa: E402

from cluster.engine.engine import LLMEngine  # noqa: E402
from cluster.wire.messages import GenerateRequest  # noqa: E402
from cluster.sampling.sampling_params import SamplingParams  # noqa: E402
from cluster.structured import GrammarCompiler, StructuredOutput  # noqa: E402
from cluster.structured.registry import register_grammar_backend  # noqa: E402
from cluster.text.tokenizer import load_tokenizer  # noqa: E402
from cluster.transport.factory import TransportSpec, create_transport  # noqa: E402
from cluster.worker.worker_config import WorkerConfig  # noqa: E402
from prefill_worker.prefill_worker import PrefillWorker  # noqa: E402


@pytest.fixture
def setup(demo_model_dir, request):
    spec = TransportSpec("local", namespace=request.node.name, heartbeat_s=0.05)
    dec = harness.DecodeSide("d0", demo_model_dir, spec)
    w = PrefillWorker("p0", WorkerConfig(model_dir=str(demo_model_dir), num_blocks=64, max_prefill_tokens=64))
    w.set_transport(create_transport(spec, w.kv_cache, "p0", "prefill"), send_timeout_s=5.0)
    yield dec, w
    w.shutdown()
    w.transport.close()
    dec.transport.close()


def req(rid, prompt, params):
    return GenerateRequest(rid, tuple(prompt), params, 0, 0.0)


def test_a_bad_schema_fails_at_submit(setup):
    dec, w = setup
    sp = SamplingParams(max_tokens=4, structured=StructuredOutput("json", '{"type": "object", "required": 3}'))
    res = w.submit(dec.reserve(req("bad", range(5, 20), sp), "p0")).result(timeout=10)
    assert not res.ok and "invalid JSON schema" in res.error
    (a,) = dec.wait_arrivals(1)
    assert not a.header.ok  # the decode side frees its blocks


class GatedXGrammar:
    """The xgrammar backend, its compile held until `gate` opens."""

    gate = threading.Event()

    @staticmethod
    def load():
        from cluster.structured.xgrammar_backend import XGrammarBackend

        class Gated(XGrammarBackend):
            def export(self):
                # No export: compiles run on the compiler's threads in this process, where the gate is
                # (a compile child would build a plain backend and never see it).
                return None

            def compile(self, so):
                assert GatedXGrammar.gate.wait(30)
                return super().compile(so)

        return Gated


register_grammar_backend("gated-xgrammar", GatedXGrammar.load)


def test_a_compiling_grammar_holds_up_only_its_own_prompt(setup, demo_model_dir):
    dec, w = setup
    GatedXGrammar.gate.clear()
    w.grammars = GrammarCompiler(lambda: load_tokenizer(demo_model_dir), w.arch.vocab_size, w.arch.eos_token_ids,
                                 backend="gated-xgrammar", on_ready=w._grammar_ready)
    so = StructuredOutput.choice(["zebra", "yak"])
    prompts = [list(range(5, 30)), list(range(40, 52))]
    params = [SamplingParams(max_tokens=10, temperature=0.0, structured=so),
              SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)]
    reqs = [req(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    tasks = [dec.reserve(r, "p0") for r in reqs]
    w.start()
    futs = [w.submit(t) for t in tasks]
    assert futs[1].result(timeout=60).ok  # the free prompt behind it went ahead
    assert not futs[0].done()
    GatedXGrammar.gate.set()  # the compile finishes and wakes the loop
    first = futs[0].result(timeout=60)
    eng = LLMEngine(demo_model_dir)
    ref = eng.generate([prompts[0]], params[0])[0]
    assert first.ok and first.first_token == ref.token_ids[0] and ref.text in ("zebra", "yak")


def test_warmup_brings_the_grammar_engine_in(setup):
    """Before serving: the backend (xgrammar's import, the tokenizer's tables) is built and a schema
    compiled; a request with that schema then finds it compiled, ready at once."""
    from cluster.engine.warmup import WARMUP_SCHEMA

    dec, w = setup
    info = w.warmup()
    assert 0 < info["grammar_seconds"] <= info["seconds"] and w.grammars.compiles == 1
    assert w.grammars.prepare().done()  # the backend exists
    g = w.grammars.grammar_for(WARMUP_SCHEMA, "r")
    assert g.ready() and w.grammars.compiles == 1  # from the cache
    assert w.allocator.num_free == w.allocator.capacity  # the warm-up lent its blocks back
