"""A simulated --ft run's schedule: its shape (replicas, workers per replica, nodes, the options it
runs with) and its faults, each at a virtual time. Plain data, printed and replayed as one line
by scripts/simulate.py.
Must never hold what happens in a run (sim/world.py and its parts hold that), nor be imported by
the product.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

from ftrun import pacing
from ftrun.supervisor.ft.quorum import KeeperSettings

UNLIMITED = 10 ** 9  # a schedule with no restart budget of its own (--max-restarts not given)


@dataclass(frozen=True)
class Fault:
    """One fault of a schedule, at virtual time `at`: kill (a replica's current incarnation),
    kill-call (killed at its `x`-th store call from then on, before the call takes effect),
    pause (SIGSTOP for `dur`), pause-call (SIGSTOP for `dur` at the rank's `x`-th store call from
    then on, whichever incarnation makes it: a restarted replica stopped mid-join), slow (its turns `x` times slower for `dur`), late (its first
    start delayed by `dur`), heal-kill (killed as soon as it next sends or receives state),
    store-down (every store call waits `dur`), store-slow (latency `x` for `dur`), node-lost (node
    `rank` and every worker on it are gone for good, its store with them), host-lost (the node
    hosting the run's store is lost so, and the run's store moves to the lowest node left), kill-all
    (every worker at once: nobody holds the trained state, and the next quorum's source resumes the
    newest checkpoint)."""

    at: float
    kind: str
    rank: int = -1
    dur: float = 0.0
    x: float = 0.0

    def __str__(self) -> str:
        who = f" rank {self.rank}" if self.rank >= 0 else ""
        extra = (f" {self.dur:.2f}s" if self.dur else "") + (f" x{self.x:g}" if self.x else "")
        return f"{self.at:.3f}s {self.kind}{who}{extra}"


@dataclass
class Schedule:
    seed: int
    replicas: int
    total: int
    faults: List[Fault] = field(default_factory=list)
    k: int = 1  # workers per replica (--replica-size): ranks are replicas * k, a fault's rank is a worker
    nodes: int = 1  # machines: each runs replicas / nodes replicas (whole), in rank order
    round_steps: int = 1  # steps a round takes (the keeper's pinned round length: one vote per round)
    max_restarts: int = UNLIMITED  # ftrun's --max-restarts: each replica's restart budget
    min_replicas: int = 1  # ftrun's --min-replicas: past its budget a replica is dropped while this many live
    joiners: int = 0  # replicas of a node that joins the running run (elastic): ranks after the others'
    join_at: float = 0.0  # when node 0 admits them (QuorumKeeper.add_ranks), and they start
    stop_at: float = -1.0  # a stop signal (SIGTERM with --checkpoint-dir) reaches ftrun then: a stop quorum
    checkpoint_every: int = 0  # --checkpoint-dir with --checkpoint-every N: the writer saves every N steps
    spares: int = 0  # --spares N: the keeper holds N replicas back as hot spares (keeper/spares.py)
    # The guard (FTRUN_FT_CHECK_STEPS N): members compare their states every N steps and after every
    # heal; 0: off (the schedules before it replay as they did).
    check_every: int = 0
    # Optimizers stepped one after another in each step (several ft.Optimizers, a GAN's D then G):
    # each step of the loop is this many sub-steps, each with its own collective and vote; 0: one.
    sub_steps: int = 0

    def keeper_settings(self) -> KeeperSettings:
        return KeeperSettings(self.round_steps, True, None, pacing.CHECK_S if self.check_every else 0.0,
                              self.check_every or None)

