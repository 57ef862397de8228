"""The attention registry: every name resolves to its backend class, lazily, and nothing else does."""

import subprocess
import sys
from pathlib import Path

import pytest

from cluster.attention import BACKENDS, AttentionBackend, get_backend

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_every_name_resolves_to_a_backend_that_carries_it(name):
    cls = get_backend(name)
    assert issubclass(cls, AttentionBackend) and cls.name == name


def test_an_unknown_name_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"unknown attention backend 'flash'; available: \['torch', 'triton'\]"):
        get_backend("flash")


def test_backends_load_on_first_use_and_a_missing_dependency_fails_only_its_backend():
    code = (
        "import sys\n"
        "sys.modules['triton'] = None  # as if triton were not installed\n"
        "import cluster.attention as a\n"
        "assert not any(m in sys.modules for m in ('cluster.attention.torch_ref', 'cluster.attention.triton_decode'))\n"
        "assert a.get_backend('torch').name == 'torch'\n"
        "try:\n"
        "    a.get_backend('triton')\n"
        "except ValueError as e:\n"
        "    print('REFUSED', e)\n"
    )
    # Generous: the child imports torch (~10 s of CPU), minutes at the other test stream's nice 10 on a busy machine.
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "REFUSED attention backend 'triton' is unavailable" in r.stdout, r.stdout
