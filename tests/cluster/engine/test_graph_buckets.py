"""The graph-bucket rule (cluster/engine/graph_buckets.py): capture policies, the bucket a batch replays in,
and its padding. That the runner and the router's placement both use it: test_single_source_rules.py."""

import pytest

from cluster.engine.graph_buckets import bucket_for, bucket_sizes, padded_size, padding_fraction, padding_waste


def test_bucket_policies():
    v = bucket_sizes("vllm", 512)
    assert v[:5] == [1, 2, 4, 8, 16] and 248 in v and 256 in v and 272 in v and v[-1] == 512
    assert all(b - a == 8 for a, b in zip(v[3:], v[4:]) if b <= 256)
    assert bucket_sizes("vllm", 100)[-2:] == [96, 100]  # capped, and max_num_seqs itself is a bucket
    assert bucket_sizes("pow2", 64) == [1, 2, 4, 8, 16, 32, 64]
    assert bucket_sizes("pow2", 48) == [1, 2, 4, 8, 16, 32, 48]
    assert bucket_sizes((4, 1, 300), 256) == [1, 4]
    assert bucket_sizes((300,), 256) == [256]  # none fits: the batch limit itself
    with pytest.raises(ValueError):
        bucket_sizes("nope", 8)
    with pytest.raises(ValueError):
        bucket_sizes((0, 4), 8)


def test_the_bucket_of_a_batch():
    assert bucket_for([1, 2, 4, 8], 3) == 4 and bucket_for([1, 2, 4, 8], 4) == 4
    assert bucket_for([1, 2, 4, 8], 9) is None and bucket_for([], 1) is None
    assert padded_size([1, 2, 4, 8], 3) == 4 and padded_size([1, 2, 4, 8], 9) == 9  # eager: unpadded
    assert padding_fraction((3, 5), 4) == pytest.approx(0.2) and padding_fraction((4,), 4) == 0.0
    assert padding_fraction((3, 5), 6) == 0.0  # beyond the largest bucket: eager, no padding
    assert padding_fraction((3, 5), 0) == 0.0 and padding_fraction((), 3) == 0.0


def test_padding_waste_of_the_default_policy_is_under_4_percent():
    mix = list(range(1, 257))
    assert padding_waste(bucket_sizes("vllm", 256), mix) <= 0.04
    assert padding_waste(bucket_sizes("pow2", 256), mix) > 0.2
    assert padding_waste([1, 2, 3], [5, 6]) == 0.0  # above the largest bucket: eager, unpadded
    assert padding_waste([4], iter([1, 3])) == pytest.approx(0.5)  # any iterable of batch sizes
    assert padding_waste([4], []) == 0.0


def test_the_features_variant_is_captured_at_a_coarser_subset():
    from cluster.engine.graph_buckets import feature_bucket_sizes

    plain = bucket_sizes("vllm", 256)
    f = feature_bucket_sizes(plain)
    assert f == [1, 2, 4, 8, 16, 32, 64, 96, 128, 160, 192, 224, 256]
    assert set(f) <= set(plain) and f[-1] == plain[-1]  # eager above the same size as the plain step
    assert len(f) <= len(plain) // 2 and padding_waste(f, range(1, 257)) <= 0.10
    assert feature_bucket_sizes([3, 5, 7]) == [7] and feature_bucket_sizes([1, 24, 48]) == [1, 48]
    for n in range(1, 257):  # a features batch never pads below the plain rule
        assert padded_size(f, n) >= padded_size(plain, n)
