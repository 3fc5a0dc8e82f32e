"""A --ft replica that restarts because of another replica's failure: it stepped past a round that
the others then voted down (a peer died mid-collective: one survivor's all-reduce went through,
another's did not), so it exits (exits.EXIT_REPLICA_RESTART) to take the committed state
from a peer. Its process was sound: the restart is charged to no budget, and the console and
the run's summary name the failure that caused it, not "exited with code 75".

The worker says so in its recorded error (wire.PEERS_DECIDED, with the round's decision in its
message); the cause is the newest failure of another replica, seen within PEER_CAUSE_S before
(a peer's death is always seen first: its abstention is what lets the round be decided), or
else a peer's failed collective (its process lives on). Must never touch processes.
"""

from __future__ import annotations

from typing import Iterable, Optional

from ftrun.exits import EXIT_REPLICA_RESTART
from ftrun.supervisor.workers.worker import Worker
from ftrun.wire import PEERS_DECIDED, WorkerError

# How far back a failure of another replica counts as the cause (a decision follows the death
# that it waited for within a round, a collective's timeout at most: FTRUN_FT_TIMEOUT, 10 s).
PEER_CAUSE_S = 60.0


def forced_by_peers(exit_code: Optional[int], error: Optional[WorkerError]) -> bool:
    """Whether a worker's exit is a restart its peers' decision of a round forced on it."""
    return exit_code == EXIT_REPLICA_RESTART and error is not None and error.where == PEERS_DECIDED


def peer_reason(why: str, replica: int, k: int, workers: Iterable[Worker], now: float) -> str:
    """The failure line of replica `replica`'s restart forced by its peers (`why`: the worker's own
    words for the round's decision), naming the other replica's failure that caused it."""
    cause = None
    for o in workers:
        f = o.last_failure
        if (o.rank // k != replica and f is not None and not f.by_peers and f.when <= now
                and now - f.when <= PEER_CAUSE_S and (cause is None or f.when > cause.when)):
            cause = f
    if cause is None:
        what = "a peer's failed collective"
    else:  # its head: "killed by SIGKILL", not the hint in parentheses that follows
        what = f"rank {cause.rank}'s {'death' if cause.signal else 'failure'} ({cause.reason.split(' (', 1)[0]})"
    return f"restarted to take the committed state again after {what}: {why}"
