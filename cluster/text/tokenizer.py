"""Tokenizer loading and prompt encoding (plain text or chat messages)."""

from __future__ import annotations

from pathlib import Path

from cluster.text.decode_tokenizer import DecodeTokenizer
from cluster.errors import InvalidRequestError, ModelLoadError


def load_tokenizer(model_dir: str | Path, chat_template: str | None = None):
    """The model's tokenizer; `chat_template` (the text `load_chat_template` read) replaces its own.
    A GGUF file's is the one transformers builds from its metadata (cached: cluster/model/gguf_file.py)."""
    from transformers import AutoTokenizer

    from cluster.model.checkpoint import metadata_dir

    source = metadata_dir(model_dir)
    try:
        tok = AutoTokenizer.from_pretrained(str(source))
    except Exception as e:  # transformers raises many types for a bad directory
        why = str(e).strip() or type(e).__name__
        raise ModelLoadError(f"cannot load a tokenizer from {model_dir}: {why}") from None
    if isinstance(tok, bool) or not hasattr(tok, "encode"):  # transformers may hand back a non-tokenizer
        raise ModelLoadError(f"cannot load a tokenizer from {model_dir}: no tokenizer files found there")
    # For the processes that only decode (the decode worker's publisher): they load it without transformers.
    DecodeTokenizer.remember(model_dir, tok)
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok


_JINJA_CHARS = "{}\n"


def load_chat_template(value: str) -> str:
    """`--chat-template` as vLLM reads it: a file's path, or the template itself (it has Jinja's
    braces or a newline)."""
    path = Path(value).expanduser()
    if path.is_file():
        try:
            return path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"cannot read the chat template {path}: {e}") from None
    if any(c in value for c in _JINJA_CHARS):
        return value.encode("utf-8").decode("unicode_escape") if "\\n" in value else value
    raise ModelLoadError(f"--chat-template {value!r} looks like a file path, but there is no such file")


def check_chat_template(tokenizer, source: str) -> None:
    """The template renders a small conversation (a syntax error, or one that raises, is found here
    and not on the first chat request). A model without a template serves /v1/completions only."""
    if not getattr(tokenizer, "chat_template", None):
        return
    messages = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hello"},
                {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Bye"}]
    try:
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # jinja2's TemplateSyntaxError / TemplateError, or what the template raises
        try:  # a template that refuses a system message (Mistral's) still serves the others
            tokenizer.apply_chat_template(messages[1:], add_generation_prompt=True, tokenize=False)
        except Exception:
            raise ModelLoadError(f"the chat template of {source} does not render: {type(e).__name__}: {e}") from None


_PLAIN_INT = frozenset({int})


def encode_prompt(tokenizer, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt must not be empty", "prompt")
        return list(tokenizer(prompt).input_ids)
    ids = list(prompt)
    if not ids:
        raise InvalidRequestError("prompt must not be empty", "prompt")
    vocab = len(tokenizer)  # once: a Hugging Face tokenizer's len() is a call into it
    # Plain ints (every prompt parsed from JSON) are checked at C speed (the loop below cost ~0.09 ms of
    # a 2048-token prompt's TTFT on a CPU host, this ~0.07); anything else (a bool, an int subclass, a
    # float) takes the loop, whose answer it is.
    if set(map(type, ids)) <= _PLAIN_INT:
        ok = min(ids) >= 0 and max(ids) < vocab
    else:
        ok = all(isinstance(t, int) and 0 <= t < vocab for t in ids)
    if not ok:
        raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})", "prompt")
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
