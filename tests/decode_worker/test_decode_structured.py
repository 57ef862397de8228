"""Structured output on the decode worker (no Ray): constrained requests, prefilled here or by a real
PrefillWorker over the in-process transport, decode in the same batches as free ones and come out
exactly as the engine's (greedy and seeded); a migrated request's grammar is replayed over the tokens
it had; a grammar that fails after admission ends its request with an error; prompt scoring ends at
the prefill with the prompt's logprobs."""

import json
import re
import sys
from pathlib import Path

import pytest

from cluster.engine.engine import LLMEngine
from cluster.wire.messages import GenerateRequest, PrefillTask, ReserveRequest
from cluster.sampling.sampling_params import SamplingParams
from cluster.structured import GrammarCompiler, StructuredOutput
from cluster.structured.compile_process import START_TIMEOUT_S
from cluster.structured.grammar_compiler import COMPILE_TIMEOUT_S
from cluster.transport.factory import TransportSpec, create_transport
from cluster.worker.worker_config import WorkerConfig
from decode_worker.decode_worker import DecodeWorker
from prefill_worker.prefill_worker import PrefillWorker

sys.path.insert(0, str(Path(__file__).parent))
from test_decode_worker import Collector as _Collector  # noqa: E402

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999},
    "kind": {"enum": ["a", "b"]},
    "items": {"type": "array", "items": {"type": "object", "properties": {"n": {"type": "string", "maxLength": 6}},
                                         "required": ["n"]}, "maxItems": 2}},
    "required": ["id", "kind", "items"]}
REGEX = r"[a-z]{2,5}-[0-9]{2}"


def cases():
    """(prompt, params, seed): constrained ones of each kind, greedy and seeded, among free ones."""
    js, rx = StructuredOutput.json_schema(SCHEMA), StructuredOutput.regex(REGEX)
    ch = StructuredOutput.choice(["left", "right"])
    return [
        ("Tell me a story", SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True), 0),
        ("Give JSON", SamplingParams(max_tokens=200, temperature=0.0, structured=js), 0),
        ("Give JSON", SamplingParams(max_tokens=200, temperature=1.0, seed=7, structured=js), 7),
        ("code:", SamplingParams(max_tokens=40, temperature=1.0, seed=3, structured=rx), 3),
        ("Once upon a time", SamplingParams(max_tokens=25, temperature=0.8, seed=5, ignore_eos=True), 5),
        ("Which way?", SamplingParams(max_tokens=10, temperature=0.0, logprobs=2, structured=ch), 0),
        ("Give JSON again", SamplingParams(max_tokens=200, temperature=1.0, seed=9, top_k=40, structured=js,
                                           presence_penalty=0.5), 9),
    ]


def check(params, text):
    so = params.structured
    if so is None:
        return
    if so.kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif so.kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in so.choices()


@pytest.fixture(scope="module")
def engine(demo_model_dir):
    return LLMEngine(demo_model_dir, dtype="float32")


def make_worker(model_dir, **kw):
    cfg = WorkerConfig(model_dir=str(model_dir), dtype="float32", max_num_seqs=8, **kw)
    return DecodeWorker("d0", cfg)


class Collector(_Collector):
    def wait(self, n, stall_s=START_TIMEOUT_S + COMPILE_TIMEOUT_S):
        """Until `n` requests finished. The default stall bound is a grammar's own deadline: the first
        compile starts the compile processes (they import torch and xgrammar), minutes in the other test
        stream (nice 10) on a busy machine."""
        super().wait(lambda: len(self.finish) >= n, stall_s)


def test_local_prefill_constrained_rows_equal_the_engine(demo_model_dir, engine):
    cs = cases()
    ref = [engine.generate([p], sp)[0] for p, sp, _ in cs]
    worker = make_worker(demo_model_dir)
    try:
        col = Collector(worker)
        for i, (p, sp, seed) in enumerate(cs):
            ids = engine.tokenizer(p).input_ids
            assert worker.submit_local(GenerateRequest(f"r{i}", tuple(ids), sp, seed, 0.0)) is not None
        col.wait(len(cs))
        for i, ((_, sp, _), r) in enumerate(zip(cs, ref)):
            assert col.tokens[f"r{i}"] == list(r.token_ids), i
            assert col.finish[f"r{i}"] == r.finish_reason
            if sp.structured is not None:
                assert r.finish_reason == "stop"
                check(sp, col.text[f"r{i}"])
        m = worker.step_metrics()
        assert m["steps_total"] > max(len(r.token_ids) for r in ref)  # constrained rows skipped steps
        col_free = worker.stats()
        assert col_free.free_blocks == col_free.total_blocks
    finally:
        worker.shutdown()


