"""WorkerConfig checks what no pydantic model checked before it (a worker built from code, not the CLI)."""

import pytest

from cluster.worker.worker_config import WorkerConfig


@pytest.mark.parametrize("overlap", ["auto", "on", "off"])
def test_prefill_overlap_takes_its_three_values(overlap):
    assert WorkerConfig(model_dir="/m", prefill_overlap=overlap).prefill_overlap == overlap


def test_an_unknown_prefill_overlap_is_refused():
    with pytest.raises(ValueError, match="prefill_overlap"):
        WorkerConfig(model_dir="/m", prefill_overlap="yes")
