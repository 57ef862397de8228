import pytest

from cluster.text.detokenizer import IncrementalDetokenizer
from cluster.text.tokenizer import load_tokenizer


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


@pytest.mark.parametrize("use_decode_stream", [True, False])
def test_special_tokens_are_text_only_when_kept(tokenizer, use_decode_stream):
    """skip_special_tokens=False (a tool-call parser reading a special opening tag): their text is
    output, inside the text around them; by default they give none."""
    prompt = tokenizer("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n").input_ids
    out = (tokenizer(" ok ", add_special_tokens=False).input_ids + [tokenizer.convert_tokens_to_ids("<|im_start|>")]
           + tokenizer(" é done", add_special_tokens=False).input_ids)
    kept = IncrementalDetokenizer(tokenizer, prompt, use_decode_stream=use_decode_stream, skip_special_tokens=False)
    assert "".join(_feed(kept, out)) == tokenizer.decode(out, skip_special_tokens=False) == " ok <|im_start|> é done"
    skipped = IncrementalDetokenizer(tokenizer, prompt, use_decode_stream=use_decode_stream)
    assert "".join(_feed(skipped, out)) == tokenizer.decode(out, skip_special_tokens=True) == " ok  é done"


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


def _pieces(tokenizer, prompt, ids, stop=(), **kw):
    det = IncrementalDetokenizer(tokenizer, prompt, stop, **kw)
    out = []
    for t in ids:
        det.add(t)
        out.append(det.take_new_text())
        if det.stopped:
            break
    out.append(det.take_new_text(final=True))
    return det, out


@pytest.mark.parametrize("stop", [(), ("is deep",), ("漢", "zebra"), ("é ü",), ("256 and",)])
def test_decode_stream_equals_the_python_offsets_decoder(tokenizer, stop):
    """The Rust DecodeStream path gives, piece by piece, exactly the text of the Python reference
    (vLLM's prefix/read offsets over the tokenizer's decode): multi-byte UTF-8 split over tokens,
    byte-fallback tokens, stop strings and their hold-back included."""
    import random

    texts = [" the sea is wide, the sea is deep", " Numbers: 128, 256 and é ü 漢字! ok", " abcdefgh ijk"]
    lone = [i for i in range(5, len(tokenizer)) if tokenizer.decode([i]) == "\ufffd"]
    rng = random.Random(0)
    cases = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    cases += [[rng.randrange(3, len(tokenizer)) for _ in range(60)] for _ in range(20)]  # any ids at all
    cases += [rng.sample(lone, 3) + cases[1] + lone[:2] for _ in range(3)]  # bytes that never complete
    prompt = tokenizer("The quick brown", add_special_tokens=True).input_ids
    used_stream = False
    for ids in cases:
        fast, a = _pieces(tokenizer, prompt, ids, stop)
        ref, b = _pieces(tokenizer, prompt, ids, stop, use_decode_stream=False)
        used_stream |= fast.uses_decode_stream
        assert a == b and fast.stopped == ref.stopped, ids
    assert used_stream


def test_resumed_detokenizer_continues_the_text_exactly(tokenizer):
    """After a migration the new worker's detokenizer gets prompt + the tokens already generated and
    how many characters the client has: what it hands out continues the text without gap or repeat."""
    prompt = tokenizer("Once upon", add_special_tokens=True).input_ids
    out = tokenizer(" a time 漢字 there was é ü a ship, the sea is deep and wide", add_special_tokens=False).input_ids
    full = "".join(_pieces(tokenizer, prompt, out, ("is deep",))[1])
    for cut in range(1, len(out) - 1):
        first = IncrementalDetokenizer(tokenizer, prompt, ("is deep",))
        got = ""
        for t in out[:cut]:
            first.add(t)
            got += first.take_new_text()
        rest = IncrementalDetokenizer(tokenizer, prompt + out[:cut], ("is deep",), resumed_tokens=cut,
                                      resumed_chars=len(got))
        for t in out[cut:]:
            rest.add(t)
            got += rest.take_new_text()
            if rest.stopped:
                break
        got += rest.take_new_text(final=True)
        assert got == full, cut


