"""The goodput accountant (ftrun.supervisor.accounting.goodput), in-process: time is an input.

Schedules of events with known answers: where each replica-second goes for a
failure-free run, a kill, a hang, a checkpoint pause, a group restart that loses
the steps since the script's checkpoint; and, over seeded random schedules, that
every second of every lane lands in exactly one bucket.
"""

from __future__ import annotations

import random

import pytest

from ftrun.supervisor.accounting.goodput import Accountant, Cause, LaneState

pytestmark = pytest.mark.quick


class Steps:
    """A replica stepping every `dt` from its first step, reported every 0.25 s (as workers do)."""

    def __init__(self, acc: Accountant, replica: int, dt: float) -> None:
        self.acc, self.replica, self.dt = acc, replica, dt
        self.first = None
        self.step = 0
        self.last = None

    def run(self, t0: float, t1: float, start_step: int = 0, stall=None) -> None:
        """Steps from t0 up to t1; `stall` = (a, b): no step in between (the next one at b)."""
        t = t0
        self.step = max(self.step, start_step)
        next_report = t0
        while t <= t1 + 1e-9:
            if stall and stall[0] < t < stall[1]:
                t = stall[1]
                continue
            self.step += 1
            self.last = t
            if self.first is None:
                self.first = t
            if t >= next_report:
                self.acc.progress(self.replica, t + 0.01, self.step, self.last, self.first)
                next_report = t + 0.25
            t = round(t + self.dt, 9)
        self.acc.progress(self.replica, self.last + 0.01, self.step, self.last, self.first)


def _balanced(b) -> None:
    assert b.productive_s >= 0 and all(v >= -1e-9 for v in b.lost_s.values()), b
    assert b.productive_s + sum(b.lost_s.values()) == pytest.approx(b.replica_s, abs=1e-6), b


def test_failure_free_run_is_startup_then_steps_then_the_end():
    acc = Accountant(2, started=0.0, ft=True)
    for r in (0, 1):
        acc.spawned(r, 0.1)
    lanes = [Steps(acc, r, 0.05) for r in (0, 1)]
    for s in lanes:
        s.run(2.0, 12.0)
    acc.done(0, 12.1)
    acc.done(1, 12.2)
    acc.end(12.3)
    b = acc.snapshot(99.0)
    _balanced(b)
    assert b.replica_s == pytest.approx(24.6)
    assert b.lost_s["startup"] == pytest.approx(4.0)
    assert b.productive_s == pytest.approx(20.0, abs=0.01)
    assert b.lost_s["end"] == pytest.approx(0.6, abs=0.01)
    assert b.lost_s["failures"] == b.lost_s["waiting"] == b.lost_s["hangs"] == 0
    assert b.goodput == pytest.approx(20.0 / 24.6, abs=1e-3)
    assert b.failures == []


def test_a_kill_costs_the_victims_time_away_and_the_survivors_stall():
    acc = Accountant(2, started=0.0, ft=True)
    acc.spawned(0, 0.0)
    acc.spawned(1, 0.0)
    s0, s1 = Steps(acc, 0, 0.05), Steps(acc, 1, 0.05)
    s0.run(1.0, 5.0)
    s1.run(1.0, 5.0)
    idx = acc.failed(1, 5.02, rank=1, cause="killed by SIGKILL", kind="signal", detect_s=0.01)
    acc.spawned(1, 5.05)
    # the survivor waits 0.5 s for the vote on the dead one's behalf, then again while it heals
    s0.run(5.5, 7.0, stall=(5.55, 6.4))
    s1.first = None
    s1.run(6.4, 7.0, start_step=s0.step)
    b = acc.snapshot(7.0)
    _balanced(b)
    f = b.failures[idx]
    assert f.back_s == pytest.approx(6.4 - 5.02, abs=1e-6)
    assert f.detect_s == pytest.approx(0.01)
    # victim: from its last step (5.0) to its first again (6.4); survivor: its two stalls' excess
    victim = 6.4 - 5.0
    survivor = (5.5 - 5.0 - 0.05) + (6.4 - 5.5 - 0.05 - 0.05)
    assert b.lost_s["failures"] == pytest.approx(victim + survivor, rel=0.05)
    assert f.lost_s == pytest.approx(b.lost_s["failures"], rel=1e-6)
    assert b.lost_s["waiting"] == 0
    assert acc.lanes[1].state is LaneState.TRAINING


