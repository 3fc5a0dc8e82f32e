"""The hang rules (ftrun.supervisor.policy.hangs.find_hung), in-process: worker records and a keeper's
answers in, the named culprits out; time is an input. The rules through the real CLI, with real
SIGSTOPs and deadlocks, are in test_hangs.py."""

from __future__ import annotations

import pytest

from ftrun.supervisor.policy.hangs import find_hung
from ftrun.supervisor.workers.worker import Worker, WorkerSpec, WorkerState

pytestmark = pytest.mark.quick

NOW = 1000.0
LIMIT = 10.0


class Keeper:
    """The two answers find_hung asks of the --ft quorum keeper."""

    def __init__(self, waited=None, phase=None):
        self.waited, self.phase = waited or {}, phase or {}

    def waited_for_s(self, rank):
        return self.waited.get(rank, 0.0)

    def replica_fields(self, rank):
        return {"ft_phase": self.phase.get(rank)}


def _workers(n, state=WorkerState.RUNNING, **fields):
    out = []
    for r in range(n):
        w = Worker(WorkerSpec(r, r), state=state, pid=100 + r, last_heartbeat=NOW - 1)
        for k, v in fields.items():
            setattr(w, k, v)
        out.append(w)
    return out


def _named(found):
    return [(h.worker.rank, h.reason.split(" (")[0]) for h in found]


def test_default_rule_takes_a_stopped_process_only():
    ws = _workers(2)
    ws[1].stopped_since = NOW - LIMIT - 1
    assert _named(find_hung(ws, NOW, LIMIT, explicit=False, k=1)) == [(1, "hung")]
    ws[1].stopped_since = NOW - LIMIT + 1  # not long enough yet
    assert find_hung(ws, NOW, LIMIT, explicit=False, k=1) == []


def test_ft_waited_for_but_busy_is_never_hung_idle_is():
    ws = _workers(2)
    keeper = Keeper(waited={1: LIMIT + 5})
    assert find_hung(ws, NOW, LIMIT, explicit=False, k=1, quorum=keeper) == []  # it computes (not idle)
    ws[1].idle_since = NOW - LIMIT - 1
    found = find_hung(ws, NOW, LIMIT, explicit=False, k=1, quorum=keeper)
    assert [h.worker.rank for h in found] == [1] and "while it did nothing" in found[0].reason


def test_one_culprit_per_replica_the_stopped_one_before_the_waiting_mate():
    ws = _workers(4)  # two replicas of two workers
    keeper = Keeper(waited={2: LIMIT + 5, 3: LIMIT + 5})
    for w in ws[2:]:
        w.idle_since = NOW - LIMIT - 1
    ws[3].stopped_since = NOW - LIMIT - 1
    found = find_hung(ws, NOW, LIMIT, explicit=False, k=2, quorum=keeper)
    assert [h.worker.rank for h in found] == [3] and "stopped" in found[0].reason
    ws[3].kill_at = NOW + 1  # already being killed: its replica is named, nobody else of it is
    assert find_hung(ws, NOW, LIMIT, explicit=False, k=2, quorum=keeper) == []


def test_step_timeout_rule_heartbeat_and_steps():
    ws = _workers(2, first_step_seen=True, last_step_time=NOW - 1)
    ws[0].last_heartbeat = NOW - LIMIT - 1
    ws[1].last_step_time = NOW - LIMIT - 1
    found = find_hung(ws, NOW, LIMIT, explicit=True, k=1)
    assert [(h.worker.rank, "heartbeat" in h.reason, "no optimizer step" in h.reason) for h in found] == \
        [(0, True, False), (1, False, True)]


def test_restarted_replica_idle_before_asking_to_rejoin():
    ws = _workers(2, state=WorkerState.RECOVERING, idle_since=NOW - LIMIT - 1)
    assert _named(find_hung(ws, NOW, LIMIT, explicit=False, k=2, quorum=Keeper(phase={0: "init"}))) == [(0, "hung")]
    # it asked to join: the quorum's own timeouts take over
    assert find_hung(ws, NOW, LIMIT, explicit=False, k=2, quorum=Keeper(phase={0: "join"})) == []
