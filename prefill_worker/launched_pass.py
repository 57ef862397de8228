"""LaunchedPass: one packed prefill forward on the device, its first tokens' draw queued behind it and
not read yet: what PrefillWorker._launch hands to PrefillWorker._complete.

With overlap on (WorkerConfig.prefill_overlap), the loop launches the next short pass before it reads
this one's draw: the next pass's host work (scheduling, staging, the graph replay, its draw) runs while
this one is still on the device, and its kernels queue right behind this one's on the stream, so a
prompt that arrived just after a pass began does not wait for that pass's first tokens to leave.

HAZARD: two passes on the stream at once. What makes that safe: each host buffer a pass fills for the
device is either fresh per pass (the draw's pinned uploads and its pinned outputs: sampler.host_to_device,
SampledTokens; the caching host allocator keeps a block until its copy ran) or guarded by an event (the
graph runner's one staging buffer, rewritten only after the last pass's copy left it); the graph's static
logits are cloned on the stream before the next replay can overwrite them; a pass writes only its own
prompts' blocks, and the blocks of the pass ahead stay held until their transfer is over. Only a graph
replay launches behind another pass: an eager pass's inputs come from pageable memory (a sync), and its
host launches would hold back the pass ahead's first tokens. Checked on a GPU: test_pass_overlap_gpu.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cluster.engine.model_runner import PrefillChunk
    from cluster.sampling.sampler import SampledTokens
    from cluster.transport.base import Shipment
    from prefill_worker.prefill_job import PrefillJob


@dataclass(frozen=True)
class LaunchedPass:
    chunks: list[tuple["PrefillJob", "PrefillChunk"]]
    finishing: list["PrefillJob"]  # the prompts the pass completes, in the draw's row order
    shipment: "Shipment | None"  # their transfers, claimed before the forward (None: no reservation yet)
    drawn: "SampledTokens | None"  # their first tokens (None: the pass completes no prompt)
    timer_start: object  # DevicePassTimer marks around the forward
    timer_end: object
    tokens: int  # tokens computed in the pass
    forward_done_at: float  # time.time() when the forward's host work was done
    host_s: float  # the forward's host time
