"""The P:D planner on a simulated load, on CPU: a deterministic simulator of Poisson arrivals (seeded),
workers with true rates that are measured with noise, and role switches that take time; the planner
must converge to the split that the true rates call for, move one worker at a time, respect its dwell
time, and not flap on a load that sits near the boundary between two splits."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from cluster.wire.messages import WorkerStats
from cluster.worker.pass_rate import PassRate
from router.stats.arrival_stats import ArrivalStats
from router.placement.pd_planner import (PDPlanner, PlannerConfig, PlannerInputs, best_split, decode_capacity, observe,
                               utilization)
from router.placement.placement import WorkerView

BLOCK = 16
KV_BLOCKS = 12_500  # 200k tokens per decode worker
MAX_SEQS = 128
PREFILL_RATE = PassRate(0.002, 1 / 40_000, 1000)  # an 8B model on an H200, roughly
STEP_RATE = PassRate(0.007, 5e-5, 1000)


@dataclass
class Phase:
    seconds: float
    rate: float
    prompt: tuple[int, ...]  # lengths drawn uniformly
    output: tuple[int, ...]


class Simulation:
    """Seconds tick by; the planner looks every `interval`; a switch takes `switch_s` (the worker
    serves neither role meanwhile); measured rates carry +-`noise` relative error."""

    def __init__(self, n_prefill: int, n_decode: int, cfg: PlannerConfig, seed: int = 0, interval: float = 10.0,
                 switch_s: float = 20.0, noise: float = 0.05):
        self.split = [n_prefill, n_decode]
        self.planner = PDPlanner(cfg)
        self.rng = random.Random(seed)
        self.now = 0.0
        self.arrivals = ArrivalStats(window_s=60.0, clock=lambda: self.now)
        self.interval, self.switch_s, self.noise = interval, switch_s, noise
        self.pending: tuple[float, str, str] | None = None  # (done at, from role, to role)
        self.switches: list[tuple[float, str, str, tuple[int, int]]] = []

    def _noisy(self, rate: PassRate) -> PassRate:
        f = 1.0 + self.rng.uniform(-self.noise, self.noise)
        return PassRate(rate.overhead_s * f, rate.unit_s * f, rate.samples)

    def _views(self) -> tuple[list[WorkerView], list[WorkerView]]:
        def view(role, i):
            wid = f"{role}-{i}"
            st = WorkerStats(wid, role, True, KV_BLOCKS, KV_BLOCKS, max_num_seqs=MAX_SEQS,
                             prefill_rate=self._noisy(PREFILL_RATE),
                             decode_rate=self._noisy(STEP_RATE) if role == "decode" else None)
            v = WorkerView(wid, role, st)
            v.healthy = True
            return v
        return [view("prefill", i) for i in range(self.split[0])], [view("decode", i) for i in range(self.split[1])]

    def run(self, phase: Phase) -> None:
        end = self.now + phase.seconds
        while self.now < end:
            self.now += 1.0
            # Poisson arrivals in this second (exponential gaps), lengths from the phase's mix.
            t = self.now - 1.0 + self.rng.expovariate(phase.rate)
            while t < self.now:
                self.arrivals.record_arrival(self.rng.choice(phase.prompt), self.rng.choice(phase.output), t)
                self.arrivals.record_finish(self.rng.choice(phase.output), t)
                t += self.rng.expovariate(phase.rate)
            if self.pending is not None and self.now >= self.pending[0]:
                _, _, to_role = self.pending
                self.split[0 if to_role == "prefill" else 1] += 1
                self.pending = None
                self.planner.changed(self.now, tuple(self.split))
            if self.pending is None and self.now % self.interval == 0:
                prefill, decode = self._views()
                inputs = observe(prefill, decode, self.arrivals.mix(), BLOCK, self.planner.cfg.tpot_target_s)
                change = self.planner.decide(self.now, inputs)
                if change is not None:
                    self.split[0 if change.from_role == "prefill" else 1] -= 1
                    self.pending = (self.now + self.switch_s, change.from_role, change.to_role)
                    self.switches.append((self.now, change.from_role, change.to_role, change.target))

    def truth(self, phase: Phase) -> tuple[int, int]:
        """The split the true (noise-free) rates and the phase's true mix call for."""
        mean_p, mean_o = sum(phase.prompt) / len(phase.prompt), sum(phase.output) / len(phase.output)
        r_d = decode_capacity(STEP_RATE, MAX_SEQS, KV_BLOCKS * BLOCK, mean_p + mean_o, self.planner.cfg.tpot_target_s)
        total = sum(self.split) + (1 if self.pending else 0)
        inputs = PlannerInputs(phase.rate, mean_p, mean_o, PREFILL_RATE.units_per_s, r_d, 1, total - 1)
        return best_split(inputs, self.planner.cfg)


