"""cluster.kv.request_limits on CPU: the served context length and the fit of a request."""

from __future__ import annotations

import pytest

from cluster.errors import InvalidRequestError
from cluster.kv.request_limits import check_request_fits, served_max_model_len


def test_served_max_model_len_is_clamped_to_the_model():
    assert served_max_model_len(None, 4096) == 4096  # none configured: the model's own
    assert served_max_model_len(1024, 4096) == 1024
    assert served_max_model_len(8192, 4096) == 4096  # never beyond what the model was trained for


def test_context_length_bound_is_inclusive():
    check_request_fits(1000, 24, 1024)
    with pytest.raises(InvalidRequestError) as e:
        check_request_fits(1000, 25, 1024)
    assert e.value.param == "max_tokens"
    assert str(e.value) == ("This model's maximum context length is 1024 tokens. However, you requested 1025 "
                            "tokens (1000 in the prompt, 25 for the completion). Please reduce the prompt or "
                            "max_tokens.")


def test_kv_pool_bound_counts_whole_blocks():
    check_request_fits(100, 28, 4096, block_size=16, kv_blocks=8)  # 128 tokens: exactly 8 blocks
    with pytest.raises(InvalidRequestError) as e:
        check_request_fits(100, 29, 4096, block_size=16, kv_blocks=8)  # a 9th block
    assert e.value.param == "max_tokens"
    assert str(e.value) == ("prompt (100 tokens) + max_tokens (29) does not fit in the KV cache of the KV pool "
                            "(128 tokens)")
    with pytest.raises(InvalidRequestError, match=r"^prompt \(129 tokens\) does not fit in the KV cache of p0"):
        check_request_fits(129, 0, 4096, block_size=16, kv_blocks=8, holder="p0")  # a prompt alone


def test_context_is_checked_before_the_pool_and_the_pool_needs_a_block_size():
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        check_request_fits(5000, 0, 4096, block_size=16, kv_blocks=1)
    with pytest.raises(ValueError, match="block_size"):
        check_request_fits(1, 1, 4096, kv_blocks=8)
