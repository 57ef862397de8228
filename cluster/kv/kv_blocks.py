"""The null block and two KV-block rules, in one place (every user calls these; tests/cluster/test_single_source_rules.py):

- `blocks_for_tokens`: the blocks `num_tokens` tokens take, rounded up to whole blocks of `block_size`.
- `decode_held_tokens`: a decode worker holds a sequence's tokens plus one decode slot (the K/V of the
  token the next step computes), so a reservation of a new prompt is prompt + 1 tokens. The decode
  block manager allocates by it, and the router's admission, placement and release estimate by it.
"""

from __future__ import annotations

# Block 0 of every KV cache is never allocated: padded rows and unused block-table slots point at it, so
# a graph replay with fewer live rows writes its padding there. (Here and not in kv_cache.py, which
# needs torch: the block pool and the messages that carry its changes do not.)
NULL_BLOCK = 0


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Whole blocks of `block_size` tokens that hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


def decode_held_tokens(num_tokens: int) -> int:
    """The tokens a decode worker holds KV for, for a sequence of `num_tokens` tokens so far."""
    return num_tokens + 1


def decode_held_blocks(num_tokens: int, block_size: int) -> int:
    """The blocks a decode worker holds for a sequence of `num_tokens` tokens so far."""
    return blocks_for_tokens(decode_held_tokens(num_tokens), block_size)
