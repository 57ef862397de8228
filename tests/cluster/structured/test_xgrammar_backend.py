"""The xgrammar backend on the demo tokenizer: what its masks allow, and the 400s of its check."""

import numpy as np
import pytest
import torch

from cluster.errors import InvalidRequestError
from cluster.structured import JSONTag, StructuredOutput, TaggedJSON
from cluster.structured.grammar import bitmask_words
from cluster.structured.registry import get_grammar_backend, grammar_backends
from cluster.text.tokenizer import load_tokenizer

pytest.importorskip("xgrammar")

VOCAB = 576  # the demo tokenizer has 512 tokens: 64 padding ids the model could produce
EOS = (1, 4)


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir):
    return load_tokenizer(demo_model_dir)


@pytest.fixture(scope="module")
def backend(tokenizer):
    return get_grammar_backend("xgrammar")(tokenizer, VOCAB, EOS)


def allowed(backend, matcher) -> set[int]:
    out = torch.zeros(1, bitmask_words(VOCAB), dtype=torch.int32)
    backend.fill_bitmasks([matcher], out, [0])
    bits = np.unpackbits(out.numpy().view(np.uint8), bitorder="little")[:VOCAB]
    return set(np.flatnonzero(bits).tolist())


def walk(backend, tokenizer, so, text):
    m = backend.matcher(backend.compile(so))
    for t in tokenizer.encode(text, add_special_tokens=False):
        assert m.accept_token(t), (text, t)
    return m


def test_registry():
    assert "xgrammar" in grammar_backends()
    with pytest.raises(InvalidRequestError):
        get_grammar_backend("nope")


def test_special_and_padding_tokens_are_never_allowed_and_eos_only_at_the_end(backend, tokenizer):
    so = StructuredOutput.json_schema({"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]})
    m = walk(backend, tokenizer, so, '{"s": "')  # inside a string: almost any text goes
    ok = allowed(backend, m)
    assert len(ok) > 300
    assert not ok & set(tokenizer.all_special_ids) and not ok & set(range(512, VOCAB))
    m = walk(backend, tokenizer, so, '{"s": "x"}')
    assert allowed(backend, m) == set(EOS)  # complete: only a stop token
    assert not m.is_terminated() and m.accept_token(EOS[0]) and m.is_terminated()


def test_choice_and_regex_masks(backend, tokenizer):
    so = StructuredOutput.choice(['say "hi"', "back\\slash", "héllo"])
    for text in ('say "hi"', "back\\slash", "héllo"):
        m = walk(backend, tokenizer, so, text)
        assert allowed(backend, m) == set(EOS)
    m = backend.matcher(backend.compile(StructuredOutput.regex("[0-9]{2}")))
    digits = {t for t in allowed(backend, m)}
    assert digits and all(tokenizer.decode([t]).isdigit() for t in digits)
    assert not m.accept_token(tokenizer.encode("a", add_special_tokens=False)[0])


def test_json_object_is_any_object_and_tagged_json_is_a_call_list(backend, tokenizer):
    m = walk(backend, tokenizer, StructuredOutput.json_object(), '{"free": [1, {"x": null}]}')
    assert allowed(backend, m) == set(EOS)
    tag = TaggedJSON("[TOOL_CALLS][", (JSONTag('{"name": "f", "arguments": ', {"type": "object", "properties": {
        "x": {"type": "integer"}}, "required": ["x"]}, "}"),), ", ", "]")
    so = StructuredOutput.tagged(tag)
    m = walk(backend, tokenizer, so, '[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}, {"name": "f", "arguments": {"x": 2}}]')
    assert allowed(backend, m) == set(EOS)


@pytest.mark.parametrize("so,words", [
    (StructuredOutput("json", '{"type": "foo"}'), "invalid JSON schema"),
    (StructuredOutput("json", '{"type": "object", "properties": {"a": {"$ref": "#/nope"}}}'), "invalid JSON schema"),
    (StructuredOutput.regex("(ab"), "invalid regex"),
    (StructuredOutput.grammar("root ::= foo"), "invalid grammar"),
    (StructuredOutput.grammar('root ::= "a'), "invalid grammar"),
])
def test_check_refuses_what_cannot_compile(so, words):
    cls = get_grammar_backend("xgrammar")
    with pytest.raises(InvalidRequestError) as e:
        cls.check(so)
    assert str(e.value).startswith(words) and e.value.param == "structured_output"
    assert "/project/cpp" not in str(e.value)  # no C++ source locations in a user's error


def test_check_accepts_every_kind():
    cls = get_grammar_backend("xgrammar")
    for so in (StructuredOutput.json_schema({"type": "array", "items": {"type": "number"}}), StructuredOutput.json_object(),
               StructuredOutput.regex(r"\d+"), StructuredOutput.grammar('root ::= "a" | "b"'),
               StructuredOutput.choice(["x"]), StructuredOutput.tagged(TaggedJSON("", (JSONTag("<c>", True, "</c>"),)))):
        cls.check(so)
