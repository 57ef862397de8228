import os
import shutil
from pathlib import Path

import pytest
import torch


# Pieces built without a launcher (unit tests) sign and check with an empty secret; outside a test run
# an empty secret is refused (cluster/frame_auth.py: require_secret).
os.environ["PDSERVE_TEST_EMPTY_SECRET"] = "1"


def pytest_configure(config):
    # Keep the demo model and Ray's files out of the user's home during tests.
    root = Path(os.environ.setdefault("PDSERVE_HOME", str(Path(config.rootpath) / ".pytest_pdserve_home")))
    root.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    if not torch.cuda.is_available():
        # Triton kernels run on CPU under the interpreter, whichever test imports triton first: the
        # language module decides at import whether @triton.jit functions are interpreted
        # (tests/triton_interpreter.py then patches the interpreter for NumPy 2.4).
        os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def demo_model_dir() -> Path:
    from cluster.model.demo import ensure_demo_model

    return ensure_demo_model()


@pytest.fixture(scope="session")
def reference_engine(demo_model_dir):
    """The in-process engine every cluster test compares its outputs with."""
    from cluster.engine import LLMEngine

    return LLMEngine(demo_model_dir, num_blocks=1024, max_num_seqs=64)


def _save_hf_variant(config, demo_dir: Path, out: Path, seed: int) -> Path:
    """A checkpoint written by transformers itself (sharded), with peaked random weights."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0.0, 0.5)
            elif "embed_tokens" in name or "lm_head" in name:
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 1.5 / p.shape[-1] ** 0.5)
    model.save_pretrained(out, max_shard_size="300KB")
    for f in demo_dir.iterdir():
        if "token" in f.name or f.name.endswith(".jinja"):
            shutil.copy(f, out / f.name)
    assert (out / "model.safetensors.index.json").is_file(), "expected a sharded checkpoint"
    return out


@pytest.fixture(scope="session")
def qwen2_model_dir(demo_model_dir, tmp_path_factory) -> Path:
    from transformers import Qwen2Config

    cfg = Qwen2Config(vocab_size=512, hidden_size=96, intermediate_size=192, num_hidden_layers=3,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=2048,
                      rope_theta=1_000_000.0, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    return _save_hf_variant(cfg, demo_model_dir, tmp_path_factory.mktemp("qwen2"), seed=1)


@pytest.fixture(scope="session")
def mistral_model_dir(demo_model_dir, tmp_path_factory) -> Path:
    from transformers import MistralConfig

    # A short sliding window so that the long prompts in the tests cross it.
    cfg = MistralConfig(vocab_size=512, hidden_size=128, intermediate_size=224, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=1, head_dim=32, max_position_embeddings=2048,
                        sliding_window=96, bos_token_id=0, eos_token_id=1)
    return _save_hf_variant(cfg, demo_model_dir, tmp_path_factory.mktemp("mistral"), seed=2)
