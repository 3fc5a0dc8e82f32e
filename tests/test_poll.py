"""ftrun.poll.wait_until, the one bounded wait on a condition: it returns what the predicate found,
never sleeps past its deadline, checks once more at the deadline, and lets the predicate's
exceptions through. Time is a fake clock here, so each test is exact and instant."""

from __future__ import annotations

import math

import pytest

from ftrun.poll import wait_until

pytestmark = pytest.mark.quick


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept = []

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


def test_returns_what_the_predicate_found():
    t = FakeTime()
    answers = iter([None, 0, "", ("round", 3)])
    got = wait_until(lambda: next(answers), t.now + 10, 0.5, t.clock, t.sleep)
    assert got == ("round", 3)
    assert t.slept == [0.5, 0.5, 0.5]


def test_gives_up_at_the_deadline_without_sleeping_past_it():
    t = FakeTime()
    calls = []
    got = wait_until(lambda: calls.append(t.now), t.now + 1.2, 0.5, t.clock, t.sleep)
    assert got is None
    assert t.now == pytest.approx(101.2)  # the last sleep was cut to the deadline
    assert t.slept == pytest.approx([0.5, 0.5, 0.2])
    assert calls[-1] == pytest.approx(101.2)  # checked once more at the deadline


def test_a_past_deadline_still_checks_once():
    t = FakeTime()
    assert wait_until(lambda: "yes", t.now - 5, 0.5, t.clock, t.sleep) == "yes"
    assert wait_until(lambda: None, t.now - 5, 0.5, t.clock, t.sleep) is None
    assert t.slept == []


def test_no_deadline_waits_for_the_predicate_alone():
    t = FakeTime()
    got = wait_until(lambda: t.now >= 1000.0 and "late", math.inf, 60.0, t.clock, t.sleep)
    assert got == "late" and len(t.slept) == 15


def test_the_predicates_exception_ends_the_wait():
    t = FakeTime()

    def moved():
        if t.now > 101:
            raise LookupError("moved")

    with pytest.raises(LookupError):
        wait_until(moved, math.inf, 0.5, t.clock, t.sleep)
    assert t.now == pytest.approx(101.5)


def test_a_real_wait_is_bounded():
    import time

    t0 = time.monotonic()
    assert wait_until(lambda: None, t0 + 0.2, 0.05) is None
    assert 0.19 <= time.monotonic() - t0 < 2.0


@pytest.mark.parametrize("interval", [0, -1])
def test_an_interval_that_would_spin_is_refused(interval):
    with pytest.raises(ValueError):
        wait_until(lambda: None, 0.0, interval)
