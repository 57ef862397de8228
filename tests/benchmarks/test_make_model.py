"""benchmarks/make_model.py: random-weight checkpoints of real models' shapes."""

import json

import pytest

from benchmarks.make_model import model_config, write_model


def test_make_model_shapes(tmp_path, demo_model_dir):
    from cluster.engine.engine import LLMEngine
    from cluster.model.config import ModelArchConfig
    from cluster.sampling.sampling_params import SamplingParams

    big = ModelArchConfig.from_dict(model_config("llama-1b"))
    assert big.vocab_size == 128256 and big.num_layers == 16 and big.dtype == "bfloat16"
    assert big.weight_count() == pytest.approx(1.236e9, rel=0.01)  # Llama-3.2-1B

    d = write_model("llama-tiny", tmp_path / "m", dtype="float32")
    assert json.loads((d / "config.json").read_text())["vocab_size"] == 4096
    out = LLMEngine(str(d), device="cpu").generate(["Hello"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    demo_vocab = json.loads((demo_model_dir / "config.json").read_text())["vocab_size"]
    assert len(out[0].token_ids) == 6 and max(out[0].token_ids) < demo_vocab  # padded ids are never chosen
