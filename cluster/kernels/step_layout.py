"""The packed per-step input buffer of a decode step: what the graph runner copies to the device once
per step, and what `decode_inputs` unpacks inside the CUDA graph."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DecodeStepLayout:
    """Offsets (in int32 words) of the fields of a step padded to `rows` rows in the packed buffer.

    seeds are int64 (two words per row, first so that they are 8-byte aligned); temperature, top_p
    and log_min_p are float32 bit patterns; `slot` is the row's sequence's sampling-state slot (-1:
    none, cluster.sampling.sampling_state); `grammar` the row of the step's grammar bitmask buffer its mask
    is in (-1: unconstrained, cluster.kernels.token_bitmask); the block tables come last, `width`
    words per row."""

    rows: int

    @property
    def seeds(self) -> int:
        return 0

    @property
    def temperature(self) -> int:
        return 2 * self.rows

    @property
    def top_p(self) -> int:
        return 3 * self.rows

    @property
    def top_k(self) -> int:
        return 4 * self.rows

    @property
    def log_min_p(self) -> int:
        return 5 * self.rows

    @property
    def slot(self) -> int:
        return 6 * self.rows

    @property
    def grammar(self) -> int:
        return 7 * self.rows

    @property
    def host_ids(self) -> int:
        return 8 * self.rows

    @property
    def prev_row(self) -> int:
        return 9 * self.rows

    @property
    def positions(self) -> int:
        return 10 * self.rows

    @property
    def width(self) -> int:
        return 11 * self.rows

    @property
    def tables(self) -> int:
        return 11 * self.rows + 1

    def words(self, width: int) -> int:
        return self.tables + self.rows * width
