"""A tensor-parallel decode worker on CPU (rank 0 in this process, its follower a spawned process, gloo,
eager steps through the graph runner's own path): every request, prefilled locally in chunks between
decode steps and joining and leaving the batch, produces exactly the one-process engine's tokens
(greedy, seeded sampling, penalties and logprobs: the features variant, a grammar-constrained request); both ranks ran every pass
(each step's announcement reached the follower); its stats show the group; shutdown ends the follower."""

import random
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the follower rank in a spawned process

sys.path.insert(0, str(Path(__file__).parent))
from test_decode_worker import Collector  # noqa: E402

from cluster.distributed.rank_launcher import ProcessRankLauncher  # noqa: E402
from cluster.engine.engine import LLMEngine  # noqa: E402
from cluster.wire.messages import GenerateRequest  # noqa: E402
from cluster.sampling.sampling_params import SamplingParams  # noqa: E402
from cluster.structured import StructuredOutput  # noqa: E402
from cluster.structured.compile_process import START_TIMEOUT_S  # noqa: E402
from cluster.structured.grammar_compiler import COMPILE_TIMEOUT_S  # noqa: E402
from cluster.worker.worker_config import WorkerConfig  # noqa: E402
from cluster.engine.worker_model import lead_group  # noqa: E402
from decode_worker.decode_worker import DecodeWorker  # noqa: E402
from decode_worker.rank_follower import run_decode_rank  # noqa: E402


def _prompts(seed, lengths):
    rng = random.Random(seed)
    return [[0] + [rng.randrange(5, 500) for _ in range(n - 1)] for n in lengths]


def _reference(model_dir, prompts, params, seed):
    engine = LLMEngine(model_dir, dtype="float32", max_prefill_tokens=512)
    seqs = []
    for i, (p, sp) in enumerate(zip(prompts, params)):
        s = engine.add_request(p, sp, f"r{i}")
        s.seed = seed
        seqs.append(s)
    while engine.has_work():
        engine.step()
    return [(list(s.output_token_ids), s.output_logprobs) for s in seqs]


def test_tp2_decode_worker_equals_the_engine_and_shuts_down_as_a_group(demo_model_dir):
    cfg = WorkerConfig(model_dir=str(demo_model_dir), dtype="float32", max_num_seqs=8, cpu_num_blocks=128,
                       local_prefill_chunk_tokens=48, tensor_parallel_size=2)
    launcher = ProcessRankLauncher(run_decode_rank, "d0", cfg)
    failures = []
    group = lead_group(cfg, launcher.launch, on_failure=failures.append)  # not os._exit: this is pytest
    worker = DecodeWorker("d0", cfg, group=group)
    try:
        _serve_and_check(worker, launcher, failures, demo_model_dir)
    finally:
        worker.shutdown()
    assert launcher.join(30) == [0]  # the follower left its loop on Stop and exited cleanly
    launcher.kill()


def _serve_and_check(worker, launcher, failures, demo_model_dir):
    prompts = _prompts(3, [5, 130, 20, 70, 9, 12])
    params = [SamplingParams(max_tokens=18, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0.9, top_k=30, top_p=0.95, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.0, presence_penalty=0.7, repetition_penalty=1.3, logprobs=2,
                             ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.7, min_p=0.05, ignore_eos=True),
              # Structured output: rank 0's grammar masks reach the follower with the step.
              SamplingParams(max_tokens=8, temperature=0.0, structured=StructuredOutput.regex("[0-9]{4}"))]
    refs = _reference(demo_model_dir, prompts, params, seed=17)
    col = Collector(worker)
    sent0 = worker.group.publisher.sent
    for i in (0, 1, 2):
        assert worker.submit_local(GenerateRequest(f"r{i}", tuple(prompts[i]), params[i], 17, time.time())) is not None
    col.wait(lambda: len(col.tokens.get("r0", [])) >= 4)  # the rest join a running batch
    for i in (3, 4, 5):
        assert worker.submit_local(GenerateRequest(f"r{i}", tuple(prompts[i]), params[i], 17, time.time())) is not None
    # r5 waits for its grammar: the first compile starts the compile processes (each imports torch and
    # xgrammar), a minute or more at this stream's nice 10 on a busy machine; its own deadline bounds it.
    col.wait(lambda: len(col.finish) == len(prompts), stall_s=START_TIMEOUT_S + COMPILE_TIMEOUT_S)
    for i, (toks, _) in enumerate(refs):
        assert col.tokens[f"r{i}"] == toks, f"request {i}"
    st = worker.stats()
    tp = st.extra["tensor_parallel"]
    assert tp["size"] == 2 and set(tp["ranks"]) == {"0", "1"}
    assert tp["ranks"]["1"]["pid"] in [p.pid for p in launcher.processes]
    m = worker.step_metrics()
    # One announcement per pass: every decode step and every local-prefill chunk (the 130-token prompt
    # took three chunks of at most 48 while others decoded).
    assert worker.group.publisher.sent - sent0 >= m["steps_total"] + 3
    assert failures == [] and worker.group.failed is None
    col.wait(lambda: worker.stats().free_blocks == worker.stats().total_blocks)
