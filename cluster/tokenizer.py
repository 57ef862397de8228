"""Tokenizer loading and prompt encoding (plain text or chat messages)."""

from __future__ import annotations

from pathlib import Path

from cluster.errors import InvalidRequestError, ModelLoadError


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as e:  # transformers raises many types for a bad directory
        raise ModelLoadError(f"cannot load a tokenizer from {model_dir}: {str(e).splitlines()[0]}") from None


def encode_prompt(tokenizer, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt must not be empty", "prompt")
        return list(tokenizer(prompt).input_ids)
    ids = list(prompt)
    if not ids:
        raise InvalidRequestError("prompt must not be empty", "prompt")
    if not all(isinstance(t, int) and 0 <= t < len(tokenizer) for t in ids):
        raise InvalidRequestError(f"prompt token ids must be integers in [0, {len(tokenizer)})", "prompt")
    return ids


def encode_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """`tools`: function tools in HF's shape ({type: function, function: {name, description,
    parameters}}), which the chat template renders (a template that ignores them renders none)."""
    if not messages:
        raise InvalidRequestError("messages must not be empty", "messages")
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("this model has no chat template; use /v1/completions", "messages")
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                             tokenize=False)
    except Exception as e:
        raise InvalidRequestError(f"cannot apply the chat template: {e}", "messages") from None
    # The template already carries BOS where the model wants it.
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def encode_bad_words(tokenizer, words: list[str]) -> tuple[tuple[int, ...], ...]:
    """vLLM's rule: each word as it is and with a leading space (the same word mid-text), the second
    kept only when it is another token sequence of the same length."""
    out: list[list[int]] = []
    for word in words:
        if not isinstance(word, str) or not word.strip():
            raise InvalidRequestError("bad_words must be non-empty strings", "bad_words")
        for prefix in ("", " "):
            ids = list(tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False))
            if not ids:
                raise InvalidRequestError(f"bad word {word!r} encodes to no token", "bad_words")
            if not prefix or (ids[0] != out[-1][0] and len(ids) == len(out[-1])):
                out.append(ids)
    return tuple(tuple(w) for w in out)
