"""Where a model named on the command line lives: a local directory, or a Hugging Face hub id found
in the local Hugging Face cache.

pdserve never downloads (HF_HUB_OFFLINE semantics, as vLLM with HF_HUB_OFFLINE=1): a hub id such as
`meta-llama/Llama-3.1-8B-Instruct` resolves to its cached snapshot (the `main` revision, or the one
after `@`: `org/name@<revision>`), in the cache `huggingface_hub` uses ($HF_HUB_CACHE, else
$HF_HOME/hub, else ~/.cache/huggingface/hub). Anything else is a clear error saying how to get it.
"""

from __future__ import annotations

import re
from pathlib import Path

from cluster.errors import ModelLoadError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")


def resolve_model_dir(name: str | Path) -> Path:
    """The directory holding the model `name`: itself if it exists, else its cached hub snapshot."""
    path = Path(name).expanduser()
    if path.exists():
        return path.resolve()
    text = str(name)
    if not _HUB_ID.match(text) or text.startswith((".", "~")):
        raise ModelLoadError(f"model directory not found: {path}")
    repo_id, _, revision = text.partition("@")
    from huggingface_hub import constants, snapshot_download

    try:
        return Path(snapshot_download(repo_id, revision=revision or None, local_files_only=True))
    except Exception as e:  # LocalEntryNotFoundError, or a malformed cache entry
        raise ModelLoadError(
            f"{text} is neither a model directory nor in the local Hugging Face cache ({constants.HF_HUB_CACHE}): "
            f"pdserve does not download models; fetch it first (`hf download {repo_id}`) or give its directory "
            f"({type(e).__name__})") from None
