"""Default sampling parameters from a model's `generation_config.json`, as vLLM takes them.

The model's creator recommends sampling settings there (`temperature: 0.6, top_p: 0.9`, ...); vLLM
serves with them unless a request sets its own (`--generation-config auto`, its default), or
ignores them (`--generation-config vllm`), or reads them from another folder (`--generation-config
DIR`). The keys it takes: temperature, top_p, top_k, min_p, repetition_penalty, and max_new_tokens as
the default max_tokens (capped by what the context leaves). The EOS ids of the file are the model's
(cluster.model.config), whatever this setting says.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

from cluster.errors import ModelLoadError

GENERATION_CONFIG_MODES = ("auto", "vllm")  # or a folder holding generation_config.json


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that leaves a field unset gets (None: the API's own default)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # generation_config's max_new_tokens

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


_KEYS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float, "repetition_penalty": float,
         "max_new_tokens": int}


def load_sampling_defaults(model_dir: str | Path, generation_config: str = "auto") -> SamplingDefaults:
    """`generation_config`: "auto" (the model directory's file), "vllm" (none), or a folder."""
    if generation_config == "vllm":
        return SamplingDefaults()
    folder = Path(model_dir) if generation_config == "auto" else Path(generation_config).expanduser()
    path = folder / "generation_config.json"
    if not path.is_file():
        if generation_config != "auto":
            raise ModelLoadError(f"--generation-config {generation_config}: no generation_config.json in {folder}")
        return SamplingDefaults()
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    out = {}
    for key, kind in _KEYS.items():
        v = data.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and v != int(v)):
            raise ModelLoadError(f"{path}: {key} must be a number, got {v!r}")
        out["max_tokens" if key == "max_new_tokens" else key] = kind(v)
    return SamplingDefaults(**out)
