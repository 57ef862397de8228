"""PassLauncher: the device side of a prefill pass. It runs the packed forward (one graph replay when
the pass fits a bucket: cluster/engine/prefill_graph_runner.py; eagerly otherwise), queues the first
tokens' draw right behind it, launches the rest of the prompts' KV, and marks the pass on the device
timer, all without waiting for the device: the pass comes back as a LaunchedPass, whose draw the
worker reads later (PrefillWorker._complete). The worker schedules passes and keeps their books.

During the forward a hook on every decoder layer tells the pass's shipment that the layer is done
(prefill_worker/layer_hooks.py), so a long prompt's layer i is on the wire while layer i+1 computes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from cluster.engine.model_runner import ModelRunner, PrefillChunk
from cluster.engine.prefill_graph_runner import PrefillGraphRunner
from cluster.transport.base import Shipment
from cluster.worker.pass_rate import DevicePassTimer, PassRateMeter
from prefill_worker.launched_pass import LaunchedPass
from prefill_worker.layer_hooks import hook_layers
from prefill_worker.prefill_job import PrefillJob, draw_first_tokens


class PassLauncher:
    def __init__(self, runner: ModelRunner, graphs: PrefillGraphRunner | None, model: torch.nn.Module,
                 num_layers: int, device: torch.device):
        self.runner, self.graphs = runner, graphs
        self.timer = DevicePassTimer(PassRateMeter(), device)  # the measured cost of a pass (the worker's stats)
        runner.prefill_graphs = graphs
        self.shipment: Shipment | None = None  # the forward in progress ships these transfers
        self.launched = self.overlapped = 0  # passes; those launched while another was on the device
        hook_layers(model, num_layers, device.type == "cuda", lambda: self.shipment)

    def replays_graph(self, chunks: Sequence[PrefillChunk], wants: Sequence[object]) -> bool:
        """Whether the pass is one graph replay (no prompt logprobs: those need every position's logits)."""
        return not any(wants) and self.graphs is not None and self.graphs.bucket_for(chunks) is not None

    def launch(self, chunks: list[tuple[PrefillJob, PrefillChunk]], rows: list[int], shipment: Shipment | None,
               wants: list[tuple[Sequence[int], int] | None], behind: bool = False) -> LaunchedPass:
        """The forward over `chunks` and the draw of rows[i]'s first token for each prompt it completes;
        `behind`: a pass launched earlier is still unread. Raises what the forward raised."""
        self.launched += 1
        self.overlapped += behind
        finishing = [chunks[i][0] for i in rows]
        tokens = sum(len(c.token_ids) for _, c in chunks)
        pass_at, t0 = time.time(), time.perf_counter()
        for job, _ in chunks:
            job.forward_start_at = job.forward_start_at or pass_at
        self.shipment = shipment
        try:
            start = self.timer.start()
            # Prompt logprobs need every position's logits (such a request skipped the prefix cache:
            # SamplingParams.reads_prefix_cache), gathered chunk by chunk.
            logits, prompt_lps = self.runner.prefill_with_prompt_logprobs([c for _, c in chunks], wants)
        finally:
            self.shipment = None
        for (job, _), lps in zip(chunks, prompt_lps):
            if lps is not None:
                job.prompt_logprobs = (job.prompt_logprobs or []) + lps
        forward_done_at, host_s = time.time(), time.perf_counter() - t0
        end = self.timer.stop(start, tokens)
        # NOTE: the draw goes on the stream right behind the pass, with no host sync (its uploads are pinned):
        # the host work after it (the rest of the KV's launches, the worker's books, the next pass's launch
        # with overlap on) runs while the device computes.
        drawn = draw_first_tokens(logits, rows, finishing) if rows else None
        if shipment is not None:
            shipment.kv_done()  # every layer not shipped yet goes now (on the pair's stream)
        return LaunchedPass(chunks, finishing, shipment, drawn, start, end, tokens, forward_done_at, host_s)

    def device_seconds(self, p: LaunchedPass) -> float:
        """The pass's device time. NOTE: waits for its end: call it after reading its draw."""
        return self.timer.seconds(p.timer_start, p.timer_end)
