"""The architecture of a Llama-family checkpoint, read from a Hugging Face `config.json` (a GGUF
file's metadata is first spelled as one: cluster/model/gguf_file.py).

Handles both the transformers 4.x spelling (`rope_theta` + `rope_scaling`, `torch_dtype`) and the
5.x one (`rope_parameters`, `dtype`), so checkpoints written by either load the same way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from cluster.errors import ModelLoadError

# model_type -> whether q/k/v projections carry a bias by default.
SUPPORTED_MODEL_TYPES = {"llama": False, "mistral": False, "qwen2": True}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelArchConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: tuple[tuple[str, Any], ...] = ()  # frozen copy of the rope dict, minus theta
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def rope_type(self) -> str:
        return dict(self.rope_scaling).get("rope_type", "default")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.kv_size * dtype_bytes

    def weight_count(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_layers * per_layer + h + head

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> "ModelArchConfig":
        model_type = cfg.get("model_type")
        archs = cfg.get("architectures") or []
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(
                f"unsupported architecture {model_type!r} (architectures={archs}) in {source}; "
                f"supported model_type values: {', '.join(sorted(SUPPORTED_MODEL_TYPES))}"
            )
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size"):
            if key not in cfg:
                raise ModelLoadError(f"{source} lacks required field {key!r}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"unsupported hidden_act {cfg['hidden_act']!r} in {source} (only 'silu')")
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        # transformers 5 folds theta into rope_parameters; 4.x keeps rope_theta + rope_scaling.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope.pop("type", None)
        rope["rope_type"] = rope_type
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelLoadError(f"unsupported rope_type {rope_type!r} in {source}; supported: {SUPPORTED_ROPE_TYPES}")
        sliding = cfg.get("sliding_window")
        if model_type == "qwen2" and not cfg.get("use_sliding_window", False):
            sliding = None
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rope_theta=theta,
            rope_scaling=tuple(sorted(rope.items())),
            attention_bias=bool(cfg.get("attention_bias", SUPPORTED_MODEL_TYPES[model_type])),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            sliding_window=int(sliding) if sliding else None,
            dtype=str(dtype),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelArchConfig":
        """From a checkpoint directory's config.json (and generation_config.json's EOS ids), or from
        a GGUF file's metadata (cluster/model/gguf_file.py)."""
        from cluster.model.gguf_file import is_gguf, metadata_dir

        path = Path(model_dir)
        if is_gguf(path):
            path = metadata_dir(path)
        if not path.is_dir():
            raise ModelLoadError(f"model directory not found: {path}")
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise ModelLoadError(f"missing config.json in model directory {path}")
        try:
            cfg = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{cfg_path} is not valid JSON: {e}") from None
        arch = cls.from_dict(cfg, source=str(cfg_path))
        gen_path = path / "generation_config.json"
        if gen_path.is_file():
            gen_eos = json.loads(gen_path.read_text()).get("eos_token_id")
            if gen_eos is not None:
                ids = tuple(gen_eos) if isinstance(gen_eos, list) else (gen_eos,)
                merged = tuple(dict.fromkeys(arch.eos_token_ids + ids))
                arch = replace(arch, eos_token_ids=merged)
        return arch

