"""SilenceWatch: silence counts only over continuous watching (the rule: silence_watch.py)."""

from __future__ import annotations

import pytest

from cluster.transport.silence_watch import SilenceWatch, check_timing


def test_silence_grows_over_watched_looks_without_news():
    w = SilenceWatch(1.0)
    assert w.look("d", 5, 10.0) == 0.0
    assert w.look("d", 5, 10.3) == pytest.approx(0.3)
    assert w.silent("d", 5, 10.6) is None
    assert w.silent("d", 5, 10.9) is None
    assert w.silent("d", 5, 11.2) == pytest.approx(1.2)  # past timeout_s, every look 0.3 s apart


def test_news_starts_the_count_again():
    w = SilenceWatch(1.0)
    w.look("d", 5, 10.0)
    w.look("d", 5, 10.4)
    assert w.look("d", 6, 10.8) == 0.0
    assert w.look("d", 6, 11.2) == pytest.approx(0.4)


def test_a_look_after_a_gap_says_nothing_about_the_gap():
    """What it reads may be a forged or replayed record standing at that moment (no news)."""
    w = SilenceWatch(1.0)
    w.look("d", 5, 10.0)
    assert w.look("d", 5, 10.5) == 0.0  # a gap of timeout_s/2: the count starts again
    assert w.look("d", 5, 15.0) == 0.0  # ... and after five seconds unwatched
    assert w.silent("d", 5, 15.4) is None
    assert w.silent("d", 5, 15.8) is None
    assert w.silent("d", 5, 16.2) == pytest.approx(1.2)  # watched silence kills as before


def test_a_peer_that_never_beats_is_dead_after_timeout_s_of_watching():
    w = SilenceWatch(1.0)
    assert w.look(1, None, 0.0) == 0.0
    t = 0.0
    while (quiet := w.silent(1, None, t)) is None:
        t += 0.2
    assert t == pytest.approx(1.2) and quiet == pytest.approx(1.2)


def test_peers_are_watched_apart_and_forgotten():
    w = SilenceWatch(1.0)
    w.look("a", 1, 0.0)
    w.look("b", 1, 0.0)
    for t in (0.3, 0.6, 0.9):
        w.look("a", 1, t)
        w.look("b", 2 if t == 0.9 else 1, t)
    assert w.silent("a", 1, 1.2) is not None and w.silent("b", 2, 1.2) is None
    w.forget("a")
    assert w.look("a", 1, 1.3) == 0.0


def test_timing_must_leave_several_beats():
    check_timing(0.5, 10.0)
    check_timing(0.05, 0.2)
    with pytest.raises(ValueError, match="at least 4 heartbeats"):
        check_timing(0.5, 1.0)
    with pytest.raises(ValueError):
        SilenceWatch(0.0)
