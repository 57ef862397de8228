"""CallsAhead: attach and abort calls that came before their prompt's submit (Ray runs an async
actor's calls in no fixed order)."""

from cluster.wire.messages import Reservation
from prefill_worker.calls_ahead import CallsAhead


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def res(rid, seq=0):
    return Reservation(rid, "d0", (1, 2), seq)


def test_an_early_attach_is_taken_by_its_submit():
    ahead = CallsAhead(wait_s=5.0, clock=Clock())
    r = res("a")
    assert ahead.hold("a", r) and len(ahead) == 1
    assert not ahead.hold("a", res("a", 1))  # one per id: a second is refused (the caller aborts it)
    assert ahead.take("a") == (r, False) and len(ahead) == 0
    assert ahead.take("a") == (None, False)


def test_an_early_abort_ends_its_submit_and_gives_back_a_held_reservation():
    ahead = CallsAhead(wait_s=5.0, clock=Clock())
    r = res("a")
    assert ahead.hold("a", r)
    assert ahead.abort_ahead("a") == r  # aborted now by the caller: no KV will come for it
    assert ahead.take("a") == (None, True)
    assert ahead.abort_ahead("b") is None and ahead.take("b") == (None, True)


def test_an_attach_for_a_prompt_that_ended_is_not_held():
    ahead = CallsAhead(wait_s=5.0, clock=Clock())
    ahead.ended("a")
    assert not ahead.hold("a", res("a"))  # the walk gave the prompt up while its decode worker reserved
    assert ahead.take("a") == (None, False)
    assert ahead.hold("a", res("a"))  # submitted again: live


def test_aborts_that_overtake_their_submits_are_counted():
    """A walk that gives a prompt up and comes back sends submit, abort, submit, abort of one id; each
    abort may come first, also after the id ended: every submit so aborted ends, none is left running."""
    ahead = CallsAhead(wait_s=5.0, clock=Clock())
    assert ahead.abort_ahead("a") is None
    assert ahead.take("a") == (None, True)
    ahead.ended("a")
    ahead.abort_ahead("a")
    ahead.abort_ahead("a")
    assert len(ahead) == 2
    assert ahead.take("a") == (None, True) and ahead.take("a") == (None, True)
    assert ahead.take("a") == (None, False) and len(ahead) == 0


def test_held_reservations_and_tombstones_expire_after_the_wait():
    clock = Clock()
    ahead = CallsAhead(wait_s=5.0, clock=clock)
    r = res("a")
    ahead.hold("a", r)
    ahead.abort_ahead("b")
    clock.t += 4.9
    assert ahead.expired() == [] and len(ahead) == 2
    clock.t += 0.2
    assert ahead.expired() == [("a", r)] and len(ahead) == 0
    assert ahead.take("a") == (None, False) and ahead.take("b") == (None, False)


def test_it_is_bounded():
    ahead = CallsAhead(wait_s=5.0, max_entries=3, clock=Clock())
    assert all(ahead.hold(f"r{i}", res(f"r{i}")) for i in range(3))
    assert not ahead.hold("r3", res("r3"))  # refused (aborted by the caller), never dropped unanswered
    for i in range(5):
        ahead.ended(f"e{i}")
        ahead.abort_ahead(f"x{i}")
    assert not ahead.hold("e4", res("e4"))  # ended, remembered
    assert ahead.take("r0")[0] is not None and ahead.hold("e0", res("e0"))  # the oldest ended id forgotten
    assert ahead.take("x0") == (None, False) and ahead.take("x4") == (None, True)


def test_expiry_reads_in_deadline_order_also_after_a_partial_take():
    """expired() stops at the first live entry: a tombstone that a submit took one of keeps its place."""
    clock = Clock()
    ahead = CallsAhead(wait_s=5.0, clock=clock)
    ahead.abort_ahead("c")
    ahead.abort_ahead("c")
    clock.t += 3.0
    ahead.abort_ahead("d")
    ahead.hold("e", res("e"))
    assert ahead.take("c") == (None, True)  # one of its two
    clock.t += 2.1
    assert ahead.expired() == [] and len(ahead) == 2  # "c" gone (its deadline passed), "d" and "e" live
    assert ahead.take("c") == (None, False) and ahead.take("d") == (None, True)
    clock.t += 3.0
    assert ahead.expired() == [("e", res("e"))]
