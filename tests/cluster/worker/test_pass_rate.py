"""PassRateMeter: the affine fit of pass cost that workers report and the router plans with."""

import pytest

from cluster.worker.pass_rate import DevicePassTimer, PassRateMeter


def test_fits_overhead_and_per_unit_cost():
    m = PassRateMeter()
    assert m.rate() is None
    for n in (16, 64, 256, 1024, 4096, 100, 700):
        m.add(n, 0.004 + n * 25e-6)  # 4 ms per pass + 40k tokens/s
    r = m.rate()
    assert r.overhead_s == pytest.approx(0.004, rel=1e-6) and r.unit_s == pytest.approx(25e-6, rel=1e-6)
    assert r.units_per_s == pytest.approx(40_000) and r.samples == 7
    assert r.seconds(2048) == pytest.approx(0.004 + 2048 * 25e-6)


def test_forgets_old_passes_when_the_worker_slows_down():
    m = PassRateMeter(half_life=8)
    for n in range(1, 41):
        m.add(n * 10, n * 10 * 1e-5)
    for n in range(1, 81):
        m.add(n * 10, n * 10 * 3e-5)  # three times slower now
    assert m.rate().unit_s == pytest.approx(3e-5, rel=0.02)


def test_same_size_passes_and_noise_give_a_proportional_fit():
    m = PassRateMeter()
    for _ in range(5):
        m.add(128, 0.01)
    r = m.rate()
    assert r.overhead_s == 0.0 and r.unit_s == pytest.approx(0.01 / 128) and r.samples == 5
    m2 = PassRateMeter()
    m2.add(10, 0.5)  # a small pass that took long (noise), then a fast large one: negative intercept
    m2.add(1000, 0.1)
    m2.add(20, 0.5)
    r = m2.rate()
    assert r.overhead_s == 0.0 and r.unit_s > 0
    m2.add(0, 1.0)  # empty or zero-time passes are ignored
    m2.add(10, 0.0)
    assert m2.rate().samples == 3


def test_cpu_timer_feeds_the_meter():
    m = PassRateMeter()
    t = DevicePassTimer(m, "cpu")
    start = t.start()
    sum(range(10000))
    t.stop(start, 100)
    t.harvest()
    assert m.rate().samples == 1 and m.rate().unit_s > 0
