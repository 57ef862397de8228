"""OpenAIServingCompletion's hooks: which prompts need the tokenizer (a thread) and which are only
checked (on the loop)."""

from __future__ import annotations

import pytest

from router.openai.protocol import CompletionRequest
from router.openai.serving_completion import OpenAIServingCompletion


@pytest.mark.parametrize("fields, needs", [
    ({"prompt": [11, 12, 13]}, False),  # token ids only: a bounds check, on the loop
    ({"prompt": [[11, 12], [13]]}, False),
    ({"prompt": "Once upon a time"}, True),
    ({"prompt": ["a", "b"]}, True),
    ({"prompt": [11, 12], "echo": True}, True),  # echo decodes the ids
    ({"prompt": [11, 12], "bad_words": ["x"]}, True),  # bad words are tokenized
])
def test_only_token_id_prompts_skip_the_tokenizer_thread(fields, needs):
    body = CompletionRequest.model_validate({"model": "m", **fields})
    serving = OpenAIServingCompletion(gw=None)
    assert serving.needs_tokenizer(body, serving.echo(body)) is needs
