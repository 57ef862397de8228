"""cluster/text/tokenizer.py's encode_prompt for token ids: plain ints take the fast check, anything else
the per-id loop; both answer the same."""

from __future__ import annotations

import enum

import pytest

from cluster.errors import InvalidRequestError
from cluster.text.tokenizer import encode_prompt


class _Vocab:
    def __len__(self):
        return 500


class _Id(enum.IntEnum):
    A = 7


@pytest.mark.parametrize("ids", [[0], [499], [1, 2, 3] * 700, (5, 6), [True, 3], [_Id.A, 0]])
def test_ids_in_the_vocabulary_are_the_prompt(ids):
    out = encode_prompt(_Vocab(), ids)
    assert out == list(ids) and type(out) is list


@pytest.mark.parametrize("ids", [[], [500], [-1], [0, 500], [1, 2.0], [1, "2"], [1, None], [2**70], [-(2**70), 1]])
def test_others_are_refused(ids):
    with pytest.raises(InvalidRequestError) as e:
        encode_prompt(_Vocab(), ids)
    assert e.value.param == "prompt"
