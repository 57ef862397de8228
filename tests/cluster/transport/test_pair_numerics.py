"""A prefill and a decode worker whose KV is not interchangeable (cache dtype, or the numerics it was
computed with: activation dtype, FP8 weights, FP8 cache) are refused when their pair forms, with an
error naming both; an FP8 cache travels as its uint8 view (gloo and NCCL move bytes)."""

import pytest
import torch

from cluster.kv.kv_cache import kv_numerics_tag
from cluster.transport.factory import TransportSpec, create_transport
from cluster.transport.plan import KVNumerics, KVNumericsMismatch, check_pair_numerics

BF16 = KVNumerics("bfloat16", kv_numerics_tag(torch.bfloat16, "none", torch.bfloat16))
FP8_KV = KVNumerics("float8_e4m3fn", kv_numerics_tag(torch.bfloat16, "none", torch.float8_e4m3fn))
FP8_W = KVNumerics("bfloat16", kv_numerics_tag(torch.bfloat16, "fp8-w8a16-channel", torch.bfloat16))


def test_check_pair_numerics():
    check_pair_numerics("p", BF16, "d", BF16)
    check_pair_numerics("p", None, "d", FP8_KV)  # a side that does not say is not checked
    with pytest.raises(KVNumericsMismatch, match=r"KV cache dtype mismatch: prefill worker p stores bfloat16, "
                                                 r"decode worker d float8_e4m3fn; .*--kv-cache-dtype"):
        check_pair_numerics("p", BF16, "d", FP8_KV)
    with pytest.raises(KVNumericsMismatch, match=r"KV numerics mismatch: .*--quantization"):
        check_pair_numerics("p", FP8_W, "d", BF16)
    assert KVNumerics.from_dict(FP8_KV.as_dict()) == FP8_KV and KVNumerics.from_dict(None) is None


def _cache(dtype):
    return torch.zeros((2, 2, 8, 4, 2, 8), dtype=dtype)


@pytest.mark.parametrize("ns,prefill,decode,ok", [
    ("same-bf16", BF16, BF16, True), ("same-fp8", FP8_KV, FP8_KV, True),
    ("dtype", BF16, FP8_KV, False), ("weights", FP8_W, BF16, False)])
def test_pair_formation_refuses_a_numerics_mismatch(ns, prefill, decode, ok):
    spec = TransportSpec("local", namespace=f"numerics-{ns}", heartbeat_s=0.05, transfer_timeout_s=5.0)
    dtype = lambda n: torch.float8_e4m3fn if n.kv_dtype.startswith("float8") else torch.bfloat16  # noqa: E731
    d = create_transport(spec, _cache(dtype(decode)), "d", "decode", decode)
    p = create_transport(spec, _cache(dtype(prefill)), "p", "prefill", prefill)
    try:
        if ok:
            assert set(p.connect(["d"])) == {"d"}
            if prefill.kv_dtype.startswith("float8"):
                assert p.kv_cache.dtype == torch.uint8 and d.kv_cache.dtype == torch.uint8  # bytes on the wire
        else:
            with pytest.raises(KVNumericsMismatch, match="prefill worker p .* decode worker d"):
                p.connect(["d"])
    finally:
        p.close()
        d.close()


def test_the_uint8_view_shares_the_cache():
    cache = _cache(torch.float8_e4m3fn)
    spec = TransportSpec("local", namespace="numerics-view", heartbeat_s=0.05)
    t = create_transport(spec, cache, "d", "decode")
    try:
        cache[0, 0, 1] = 1.5
        assert t.kv_cache.data_ptr() == cache.data_ptr()
        assert torch.equal(t.kv_cache[0, 0, 1], cache[0, 0, 1].view(torch.uint8))
        assert t.numerics == KVNumerics("float8_e4m3fn", "torch.float8_e4m3fn")
    finally:
        t.close()