@pytest.mark.parametrize("use_decode_stream", [True, False])
def test_stop_string_of_replacement_characters_matches_held_bytes(tokenizer, use_decode_stream):
    """Bytes that never complete a character are held back (more could follow); a stop string made of
    U+FFFD still matches them at the token that completes it, not only when the sequence ends."""
    lone = [i for i in range(5, len(tokenizer)) if tokenizer.decode([i]) == "\ufffd"][:1] * 4
    ids = tokenizer(" the sea", add_special_tokens=False).input_ids + lone
    for stop in (("\ufffd",), ("\ufffd\ufffd",), ("sea\ufffd",)):
        det = IncrementalDetokenizer(tokenizer, [0], stop, use_decode_stream=use_decode_stream)
        fed = 0
        for t in ids:
            det.add(t)
            fed += 1
            if det.stopped:
                break
        assert det.stopped, stop
        assert fed == len(ids) - len(lone) + stop[0].count("\ufffd")  # at the token completing the match
        assert "\ufffd" not in det.take_new_text(final=True)


def test_engine_stops_on_a_replacement_character_stop_string(reference_engine):
    """A U+FFFD stop string ends a request with finish_reason "stop" at the token that completes it (the
    engine and the decode worker's publisher share the detokenizer rule), also when the held bytes are
    the last tokens max_tokens allows."""
    from cluster.sampling.sampling_params import SamplingParams

    prompt, found = "Once upon a time", 0
    for seed in range(40):
        free = reference_engine.generate([prompt], SamplingParams(max_tokens=32, temperature=1.0, seed=seed))[0]
        if "\ufffd" not in free.text:
            continue
        found += 1
        cut = free.text.index("\ufffd")
        k = next(n for n in range(1, 33) if "\ufffd" in reference_engine.tokenizer.decode(list(free.token_ids[:n])))
        for max_tokens in (32, k):  # k: the replacement character comes with the last allowed token
            out = reference_engine.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=1.0,
                                                                     seed=seed, stop=("\ufffd",)))[0]
            assert (out.finish_reason, out.text, len(out.token_ids)) == ("stop", free.text[:cut], k), (seed, max_tokens)
    assert found >= 2


# -- a migration's resume at any point (issue 29): a hypothesis property ---------------------------

def _byte_tokens(tokenizer) -> dict[str, list[int]]:
    """The demo tokenizer's single-byte tokens by UTF-8 role: ASCII, continuation, 2/3/4-byte leads."""
    from tokenizers.pre_tokenizers import ByteLevel

    byte_of = {ch: b for b, ch in enumerate(sorted(ByteLevel.alphabet(), key=lambda c: _BYTE_ORDER(c)))}
    roles: dict[str, list[int]] = {"ascii": [], "cont": [], "lead2": [], "lead3": [], "lead4": []}
    for piece, tid in tokenizer.get_vocab().items():
        if len(piece) != 1 or piece not in byte_of:
            continue
        b = byte_of[piece]
        role = ("ascii" if b < 0x80 else "cont" if b < 0xC0 else "lead2" if b < 0xE0 else "lead3" if b < 0xF0
                else "lead4" if b < 0xF5 else None)
        if role:
            roles[role].append(tid)
    return roles


