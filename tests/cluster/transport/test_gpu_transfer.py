"""GPU: same-GPU (CUDA IPC) and host-staged gloo transfers between two processes on one device."""

import pytest

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("path", ["same_gpu", "gloo"])
def test_two_process_transfer_is_exact_and_reports_bandwidth(path):
    from loadtest.bench_transfer import run_path

    res = run_path(path, [256, 2048])
    assert res["rows"], res
    for r in res["rows"]:
        print(f"{path} {r['prompt_tokens']} tokens: {r['GBps']:.1f} GB/s (D2D copy {r['copy_GBps']:.1f} GB/s)")
        assert r["exact"], r
        assert r["GBps"] > 0 and r["copy_GBps"] > 0
