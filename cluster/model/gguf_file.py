"""A GGUF checkpoint (llama.cpp's single-file format) read as a Hugging Face Llama checkpoint.

Read and dequantized by the `gguf` library that ggml maintains (Q4_0, Q4_1, Q5_x, Q8_0, the k-quants,
F16, BF16, F32: whatever `gguf.quants.dequantize` knows), then cast to the serving dtype. Its tensors
are named as transformers names them (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`),
so the loader treats a GGUF file as one more file of tensors beside safetensors (GGUFFile and
SafetensorsFile share TensorFile's methods, cluster/model/checkpoint.py).

llama.cpp's converter permutes the rows of a Llama model's attn_q / attn_k (its rotary pairs adjacent
dimensions, HF's pairs the two halves of each head); `_unpermute` undoes it, as transformers'
LlamaTensorProcessor does. Qwen2 files are written unpermuted.

The config comes from the file's metadata (`llama.block_count`, ...), spelled as a config.json
(`hf_config`); the tokenizer and chat template too, built by transformers from the file
(`AutoTokenizer.from_pretrained(dir, gguf_file=...)`). Both are slow to derive (the reader parses every
vocabulary string: seconds), so `metadata_dir` writes them once per file into a cache directory that
every later process (API server, workers) reads like a model directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch

from cluster.errors import ModelLoadError

# GGUF architecture -> (our model_type, rows of attn_q/attn_k permuted by llama.cpp's converter).
_ARCHITECTURES = {"llama": ("llama", True), "qwen2": ("qwen2", False)}

# GGUF tensor -> transformers tensor; `blk.{i}.` prefixes map to `model.layers.{i}.`.
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_BLOCK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj"}
# llama.cpp's file types that keep a float type throughout: served in it unless --dtype says otherwise.
_FILE_DTYPES = {0: "float32", 1: "float16", 32: "bfloat16"}


def is_gguf(path: str | Path) -> bool:
    return Path(path).suffix.lower() == ".gguf"


def _reader(path: Path):
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ModelLoadError(f"{path.name} is a GGUF file: reading it needs the `gguf` package "
                             f"(pip install gguf)") from None
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    try:
        return GGUFReader(str(path))
    except Exception as e:  # a truncated or foreign file: ValueError, struct errors, ...
        raise ModelLoadError(f"cannot read {path} as GGUF: {type(e).__name__}: {e}") from None


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


class GGUFFile:
    """One GGUF file: its config (as a config.json would hold it) and its tensors under HF names."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.name = self.path.name
        self._reader = _reader(self.path)
        arch = _field(self._reader, "general.architecture")
        if arch not in _ARCHITECTURES:
            raise ModelLoadError(f"{self.name}: unsupported GGUF architecture {arch!r}; supported: "
                                 f"{', '.join(sorted(_ARCHITECTURES))}")
        self.arch = arch
        self.model_type, self._permuted = _ARCHITECTURES[arch]
        self._tensors = {}
        for t in self._reader.tensors:
            hf = _hf_name(t.name)
            if hf is None:
                raise ModelLoadError(f"{self.name}: unexpected GGUF tensor {t.name!r}" + (
                    " (Llama 3.1 rope scaling stored as per-frequency factors is not supported)"
                    if t.name == "rope_freqs.weight" else ""))
            self._tensors[hf] = t
        self.num_heads = self._meta("attention.head_count")
        self.num_kv_heads = self._meta("attention.head_count_kv", self.num_heads)

    def _meta(self, key: str, default=None):
        value = _field(self._reader, f"{self.arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{self.name}: GGUF metadata lacks {self.arch}.{key}")
        return value

    # -- config ---------------------------------------------------------------------------------

    def hf_config(self) -> dict:
        """The config.json transformers derives from this file's metadata (the fields pdserve reads)."""
        hidden = self._meta("embedding_length")
        rope_scaling = _field(self._reader, f"{self.arch}.rope.scaling.type", "none")
        if rope_scaling not in ("none", "linear"):
            raise ModelLoadError(f"{self.name}: unsupported GGUF rope scaling {rope_scaling!r} (none, linear)")
        tokens = self._reader.fields.get("tokenizer.ggml.tokens")
        vocab = _field(self._reader, f"{self.arch}.vocab_size") or (len(tokens.data) if tokens else None)
        if vocab is None:
            raise ModelLoadError(f"{self.name}: GGUF metadata gives no vocabulary size")
        # llama.cpp ends a generation at any end-of-generation token: EOS, and EOT / EOM where a
        # vocabulary has them (Llama 3's <|eot_id|>).
        eos = [_field(self._reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        cfg = {
            "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "intermediate_size": self._meta("feed_forward_length"),
            "num_hidden_layers": self._meta("block_count"),
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": _field(self._reader, f"{self.arch}.attention.key_length")
            or _field(self._reader, f"{self.arch}.rope.dimension_count") or hidden // self.num_heads,
            "rms_norm_eps": float(self._meta("attention.layer_norm_rms_epsilon")),
            "max_position_embeddings": self._meta("context_length"),
            "rope_theta": float(_field(self._reader, f"{self.arch}.rope.freq_base", 10000.0)),
            "hidden_act": "silu",
            "tie_word_embeddings": "lm_head.weight" not in self._tensors,
            "attention_bias": "model.layers.0.self_attn.q_proj.bias" in self._tensors,
            "torch_dtype": _FILE_DTYPES.get(_field(self._reader, "general.file_type", 0), "float32"),
            "bos_token_id": _field(self._reader, "tokenizer.ggml.bos_token_id"),
            "eos_token_id": list(dict.fromkeys(e for e in eos if e is not None)),
            "pdserve_gguf": {"file": str(self.path), "architecture": self.arch},
        }
        if rope_scaling == "linear":
            cfg["rope_scaling"] = {"rope_type": "linear",
                                   "factor": float(self._meta("rope.scaling.factor"))}
        return cfg

    # -- tensors (TensorFile) ---------------------------------------------------------------------

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def keys(self) -> list[str]:
        return list(self._tensors)

    def shape(self, key: str) -> tuple[int, ...]:
        # GGUF lists dimensions fastest-varying first; torch's order is the reverse.
        return tuple(int(d) for d in reversed(self._tensors[key].shape))

    def read(self, key: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The tensor dequantized to float32 (exact: every GGUF type's values are float32 numbers),
        HF's row order restored; `index`: this rank's part (the whole tensor is dequantized first: a
        quantization block runs along a row, a column split cuts through blocks)."""
        t = self._tensors[key]
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        try:
            w = dequantize(t.data, t.tensor_type) if t.tensor_type != GGMLQuantizationType.F32 else t.data
        except NotImplementedError:
            raise ModelLoadError(f"{self.name}: tensor {t.name!r} has GGUF type {t.tensor_type.name}, "
                                 f"which the gguf library cannot dequantize") from None
        w = np.array(w, dtype=np.float32).reshape(self.shape(key))  # a copy: the file is mapped read-only
        if self._permuted and key.endswith(("q_proj.weight", "k_proj.weight")):
            w = _unpermute(w, self.num_heads if "q_proj" in key else self.num_kv_heads)
        out = torch.from_numpy(np.ascontiguousarray(w))
        return out if index is None else out[index].contiguous()


def _hf_name(name: str) -> str | None:
    if name in _TOP:
        return _TOP[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _BLOCK and parts[3] in ("weight", "bias"):
        return f"model.layers.{parts[1]}.{_BLOCK[parts[2]]}.{parts[3]}"
    return None


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's convert_hf_to_gguf `permute`: within each head, rows (pair j, half h)
    go back from position 2j+h to h*dim/2 + j."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# -- the cached metadata directory ----------------------------------------------------------------

def metadata_dir(path: str | Path) -> Path:
    """A directory holding config.json and the tokenizer (with its chat template) derived from the
    GGUF file `path`, written on first use under $PDSERVE_HOME/gguf (keyed by the file's path, size
    and mtime: a rewritten file gets a new one)."""
    path = Path(path).resolve()
    try:
        st = path.stat()
    except OSError:
        raise ModelLoadError(f"GGUF file not found: {path}") from None
    key = hashlib.blake2b(f"{path}|{st.st_size}|{st.st_mtime_ns}".encode(), digest_size=8).hexdigest()
    root = Path(os.environ.get("PDSERVE_HOME", Path.home() / ".cache" / "pdserve")) / "gguf"
    out = root / f"{path.stem}-{key}"
    if (out / "config.json").is_file():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        cfg = GGUFFile(path).hf_config()
        _write_tokenizer(path, tmp)
        # config.json last: its presence marks a complete directory.
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        try:
            tmp.rename(out)
        except OSError:  # another process won the race; its copy is identical
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_tokenizer(path: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # transformers raises many types for a vocabulary it cannot convert
        raise ModelLoadError(f"cannot build a tokenizer from {path.name}'s metadata: "
                             f"{str(e).strip() or type(e).__name__}") from None
    tok.save_pretrained(str(out))
