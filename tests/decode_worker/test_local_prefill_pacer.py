"""LocalPrefillPacer on CPU with made-up rates: a pass costs about one decode step, between the floor
and the cap; a pass that does not fill its budget waits a few steps for more prompts to share it."""

from cluster.worker.pass_rate import PassRate
from decode_worker.local_prefill_pacer import LocalPrefillPacer


def test_budget_is_what_one_step_buys():
    p = LocalPrefillPacer(cap_tokens=1024)
    rate = PassRate(overhead_s=0.0005, unit_s=0.000002, samples=10)  # 1B-like: 0.5 ms + 2 us a token
    assert p.budget(rate, 0.0027) == 1024  # (2.7 - 0.5) ms / 2 us = 1100, capped
    assert p.budget(rate, 0.0012) == 350 and p.last_budget == 350
    assert p.budget(rate, 0.0004) == 32  # the pass's fixed cost alone exceeds the step: the floor
    assert p.budget(None, 0.003) == 1024 and p.budget(rate, None) == 1024  # nothing measured: the cap
    assert LocalPrefillPacer(16).budget(rate, 0.0004) == 16  # a cap below the floor is the floor
    assert LocalPrefillPacer(1024, itl_factor=2.0).budget(rate, 0.0012) == 950


def test_a_pass_waits_for_more_prompts_up_to_max_wait_steps():
    p = LocalPrefillPacer(cap_tokens=1024, max_wait_steps=4)
    assert not p.ready(0, 512, 10)
    assert not p.ready(128, 512, 10) and not p.ready(256, 512, 12)  # held since step 10
    assert p.ready(384, 512, 14)  # waited 4 steps: goes with what there is
    assert not p.ready(128, 512, 15)  # a new hold
    assert p.ready(600, 512, 16)  # the budget is full: at once
    assert not p.ready(128, 512, 17) and not p.ready(0, 512, 18)  # the queue emptied: the hold ends
    assert not p.ready(128, 512, 19) and p.ready(128, 512, 23)
