"""hook_layers: ships a prompt's KV layer by layer while its forward runs (prefill_worker/prefill_worker.py).

A forward hook per decoder layer: layer i returned, so its K/V write is enqueued on the current
stream, and the shipment of the forward in progress (`current()`, None when the pass ships nothing)
is told so. Only the layer order matters, not what a layer computes inside; a model without `layers`
matching the cache gets no hooks, and its whole KV ships after the forward (Shipment.kv_done).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from cluster.transport.base import Shipment

log = logging.getLogger(__name__)


def hook_layers(model: torch.nn.Module, num_layers: int, cuda: bool, current: Callable[[], Shipment | None]) -> None:
    layers = getattr(model, "layers", None)
    if layers is None or len(layers) != num_layers:
        return

    def hook(i):
        def on_layer(module, args, output):
            sh = current()
            # NOTE: a graph capture (the prefill graph runner's, before serving) ships nothing.
            if sh is None or (cuda and torch.cuda.is_current_stream_capturing()):
                return
            try:
                sh.layer_done(i)
            except Exception:  # noqa: BLE001 - the transfer fails through its future; the forward goes on
                log.exception("shipping layer %d failed", i)
        return on_layer
    for i, layer in enumerate(layers):
        layer.register_forward_hook(hook(i))