def test_a_survivors_stall_is_judged_by_the_pace_the_run_has_now():
    """The run stepped at 0.6 s for 20 steps, then 8 at 0.3 s (a machine less loaded):
    a survivor's 0.9 s stall at a kill is 0.6 s lost against the pace of that moment. The old books
    judged it by the median of their last 64 samples, all lanes together, still half of the slow
    steps: 0.6 s, so the stall was below the limit and counted as steps (found by the goodput test
    of two kills, which measures the survivors' stalls from their commits)."""
    acc = Accountant(3, started=0.0, ft=True)
    lanes = [Steps(acc, r, 0.6) for r in range(3)]
    for r, s in enumerate(lanes):
        acc.spawned(r, 0.0)
        s.run(1.0, 12.4)                                   # 20 steps of 0.6 s
    for s in lanes:
        s.dt = 0.3
        s.run(12.7, 14.8)                                  # 8 steps of 0.3 s
    assert acc.step_time() == pytest.approx(0.3, abs=0.01)
    idx = acc.failed(2, 14.9, rank=2, cause="killed by SIGKILL", kind="signal", detect_s=0.01)
    acc.spawned(2, 14.95)
    for s in lanes[:2]:
        s.run(15.7, 16.9)                                  # the survivors' step after 14.8 comes at 15.7
    lanes[2].first = None
    lanes[2].run(15.7, 16.9, start_step=lanes[0].step - 5)
    b = acc.snapshot(16.9)
    _balanced(b)
    victim = 15.7 - 14.8
    survivors = 2 * (0.9 - 0.3)
    assert b.failures[idx].lost_s == pytest.approx(victim + survivors, rel=0.05), b
    assert b.lost_s["waiting"] == 0


def test_a_hang_is_lost_until_its_detection_then_a_failure():
    acc = Accountant(2, started=0.0, ft=True)
    for r in (0, 1):
        acc.spawned(r, 0.0)
    s0, s1 = Steps(acc, 0, 0.1), Steps(acc, 1, 0.1)
    s0.run(1.0, 5.0)
    s1.run(1.0, 5.0)
    acc.hung(1, 8.0, since=5.0)                  # detected 3 s after its last progress
    idx = acc.failed(1, 9.0, rank=1, cause="hung (no heartbeat for 3 s)", kind="hang")
    acc.spawned(1, 9.05)
    s0.run(9.5, 12.0, stall=(5.05, 9.5))         # the survivor waited for it all along
    s1.first = None
    s1.run(10.0, 12.0, start_step=s0.step)
    b = acc.snapshot(12.0)
    _balanced(b)
    assert b.failures[idx].detect_s == pytest.approx(3.0)
    assert b.failures[idx].kind == "hang"
    # hung replica: 3 s until detection; the survivor's stall overlapping the hang: 4.4 s
    assert b.lost_s["hangs"] == pytest.approx(3.0 + (9.5 - 5.0 - 0.1), abs=0.01)
    assert b.lost_s["failures"] == pytest.approx(10.0 - 8.0, abs=0.01)  # dump grace, restart, heal
    segs = acc.segments(12.0)[1]
    assert [s for _, _, s in segs] == ["starting", "training", "hung", "away", "healing", "training"]