def _BYTE_ORDER(ch: str) -> int:
    """GPT-2's byte -> printable character map, inverted (what ByteLevel's alphabet spells)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip((chr(c) for c in cs), bs))[ch]


def _run(tokenizer, prompt, ids, stop, cuts, use_decode_stream):
    """The client's text of a stream of `ids` whose worker fails after each token count in `cuts` (the
    publisher's error finish: take_new_text() without a flush) and resumes on a new detokenizer from
    prompt + the tokens so far and the characters the client has; stops as the worker would."""
    got, done, start = "", 0, 0
    cuts = sorted(set(c for c in cuts if 0 < c < len(ids))) + [len(ids)]
    for end in cuts:
        det = IncrementalDetokenizer(tokenizer, list(prompt) + list(ids[:start]), stop, resumed_tokens=start,
                                     resumed_chars=len(got), use_decode_stream=use_decode_stream)
        for t in ids[start:end]:
            det.add(t)
            done += 1
            got += det.take_new_text()
            if det.stopped:
                return got + det.take_new_text(final=True), done
        last = end == len(ids)
        got += det.take_new_text(final=last)  # a failure flushes nothing (token_publisher)
        start = end
    return got, done


def test_resume_at_random_points_never_diverges(tokenizer):
    """A migrated stream equals the unfailed one at every cut, any number of cuts: token sequences
    made of valid multi-byte characters split over byte tokens, lone and truncated sequences, ASCII
    and word tokens; stop strings taken from the text itself (multi-byte and U+FFFD ones included) or
    never matching; both decoders."""
    from hypothesis import HealthCheck, given, settings, strategies as st

    roles = _byte_tokens(tokenizer)
    assert all(len(v) >= 10 for k, v in roles.items() if k != "lead4") and roles["lead4"], roles
    words = tokenizer(" the sea is deep, 128 and", add_special_tokens=False).input_ids
    prompt = tokenizer("Once upon", add_special_tokens=True).input_ids

    def char(n):  # a valid n-byte character as its n byte tokens, or a truncated one
        lead = {2: "lead2", 3: "lead3", 4: "lead4"}[n]
        return st.tuples(st.sampled_from(roles[lead]), st.lists(st.sampled_from(roles["cont"]), min_size=n - 1,
                                                                  max_size=n - 1), st.integers(1, n)).map(
            lambda x: [x[0], *x[1]][: x[2] if x[2] < n else n])

    piece = st.one_of(char(2), char(3), char(4), st.sampled_from(roles["cont"]).map(lambda t: [t]),
                      st.sampled_from(roles["ascii"] + words).map(lambda t: [t]))
    tokens = st.lists(piece, min_size=1, max_size=24).map(lambda ps: [t for p in ps for t in p])

    @settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(ids=tokens, data=st.data(), use_stream=st.booleans())
    def check(ids, data, use_stream):
        full = tokenizer.decode(ids)
        stops = ()
        kind = data.draw(st.sampled_from(["none", "text", "fffd", "never"]))
        if kind == "text" and len(full) > 1:
            i = data.draw(st.integers(0, len(full) - 1))
            stops = (full[i : i + data.draw(st.integers(1, 4))],)
        elif kind == "fffd":
            stops = ("\ufffd" * data.draw(st.integers(1, 3)),)
        elif kind == "never":
            stops = ("\x00never\x00",)
        ref, ref_done = _run(tokenizer, prompt, ids, stops, [], use_stream)
        cuts = data.draw(st.lists(st.integers(1, max(1, len(ids) - 1)), max_size=4))
        got, done = _run(tokenizer, prompt, ids, stops, cuts, use_stream)
        assert (got, done) == (ref, ref_done), (ids, stops, cuts)

    check()


@pytest.mark.parametrize("use_decode_stream", [True, False])
def test_long_output_is_appended_in_linear_time_and_stops_exactly(tokenizer, use_decode_stream):
    """A long output (many times the compaction chunk) comes out whole and stops at a stop string far
    into it; the detokenizer's working tail stays bounded (no copy of the whole text per token)."""
    from cluster.text.detokenizer import _COMPACT_CHARS

    words = tokenizer(" lorem ipsum dolor sit amet, é 漢字 consectetur", add_special_tokens=False).input_ids
    out = words * 800 + tokenizer(" STOP here", add_special_tokens=False).input_ids + words * 10
    full = tokenizer.decode(out)
    det = IncrementalDetokenizer(tokenizer, tokenizer("x").input_ids, stop=("STOP",),
                                 use_decode_stream=use_decode_stream)
    pieces, longest_tail = [], 0
    for t in out:
        det.add(t)
        pieces.append(det.take_new_text())
        longest_tail = max(longest_tail, len(det._tail))
        if det.stopped:
            break
    pieces.append(det.take_new_text(final=True))
    assert "".join(pieces) == det.text == full[: full.index("STOP")]
    assert len(det.text) > 8 * _COMPACT_CHARS and longest_tail < 2 * _COMPACT_CHARS