def test_prefilled_elsewhere_the_first_token_obeys_the_grammar_too(demo_model_dir, engine, request):
    cs = [c for c in cases() if c[1].structured is not None] + [cases()[0]]
    ref = [engine.generate([p], sp)[0] for p, sp, _ in cs]
    spec = TransportSpec("local", namespace=request.node.name, heartbeat_s=0.05)
    worker = make_worker(demo_model_dir)
    pre = PrefillWorker("p0", WorkerConfig(model_dir=str(demo_model_dir), dtype="float32", num_blocks=128,
                                           max_prefill_tokens=64))
    try:
        worker.attach_transport(create_transport(spec, worker.kv_cache, "d0", "decode"))
        pre.set_transport(create_transport(spec, pre.kv_cache, "p0", "prefill"), send_timeout_s=10.0)
        pre.start()
        col = Collector(worker)
        futs = []
        for i, (p, sp, seed) in enumerate(cs):
            req = GenerateRequest(f"r{i}", tuple(engine.tokenizer(p).input_ids), sp, seed, 0.0)
            res = worker.reserve(ReserveRequest(req, "p0"))
            futs.append(pre.submit(PrefillTask(req, res)))
        # Until the grammar's own deadline: the prefill worker's first compile starts its compile processes
        # (each imports torch and xgrammar), minutes in the other test stream (nice 10) on a busy machine.
        results = [f.result(timeout=START_TIMEOUT_S + COMPILE_TIMEOUT_S) for f in futs]
        assert all(r.ok for r in results), results
        col.wait(len(cs))
        for i, ((_, sp, _), r, res) in enumerate(zip(cs, ref, results)):
            assert res.first_token == r.token_ids[0]
            assert col.tokens[f"r{i}"] == list(r.token_ids), i
            check(sp, col.text[f"r{i}"])
    finally:
        pre.shutdown()
        worker.shutdown()
        pre.transport.close()


def test_a_migrated_request_replays_its_grammar(demo_model_dir, engine):
    """Resubmitted with its prompt + the tokens it had (resumed_tokens), it continues as if uninterrupted."""
    _, sp, seed = cases()[2]
    prompt = engine.tokenizer("Give JSON").input_ids
    full = engine.generate([prompt], sp)[0]
    k = 9
    moved = SamplingParams(**{**vars(sp), "max_tokens": sp.max_tokens - k})
    worker = make_worker(demo_model_dir)
    try:
        col = Collector(worker)
        req = GenerateRequest("m", tuple(prompt) + full.token_ids[:k], moved, seed, 0.0, resumed_tokens=k)
        worker.submit_local(req)
        col.wait(1)
        assert col.tokens["m"] == list(full.token_ids[k:]) and col.finish["m"] == "stop"
    finally:
        worker.shutdown()


def test_a_grammar_that_fails_after_admission_ends_its_request(demo_model_dir):
    worker = make_worker(demo_model_dir)
    try:
        col = Collector(worker)
        # The tokens it "generated before" are not JSON: the replay on this worker refuses them.
        sp = SamplingParams(max_tokens=20, temperature=0.0, structured=StructuredOutput.json_object())
        worker.submit_local(GenerateRequest("bad", (0, 40, 41, 42), sp, 0, 0.0, resumed_tokens=2))
        worker.submit_local(GenerateRequest("ok", (0, 40, 41), SamplingParams(max_tokens=5, temperature=0.0,
                                                                               ignore_eos=True), 0, 0.0))
        col.wait(2)
        assert col.finish == {"bad": "error", "ok": "length"}
        assert "not allowed by the grammar" in col.error["bad"] and col.tokens["bad"] == []
        worker.check_blocks()
        assert worker.stats().free_blocks == worker.stats().total_blocks
        assert isinstance(worker.grammars, GrammarCompiler)
    finally:
        worker.shutdown()


def test_prompt_scoring_ends_at_the_prefill(demo_model_dir, engine, request):
    prompt = tuple(engine.tokenizer("The quick brown fox jumps over the lazy dog").input_ids)
    ref = engine.generate([list(prompt)], SamplingParams(max_tokens=0, prompt_logprobs=2))[0]
    spec = TransportSpec("local", namespace=request.node.name, heartbeat_s=0.05)
    worker = make_worker(demo_model_dir)
    pre = PrefillWorker("p0", WorkerConfig(model_dir=str(demo_model_dir), dtype="float32", num_blocks=64))
    try:
        worker.attach_transport(create_transport(spec, worker.kv_cache, "d0", "decode"))
        pre.set_transport(create_transport(spec, pre.kv_cache, "p0", "prefill"), send_timeout_s=10.0)
        pre.start()
        col = Collector(worker)
        sp = SamplingParams(max_tokens=0, prompt_logprobs=2)
        worker.submit_local(GenerateRequest("local", prompt, sp, 0, 0.0))
        req = GenerateRequest("remote", prompt, sp, 0, 0.0)
        assert pre.submit(PrefillTask(req, worker.reserve(ReserveRequest(req, "p0")))).result(timeout=60).ok
        col.wait(2)
        for rid in ("local", "remote"):
            assert col.finish[rid] == "length" and col.tokens[rid] == [] and col.text[rid] == ""
            got = [None if p is None else p.logprob for p in col.prompt_lps[rid]]
            want = [None if p is None else p.logprob for p in ref.prompt_logprobs]
            assert got[0] is None and got[1:] == pytest.approx(want[1:], abs=1e-5)
        worker.check_blocks()
    finally:
        pre.shutdown()
        worker.shutdown()
        pre.transport.close()