def test_a_checkpoint_pause_is_blamed_on_the_checkpoint():
    acc = Accountant(1, started=0.0, ft=True)
    acc.spawned(0, 0.0)
    s = Steps(acc, 0, 0.05)
    acc.checkpoint(3.0, 0.8)
    s.run(1.0, 6.0, stall=(3.0, 3.85))
    b = acc.snapshot(6.0)
    _balanced(b)
    assert b.lost_s["checkpoints"] == pytest.approx(0.85 - 0.05, abs=0.01)
    assert b.lost_s["waiting"] == 0


def test_a_stall_with_nothing_behind_it_is_waiting_and_jitter_is_not():
    acc = Accountant(1, started=0.0, ft=False)
    acc.spawned(0, 0.0)
    s = Steps(acc, 0, 0.05)
    s.run(1.0, 3.0, stall=(2.0, 2.1))   # 0.1 s: jitter
    s.run(3.05, 6.0, stall=(4.0, 5.0))  # 1 s: a stall
    b = acc.snapshot(6.0)
    _balanced(b)
    assert b.lost_s["waiting"] == pytest.approx(0.95, abs=0.01)


def test_group_restart_loses_the_steps_since_the_scripts_checkpoint():
    acc = Accountant(2, started=0.0, ft=False)
    for r in (0, 1):
        acc.spawned(r, 0.0)
    lanes = [Steps(acc, r, 0.1) for r in (0, 1)]
    for s in lanes:
        s.run(1.0, 4.9)                  # steps 1..40
    idx = acc.failed(1, 5.0, rank=1, cause="exited with code 1", kind="exit")
    acc.stopped(0, 5.0, failure=idx)
    acc.group_restart(idx, lost_steps=15)  # its checkpoint was at step 25
    for r in (0, 1):
        acc.spawned(r, 5.5)
    for s in lanes:
        s.first, s.step = None, 0
        s.run(6.5, 8.0)
    acc.done(0, 8.05)
    acc.done(1, 8.05)
    acc.end(8.1)
    b = acc.snapshot(8.1)
    _balanced(b)
    assert b.steps_lost == 15 and b.failures[idx].lost_steps == 15
    assert b.steps_taken == 40 + 16
    # both lanes: 15 steps of 0.1 s redone, the step in flight, and 1.6 s from the failure to their first step again
    assert b.lost_s["failures"] == pytest.approx(2 * (1.5 + 0.1 + 1.5), abs=0.02)
    assert b.failures[idx].back_s == pytest.approx(1.5)
    assert b.failures[idx].lost_s == pytest.approx(b.lost_s["failures"], rel=1e-6)


def test_a_replica_given_up_is_a_gone_lane_charged_to_failures():
    acc = Accountant(2, started=0.0, ft=True)
    for r in (0, 1):
        acc.spawned(r, 0.0)
    s0, s1 = Steps(acc, 0, 0.1), Steps(acc, 1, 0.1)
    s0.run(1.0, 3.0)
    s1.run(1.0, 3.0)
    acc.failed(1, 3.05, rank=1, cause="exited with code 1", kind="exit")
    acc.given_up(1, 3.05)
    s0.run(3.1, 6.0)
    b = acc.snapshot(6.0)
    _balanced(b)
    assert b.lanes == {0: "training", 1: "gone"}
    assert b.lost_s["failures"] == pytest.approx(6.0 - 3.0, abs=0.02)
    assert b.spare_s == 0


