"""The GPU tests' loopback process group stands in for TorchDistPayload._form: on CPU, that it
still takes what the real one takes (the GPU tests would fail first on a signature drift)."""

from __future__ import annotations

import pytest

from loopback_pg import install


def test_loopback_form_matches_the_transports(monkeypatch):
    from cluster.transport import torch_dist

    install(monkeypatch)
    assert torch_dist.TorchDistPayload._form.__name__ == "form"


def test_a_drifted_signature_is_caught(monkeypatch):
    from cluster.transport import torch_dist

    def _form(self, peer, link):
        pass

    monkeypatch.setattr(torch_dist.TorchDistPayload, "_form", _form)
    with pytest.raises(TypeError, match="no longer matches"):
        install(monkeypatch)
