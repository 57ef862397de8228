"""DecodeTokenizer: a fast tokenizer's Rust core, for a process that only turns token ids into text
(the decode worker's token-publisher process, decode_worker/publisher_process.py).

Loading a tokenizer through transformers imports transformers and torch: 3-9 s of CPU per process on
a 2-core machine, paid by every decode worker start and restart before it can serve. The Rust
tokenizer under a fast HF tokenizer loads from its JSON in ~0.1 s with only `tokenizers` imported.

The JSON is the one transformers built (`backend_tokenizer.to_str()`: whatever it added or changed on
load is in it, and a GGUF or SentencePiece tokenizer converted to a fast one is too), written by any
process that loaded the HF tokenizer (`cluster/text/tokenizer.py load_tokenizer` calls `remember`) to
$PDSERVE_HOME/tokenizers, keyed by the checkpoint's tokenizer files (path, size, mtime) and the
versions of transformers and tokenizers. It is written only when the HF tokenizer's `decode` is
exactly its backend's (`_decodes_alike`: no clean-up of tokenization spaces, the same special-token
handling); otherwise, or before any process wrote it, the publisher loads through transformers.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from importlib import metadata
from pathlib import Path

log = logging.getLogger(__name__)

# What a checkpoint's tokenizer is built from (a GGUF file keys on the file itself).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja")
# Decoded both ways before the JSON is trusted: spaces before punctuation and contractions (what
# transformers' clean_up_tokenization rewrites), multi-byte characters, special tokens.
_PROBE = "Hello , world . Isn 't it ? I 'm here ! don 't do n't  héllo ☃ 日本語 \n\t end"


class DecodeTokenizer:
    """The decode side of a fast tokenizer: what the publisher's detokenizers and logprob strings use
    (`backend_tokenizer`, `decode`), equal to the HF tokenizer's by construction (see the module)."""

    def __init__(self, backend):
        self.backend_tokenizer = backend

    def decode(self, token_ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool | None = None) -> str:
        # clean_up_tokenization_spaces: only a tokenizer that never cleans up is cached (_decodes_alike).
        return self.backend_tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    @classmethod
    def cached(cls, model_dir: str | Path) -> DecodeTokenizer | None:
        """The cached tokenizer of this checkpoint, or None (never written, or its files changed)."""
        path = _cache_path(model_dir)
        if path is None or not path.is_file():
            return None
        from tokenizers import Tokenizer

        try:
            return cls(Tokenizer.from_file(str(path)))
        except Exception as e:  # a torn or foreign file: load through transformers instead
            log.warning("ignoring the cached decode tokenizer %s: %s", path, e)
            return None

    @staticmethod
    def remember(model_dir: str | Path, hf_tokenizer) -> bool:
        """Writes `hf_tokenizer`'s backend for `cached` (once per key) when its decode is the backend's;
        returns whether the cache holds it. Never raises for the cache's sake (a read-only home)."""
        path = _cache_path(model_dir)
        if path is None:
            return False
        if path.is_file():
            return True
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        if backend is None or not _decodes_alike(hf_tokenizer, backend):
            return False
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(backend.to_str())
            os.replace(tmp, path)  # atomic: a reader sees no file or a whole one
            return True
        except OSError as e:
            log.debug("cannot cache the decode tokenizer at %s: %s", path, e)
            tmp.unlink(missing_ok=True)
            return False


def _decodes_alike(hf_tokenizer, backend) -> bool:
    """Whether the HF tokenizer's decode is its backend's on text where they could differ."""
    try:
        ids = backend.encode(_PROBE, add_special_tokens=False).ids
        special = [i for i in getattr(hf_tokenizer, "all_special_ids", []) if isinstance(i, int)]
        for sample in (ids, ids[:1], ids[1:2], special, special + ids + special):
            for skip in (False, True):
                if hf_tokenizer.decode(sample, skip_special_tokens=skip) != backend.decode(sample, skip_special_tokens=skip):
                    return False
    except Exception:  # an exotic tokenizer: not cached, loaded through transformers
        return False
    return True


def _cache_path(model_dir: str | Path) -> Path | None:
    """$PDSERVE_HOME/tokenizers/<key>.json for this checkpoint's tokenizer files, or None."""
    root = Path(model_dir).expanduser().resolve()
    files = [root] if root.is_file() else [root / f for f in _TOKENIZER_FILES if (root / f).is_file()]
    if not files:
        return None
    try:
        sig = [f"{f}|{(st := f.stat()).st_size}|{st.st_mtime_ns}" for f in files]
        versions = [metadata.version("transformers"), metadata.version("tokenizers")]
    except (OSError, metadata.PackageNotFoundError):
        return None
    key = hashlib.blake2b(json.dumps([sig, versions]).encode(), digest_size=12).hexdigest()
    home = Path(os.environ.get("PDSERVE_HOME", Path.home() / ".cache" / "pdserve"))
    return home / "tokenizers" / f"{root.name}-{key}.json"