CFG = PlannerConfig(min_prefill=1, min_decode=1, hysteresis=0.25, min_utilization=0.3, confirmations=3,
                    min_dwell_s=60.0)
PROMPT_HEAVY = Phase(600, rate=20, prompt=(1024, 2048, 3072), output=(32, 64))
DECODE_HEAVY = Phase(900, rate=10, prompt=(64, 128), output=(512, 1024, 1536))


def test_capacity_and_utilization_math():
    # 128 rows fit (KV 200k tokens / 1100 per request = 181; TPOT 50 ms allows 860): 128 per 13.4 ms.
    assert decode_capacity(STEP_RATE, 128, 200_000, 1100, 0.05) == pytest.approx(128 / STEP_RATE.seconds(128))
    # KV-bound: 40k tokens / 2000 per request = 20 rows.
    assert decode_capacity(STEP_RATE, 128, 40_000, 2000, 0.05) == pytest.approx(20 / STEP_RATE.seconds(20))
    # TPOT-bound: a 10 ms target leaves (10 - 7) / 0.05 = 60 rows.
    assert decode_capacity(STEP_RATE, 128, 10**7, 100, 0.010) == pytest.approx(60 / 0.010)
    inputs = PlannerInputs(20, 2000, 50, 40_000, 8_000, 2, 2)
    assert utilization(inputs, 2, 2) == pytest.approx(max(20 * 2000 / 40_000 / 2, 20 * 50 / 8_000 / 2))
    assert utilization(inputs, 0, 4) == pytest.approx((1.0 + 0.125) / 4)  # everything on decode workers
    assert utilization(inputs, 4, 0) == float("inf")
    assert best_split(inputs, CFG) == (3, 1)


def test_converges_to_the_right_split_one_worker_at_a_time_and_holds():
    sim = Simulation(2, 2, CFG)
    sim.run(PROMPT_HEAVY)
    assert sim.truth(PROMPT_HEAVY) == (3, 1)
    assert tuple(sim.split) == (3, 1) and sim.pending is None
    assert [s[1:3] for s in sim.switches] == [("decode", "prefill")]
    sim.run(DECODE_HEAVY)
    assert sim.truth(DECODE_HEAVY) == (1, 3)
    assert tuple(sim.split) == (1, 3) and sim.pending is None
    moves = [s[1:3] for s in sim.switches[1:]]
    assert moves == [("prefill", "decode"), ("prefill", "decode")]  # two steps, never back
    # Dwell: no switch started less than min_dwell_s after the previous one finished.
    finished = [t for t, _ in sim.planner.history]
    starts = [t for t, *_ in sim.switches]
    assert all(b - a >= CFG.min_dwell_s for a, b in zip(finished, starts[1:]))
    # And it stays put while the load does.
    before = len(sim.switches)
    sim.run(Phase(600, DECODE_HEAVY.rate, DECODE_HEAVY.prompt, DECODE_HEAVY.output))
    assert len(sim.switches) == before


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_does_not_flap_near_a_boundary(seed):
    # (1,3) is better than the current (2,2), but by ~9 %, under the 25 % hysteresis, and the noisy
    # measurements (+-8 %) move the margin from look to look: the planner must hold still.
    boundary = Phase(1800, rate=10, prompt=(2200, 2440), output=(700, 900))
    sim = Simulation(2, 2, CFG, seed=seed, noise=0.08)
    r_d = decode_capacity(STEP_RATE, MAX_SEQS, KV_BLOCKS * BLOCK, 2320 + 800, 0.05)
    truth_inputs = PlannerInputs(10, 2320, 800, PREFILL_RATE.units_per_s, r_d, 2, 2)
    u22, u13 = utilization(truth_inputs, 2, 2), utilization(truth_inputs, 1, 3)
    assert best_split(truth_inputs, CFG) == (1, 3) and 0 < 1 - u13 / u22 < 0.15
    sim.run(boundary)
    assert sim.switches == []


def test_an_idle_cluster_is_not_reshuffled():
    sim = Simulation(3, 1, CFG)
    sim.run(Phase(600, rate=0.5, prompt=(64,), output=(1024,)))  # decode-leaning but light
    assert sim.switches == [] and tuple(sim.split) == (3, 1)


def test_unmeasured_rates_mean_no_decision():
    planner = PDPlanner(PlannerConfig(confirmations=1, min_dwell_s=0))
    assert planner.decide(0.0, None) is None
    p = WorkerView("prefill-0", "prefill", WorkerStats("prefill-0", "prefill", True))  # no rate yet
    p.healthy = True
    d = WorkerView("decode-0", "decode", WorkerStats("decode-0", "decode", True, 10, 10, decode_rate=STEP_RATE))
    d.healthy = True
    arrivals = ArrivalStats()
    arrivals.record_arrival(100, 100)
    assert observe([p], [d], arrivals.mix(), BLOCK, 0.05) is None
