"""`--max-model-len 25.6k`: integers with a size suffix, as vLLM reads them."""

from __future__ import annotations

import re

_SUFFIXED = re.compile(r"(\d+(?:\.\d+)?)([kmgtKMGT])")


def human_readable_int(text: str) -> int:
    """vLLM's reading of `--max-model-len`: a plain integer, or one with a suffix; k m g t are
    decimal (25.6k = 25600), K M G T binary (8K = 8192, integers only)."""
    t = text.strip()
    m = _SUFFIXED.fullmatch(t)
    if m is None:
        try:
            return int(t)
        except ValueError:
            raise ValueError(f"{text!r} is not an integer (a suffix k, m, g, t or K, M, G, T may follow)") from None
    number, suffix = m.groups()
    if suffix.islower():
        return int(float(number) * 1000 ** "kmgt".index(suffix.lower()) * 1000)
    if "." in number:
        raise ValueError(f"{text!r}: no decimals with a binary suffix ({suffix}); did you mean {number}{suffix.lower()}?")
    return int(number) * 1024 ** ("KMGT".index(suffix) + 1)
