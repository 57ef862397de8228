import pytest

from cluster.detokenizer import IncrementalDetokenizer
from cluster.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir):
    return load_tokenizer(demo_model_dir)


def _feed(det, ids, final=True):
    pieces = []
    for t in ids:
        det.add(t)
        pieces.append(det.take_new_text())
        if det.stopped:
            break
    pieces.append(det.take_new_text(final=final))
    return pieces


def test_incremental_text_equals_full_decode(tokenizer):
    prompt = tokenizer("The quick brown").input_ids
    out = tokenizer(" fox jumps over the lazy dog. Numbers: 128, 256 and é ü 漢字!", add_special_tokens=False).input_ids
    det = IncrementalDetokenizer(tokenizer, prompt)
    pieces = _feed(det, out)
    assert "".join(pieces) == tokenizer.decode(out)
    assert not any("\ufffd" in p for p in pieces)  # multi-byte characters never split


def test_stop_string_truncates_and_is_never_emitted(tokenizer):
    out = tokenizer(" the sea is wide, the sea is deep", add_special_tokens=False).input_ids
    det = IncrementalDetokenizer(tokenizer, [0], stop=("is deep", "zebra"))
    pieces = _feed(det, out)
    assert det.stopped
    assert "".join(pieces) == " the sea is wide, the sea "
    assert all("is deep" not in p for p in pieces)


def test_stop_string_spanning_tokens(tokenizer):
    out = tokenizer(" abcdefgh", add_special_tokens=False).input_ids
    assert len(out) > 2
    det = IncrementalDetokenizer(tokenizer, [0], stop=("cdef",))
    assert "".join(_feed(det, out)) == " ab"


def test_held_back_bytes_are_emitted_at_the_end(tokenizer):
    # Token ids of lone UTF-8 continuation bytes: held back while more could complete a character,
    # then, when the sequence ends, emitted as the tokenizer decodes them (replacement characters).
    lone = [i for i in range(5, len(tokenizer)) if tokenizer.decode([i]) == "\ufffd"][:1] * 3
    assert lone, "the demo tokenizer has byte-fallback tokens"
    det = IncrementalDetokenizer(tokenizer, [0])
    pieces = _feed(det, lone, final=False)
    assert "".join(pieces) == ""
    assert det.take_new_text(final=True) == tokenizer.decode(lone)
