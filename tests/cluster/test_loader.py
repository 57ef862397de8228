import json
import shutil

import pytest
import torch

from cluster.errors import ModelLoadError
from cluster.model.config import ModelArchConfig
from cluster.model.loader import load_model


def test_missing_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="model directory not found"):
        load_model(tmp_path / "nope")


def test_missing_config(tmp_path):
    with pytest.raises(ModelLoadError, match="missing config.json"):
        load_model(tmp_path)


def test_unknown_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'.*GPT2LMHeadModel"):
        load_model(tmp_path)


def test_unsupported_rope_type(demo_model_dir, tmp_path):
    cfg = json.loads((demo_model_dir / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 2.0}
    with pytest.raises(ModelLoadError, match="rope_type 'yarn'"):
        ModelArchConfig.from_dict(cfg)


def test_missing_shard_is_named(qwen2_model_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(qwen2_model_dir, d)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[-1]
    (d / victim).unlink()
    with pytest.raises(ModelLoadError, match=victim):
        load_model(d)


def test_missing_weights_are_named(demo_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    d = tmp_path / "m"
    shutil.copytree(demo_model_dir, d)
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.2.mlp.up_proj.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ModelLoadError, match="layers.2.mlp.gate_up_proj"):
        load_model(d)


def test_dtype_override_and_transformers5_config(demo_model_dir):
    model = load_model(demo_model_dir, dtype="bfloat16")
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.lm_head.weight is model.embed_tokens.weight  # tied embeddings stay tied
    # The rotary table is in the activation dtype (computed in float32, cast once at load).
    assert model.rotary.cos_sin.dtype == torch.bfloat16
    cfg = json.loads((demo_model_dir / "config.json").read_text())
    rope = dict(cfg.pop("rope_scaling"), rope_theta=cfg.pop("rope_theta"))
    v5 = ModelArchConfig.from_dict({**cfg, "rope_parameters": rope})
    assert v5 == ModelArchConfig.from_dict(json.loads((demo_model_dir / "config.json").read_text()))


def test_demo_model_is_deterministic(tmp_path):
    from cluster.model.demo import write_demo_model

    a, b = write_demo_model(tmp_path / "a"), write_demo_model(tmp_path / "b")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()


def test_building_a_model_imports_no_compiler(demo_model_dir):
    """A worker builds its model on the meta device: no op may run there (torch._refs imports
    torch._dynamo, sympy and torch.fx on first use, ~1-4 s of CPU in each worker process), and the
    rotary table has its real values once the model is on its device."""
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "from cluster.model.loader import load_model\n"
            f"m = load_model({str(demo_model_dir)!r})\n"
            "assert not {'torch._dynamo', 'sympy'} & set(sys.modules), 'torch._dynamo or sympy imported'\n"
            "cs = m.rotary.cos_sin\n"
            "assert cs.device.type == 'cpu' and torch.equal(cs[0], torch.cat((torch.ones(cs.shape[1] // 2), "
            "torch.zeros(cs.shape[1] // 2))).to(cs.dtype)), cs[0]\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