def test_a_hot_spare_waits_apart_from_the_replica_time_and_brings_a_failure_back():
    """--spares: replica 2 is held back after its start-up, replica 1 dies, the spare takes its place
    (it heals for rank 1's failure, and its first step brings that failure back), and replica 1,
    restarted, is held back as the spare. The spares' time is booked apart, not in the replica-time."""
    acc = Accountant(3, started=0.0, ft=True)
    for r in (0, 1, 2):
        acc.spawned(r, 0.0)
    acc.spare(2, 1.0, waiting=True)
    s0, s1 = Steps(acc, 0, 0.1), Steps(acc, 1, 0.1)
    s0.run(1.0, 5.0)
    s1.run(1.0, 5.0)
    idx = acc.failed(1, 5.05, rank=1, cause="killed by SIGKILL", kind="signal")
    acc.spare(2, 5.1, waiting=False)
    acc.spawned(1, 5.2)
    acc.spare(1, 6.0, waiting=True)
    s0.run(5.1, 8.0)
    Steps(acc, 2, 0.1).run(6.0, 8.0, start_step=s0.step - 20)
    b = acc.snapshot(8.0)
    _balanced(b)
    assert b.lanes == {0: "training", 1: "spare", 2: "training"}
    assert b.spare_s == pytest.approx(1.0 + 4.1 + 0.8 + 2.0, abs=0.02)  # 2's start-up and wait, 1's restart and wait
    assert b.replica_s == pytest.approx(3 * b.now - b.spare_s)
    assert b.lost_s["startup"] == pytest.approx(2 * 1.0)     # the training replicas' only
    assert b.failures[idx].back_s == pytest.approx(6.0 - 5.05)
    assert b.failures[idx].lost_s == pytest.approx((5.05 - 5.0) + (6.0 - 5.1))  # the step in flight, the spare's heal
    segs = acc.segments(8.0)
    assert [s[2] for s in segs[2]] == ["spare", "spare", "healing", "training"]  # its start-up was a spare's
    assert [s[2] for s in segs[1]][-2:] == ["spare", "spare"]  # its restart was a spare's, then its wait


def test_the_snapshot_changes_nothing_and_stops_at_the_end():
    acc = Accountant(2, started=0.0, ft=True)
    acc.spawned(0, 0.0)
    Steps(acc, 0, 0.1).run(1.0, 2.0)
    one, two = acc.snapshot(3.0), acc.snapshot(3.0)
    assert one == two
    acc.end(4.0)
    assert acc.snapshot(50.0).replica_s == pytest.approx(8.0)


@pytest.mark.parametrize("seed", range(30))
def test_every_second_of_every_lane_lands_in_one_bucket(seed):
    """Seeded random schedules; from seed 20 on the wall clock also steps back now and then."""
    rng = random.Random(seed)
    n = rng.randint(1, 4)
    acc = Accountant(n, started=0.0, ft=rng.random() < 0.5)
    t = 0.0
    steps = {r: 0 for r in range(n)}
    first = {r: None for r in range(n)}
    for r in range(n):
        acc.spawned(r, 0.0)
    for _ in range(300):
        t += rng.choice([0.01, 0.05, 0.1, 0.3, 2.0]) - (rng.choice([0.0, 0.0, 0.0, 1.5]) if seed >= 20 else 0.0)
        r = rng.randrange(n)
        what = rng.random()
        if what < 0.7:
            steps[r] += rng.randint(0, 4)
            first[r] = first[r] or t
            acc.progress(r, t + 0.01, steps[r], t - rng.random() * 0.2, first[r])
        elif what < 0.76:
            acc.failed(r, t, rank=r, cause="x", kind="exit", detect_s=rng.random())
            steps[r], first[r] = 0, None
        elif what < 0.82:
            acc.spawned(r, t)
        elif what < 0.85:
            acc.hung(r, t, since=t - rng.random() * 5)
        elif what < 0.88:
            acc.checkpoint(t - 1, rng.random())
        elif what < 0.9:
            acc.stopped(r, t, failure=rng.choice([None, 0]) if acc.failures else None)
        elif what < 0.91:
            acc.given_up(r, t)
        elif what < 0.93:
            acc.done(r, t)
        elif what < 0.94 and acc.failures:
            acc.group_restart(len(acc.failures) - 1, rng.randint(0, 30))
        b = acc.snapshot(t + rng.random())
        _balanced(b)
        for f in b.failures:
            assert f.lost_s >= 0
    acc.end(t + 1)
    _balanced(acc.snapshot(t + 5))
