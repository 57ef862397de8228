"""The formats a checkpoint comes in, behind one interface the loader reads.

A checkpoint is a Hugging Face directory (config.json, tokenizer, `*.safetensors`, sharded with
`model.safetensors.index.json`) or a GGUF file (cluster/model/gguf_file.py). Either gives:
- `metadata_dir(path)`: a directory with config.json and the tokenizer (the checkpoint directory
  itself; for a GGUF file, the one derived from its metadata);
- `tensor_files(path)`: its files of tensors, each a TensorFile under transformers' tensor names.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Protocol

import torch
from safetensors import safe_open

from cluster.errors import ModelLoadError
from cluster.model.gguf_file import GGUFFile, is_gguf
from cluster.model.gguf_file import metadata_dir as gguf_metadata_dir


class TensorFile(Protocol):
    """One file of checkpoint tensors, opened as a context manager."""

    name: str  # the file's name, for error messages

    def keys(self) -> Iterable[str]: ...

    def shape(self, key: str) -> tuple[int, ...]: ...

    def read(self, key: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The tensor, or only its part `index` (a rank's slice under tensor parallelism)."""


class SafetensorsFile:
    """A `*.safetensors` file, memory-mapped: a slice reads only its own bytes."""

    def __init__(self, path: Path):
        self.path, self.name = path, path.name
        self._f = None

    def __enter__(self) -> "SafetensorsFile":
        self._f = safe_open(str(self.path), framework="pt", device="cpu").__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._f.__exit__(*exc)

    def keys(self) -> list[str]:
        return list(self._f.keys())

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._f.get_slice(key).get_shape())

    def read(self, key: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        if index is None or all(s == slice(None) for s in index):
            return self._f.get_tensor(key)
        return self._f.get_slice(key)[index]


def metadata_dir(path: str | Path) -> Path:
    """The directory holding the checkpoint's config.json and tokenizer."""
    return gguf_metadata_dir(path) if is_gguf(path) else Path(path)


def read_config(path: str | Path) -> tuple[dict, Path]:
    """The checkpoint's config.json, parsed, and its path."""
    cfg_path = metadata_dir(path) / "config.json"
    try:
        return json.loads(cfg_path.read_text()), cfg_path
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{cfg_path} is not valid JSON: {e}") from None


def tensor_files(path: str | Path) -> list[TensorFile]:
    path = Path(path)
    if is_gguf(path):
        return [GGUFFile(path)]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({path / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"shard {f.name} named in {index.name} is missing from {path}")
        return [SafetensorsFile(f) for f in files]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {path} (pdserve loads safetensors directories "
                             f"and .gguf files)")
    return [SafetensorsFile(f) for f in files]
