"""Which workers are hung: the rules of --step-timeout and of the default hang detection.

find_hung() looks at the worker records (heartbeats, steps, process samples) and, under
--ft, at how long the quorum's peers have waited for each replica, and names at most one
culprit per replica with the reason; time and the limit are inputs. The loop
(ftrun.supervisor.loop.run) decides what follows: it marks the worker hung, has it dump its
stacks and kills it.
Must never signal a process, change a worker's record, write a console line or read a
clock: it only reports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Protocol, Sequence

from ftrun.supervisor.workers.worker import Worker, WorkerState


class Waited(Protocol):
    """What the hang rules take from the --ft keeper (ftrun.supervisor.ft.quorum.QuorumKeeper,
    a layer above this one)."""

    def waited_for_s(self, rank: int) -> float: ...

# After the stacks-dump signal, how long a hung worker has to write them before SIGKILL.
HANG_DUMP_GRACE_S = 1.0

_LIVE = (WorkerState.RUNNING, WorkerState.RECOVERING, WorkerState.STARTING)


@dataclass(frozen=True)
class Hung:
    worker: Worker
    reason: str


def find_hung(workers: Sequence[Worker], now: float, limit: float, explicit: bool, k: int,
              quorum: Optional[Waited] = None) -> List[Hung]:
    """The hung workers at `now`: by --step-timeout's rule when `explicit`, else by the default
    rule, which can only take a worker that does nothing (stopped, or idle while waited for).
    `k`: workers per replica; `quorum`: the --ft keeper (waited_for_s, replica_fields), or None.

    A replica of several workers hangs as one: its other workers wait for the hung one inside
    the replica's own collectives. One culprit per replica is named (the replica restarts
    whole): a worker whose process is stopped or whose heartbeat stopped before one that waits."""
    order = sorted(workers, key=lambda o: not (o.stopped_for(now) >= limit or
                                               (o.last_heartbeat and now - o.last_heartbeat > limit)))
    named = {o.rank // k for o in workers if o.kill_at or o.state == WorkerState.HUNG}
    found: List[Hung] = []
    for w in order:
        if w.state not in _LIVE or not w.alive or w.kill_at or w.rank // k in named:
            continue
        mates = [m for m in workers if m.rank // k == w.rank // k]
        reason = _hung_restarting(w, mates, now, limit, quorum) or (
            _hung_by_step_timeout(w, now, limit, quorum) if explicit
            else _hung_by_default(w, mates, now, limit, quorum))
        if reason is not None:
            named.add(w.rank // k)
            found.append(Hung(w, reason))
    return found


def _hung_by_step_timeout(w: Worker, now: float, limit: float,
                          quorum: Optional[Waited]) -> Optional[str]:
    """--step-timeout S: no heartbeat, or no step (with --ft: its peers waited for its step) for S."""
    if w.last_heartbeat and now - w.last_heartbeat > limit:
        return f"hung (no heartbeat for {limit:g} s)"
    if quorum is not None:
        # With --ft every replica stalls while one hangs: only the one the others have
        # been waiting for all along is hung, never a replica that waits for it.
        if quorum.waited_for_s(w.rank) > limit:
            return f"hung (its peers waited {limit:g} s for its step)"
    elif (w.state == WorkerState.RUNNING and w.first_step_seen and w.last_step_time
          and w.since_progress(now) > limit):
        return f"hung (no optimizer step or other progress for {limit:g} s)"
    return None


def _hung_restarting(w: Worker, mates: Sequence[Worker], now: float, limit: float,
                     quorum: Optional[Waited]) -> Optional[str]:
    """--ft, either rule: a restarted replica that has not asked to join the run yet and whose
    every worker has done nothing (no CPU, no I/O, no child at work) for the limit is hung as
    any other, e.g. one blocked in a group its peers formed long ago. Its peers do not wait
    for it (it is in no quorum yet), so the waited-for rules never see it."""
    if quorum is None or w.state != WorkerState.RECOVERING:
        return None
    if any(quorum.replica_fields(m.rank)["ft_phase"] not in (None, "init") for m in mates):
        return None  # it asked to join: the quorum's own waits and timeouts take over
    if all(m.idle_for(now) >= limit for m in mates):
        return f"hung (restarted, it did nothing for {limit:g} s before asking to rejoin: no CPU, no I/O)"
    return None


def _hung_by_default(w: Worker, mates: Sequence[Worker], now: float, limit: float,
                     quorum: Optional[Waited]) -> Optional[str]:
    """No --step-timeout: a worker whose process has been stopped (SIGSTOP, SIGTSTP) for the
    limit; with --ft also one its peers have waited for that long while it did nothing (no CPU,
    no I/O, no child process at work: ftrun.supervisor.accounting.activity). A worker that computes (an
    evaluation, a save) or waits on I/O or a child process is never taken by this rule."""
    if w.stopped_for(now) >= limit:
        return f"hung (its process was stopped for {limit:g} s)"
    if quorum is not None and quorum.waited_for_s(w.rank) >= limit and w.idle_for(now) >= limit:
        if any(m.stopped_since is not None for m in mates if m is not w):
            return None  # it waits for a stopped mate: that one is the culprit, named by its stop
        return (f"hung (its peers waited {limit:g} s for its step while it did nothing: no CPU, no I/O, "
                f"no child at work)")
    return None
