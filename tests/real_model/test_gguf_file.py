"""The GGUF reader (cluster/model/gguf_file.py) against transformers reading the same file: config,
tokenizer and chat template, and every weight (dequantized, Q/K rows in HF's order)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cluster.errors import ModelLoadError
from cluster.model.config import ModelArchConfig
from cluster.model.gguf_file import _unpermute


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute, as written there."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_head, head_dim, cols", [(9, 64, 5), (3, 8, 1), (1, 4, 3)])
def test_unpermute_inverts_llama_cpps_permute(n_head, head_dim, cols):
    w = np.arange(n_head * head_dim * cols, dtype=np.float32).reshape(n_head * head_dim, cols)
    permuted = _llama_cpp_permute(w, n_head)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(_unpermute(permuted, n_head), w)


def test_config_equals_transformers(smollm2_gguf, hf_smollm2):
    ours, theirs = ModelArchConfig.from_dir(smollm2_gguf), hf_smollm2[0].config
    assert (ours.model_type, ours.vocab_size, ours.hidden_size, ours.intermediate_size, ours.num_layers,
            ours.num_heads, ours.num_kv_heads, ours.head_dim, ours.max_position_embeddings,
            ours.tie_word_embeddings, ours.bos_token_id) == (
        theirs.model_type, theirs.vocab_size, theirs.hidden_size, theirs.intermediate_size,
        theirs.num_hidden_layers, theirs.num_attention_heads, theirs.num_key_value_heads, theirs.head_dim,
        theirs.max_position_embeddings, theirs.tie_word_embeddings, theirs.bos_token_id)
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps)
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"] and ours.rope_type == "default"
    assert ours.eos_token_ids == (theirs.eos_token_id,) == (2,)  # <|im_end|>


def test_tokenizer_and_chat_template_equal_transformers(smollm2_gguf, hf_smollm2):
    from cluster.text.tokenizer import load_tokenizer

    ours, theirs = load_tokenizer(smollm2_gguf), hf_smollm2[1]
    assert ours.decode([2]) == "<|im_end|>" and ours.chat_template == theirs.chat_template
    for text in ["The capital of France is", "  two  spaces, tabs\tand 数字 123456 émigré <|im_start|>", ""]:
        assert ours(text).input_ids == theirs(text).input_ids
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    assert (ours.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            == theirs.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))


def test_weights_equal_transformers(smollm2_gguf, hf_smollm2):
    """Every tensor as transformers dequantizes it, the attention's Q and K rows unpermuted."""
    from cluster.model.loader import load_model

    ours = load_model(smollm2_gguf, dtype="float32")
    sd = hf_smollm2[0].state_dict()
    assert torch.equal(ours.embed_tokens.weight, sd["model.embed_tokens.weight"])
    assert ours.lm_head.weight.data_ptr() == ours.embed_tokens.weight.data_ptr()  # tied
    for i in (0, 17, 29):
        p = f"model.layers.{i}."
        layer = ours.layers[i]
        qkv = torch.cat([sd[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        assert torch.equal(layer.self_attn.qkv_proj.weight, qkv)
        assert torch.equal(layer.self_attn.o_proj.weight, sd[p + "self_attn.o_proj.weight"])
        assert torch.equal(layer.mlp.gate_up_proj.weight,
                           torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]]))
        assert torch.equal(layer.mlp.down_proj.weight, sd[p + "mlp.down_proj.weight"])
    assert torch.equal(ours.norm.weight, sd["model.norm.weight"])


def test_a_file_that_is_not_gguf_is_a_clear_error(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 20)
    with pytest.raises(ModelLoadError, match="cannot read .*broken.gguf as GGUF"):
        ModelArchConfig.from_dir(bad)
    with pytest.raises(ModelLoadError, match="GGUF file not found"):
        ModelArchConfig.from_dir(tmp_path / "missing.gguf")
