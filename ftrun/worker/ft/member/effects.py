"""What the member's driver (member/driver.py) asks of the world it runs in: the store, the
process groups and their collectives, the clock and sleep, threads, exits, the state a heal moves,
and the script-side reports of a step. The worker implements it over torch, the TCPStore and real
threads (member/torch_effects.py); the simulator over its in-memory store, simulated groups,
scheduler threads and virtual clock (ftrun/sim/effects.py). An implementation carries out, it
never decides: every rule is the driver's or member/core.py's.
Must never import torch, and never import the supervisor.
"""

from __future__ import annotations

from typing import Any, Callable, NoReturn, Optional, Tuple

from ftrun.wire import Quorum
from ftrun.worker.ft.member.core import FedCompared

# (round, step, newest step yielded, sub-steps of the current loop step committed): what a heal's
# transfer carries besides the model's state.
Snapshot = Tuple[int, int, int, int]


class HealRefused(Exception):
    """The state a peer sent does not fit this replica (another model, optimizer or registered
    state): not a failure of the transfer; the replica cannot go on."""


class Signal:
    """A flag one thread sets and another waits for (threading.Event's calls ftrun uses)."""

    def set(self) -> None: ...
    def clear(self) -> None: ...
    def is_set(self) -> bool: ...
    def wait(self) -> None: ...


class MemberEffects:
    """The interface; each method says what the driver needs done, not how."""

    # A store call raises one of these when the run's store is gone or moving (torch's DistError).
    store_errors: Tuple[type, ...] = ()
    # Seconds between a member's store polls (a join, a transfer it waits out).
    poll_s: float = 0.005

    # ------------------------------------------------------------ the store
    def connect(self, timeout_s: Optional[float] = None) -> Any:
        """A new client of the run's store (TCPStore's calls), with its own connection."""
        raise NotImplementedError

    def node(self) -> Any:
        """A new client of this worker's node store as a vote.Node, or None (it votes on the run's)."""
        raise NotImplementedError

    def store_gone(self) -> bool:
        """Whether the run's store stopped answering (as opposed to a slow wait on a live one)."""
        return False

    def announced_store(self) -> Optional[Tuple[int, str]]:
        """(generation, host:port) of the run's store as this node's ftrun last announced it."""
        return None

    def store_address(self) -> str:
        """host:port of the run's store now (for the member's words)."""
        return "?"

    def store_moved(self, addr: str) -> None:
        """The run's store is at `addr` from now on (every later connect goes there)."""

    # ------------------------------------------------------------ clock and threads
    def now(self) -> float:
        raise NotImplementedError

    def wall(self) -> float:
        return self.now()

    def sleep(self, seconds: float) -> None:
        raise NotImplementedError

    def join_sleep(self) -> Callable[[float], None]:
        """The sleep between the polls of one join's wait (membership.wait_to_enter)."""
        return self.sleep

    def park(self) -> None:
        """The member is parked by a stop (its step saved or not, it only waits for the stop's
        signal): from now on that signal ends the process as it would a plain script's."""

    def spawn(self, fn: Callable[[], None], name: str, low_priority: bool = False) -> None:
        """Run `fn` on a thread of this process (a daemon: it ends with the process)."""
        raise NotImplementedError

    def signal(self) -> Signal:
        raise NotImplementedError

    # ------------------------------------------------------------ exits and words
    def exit(self, code: int, line: str = "") -> NoReturn:
        """Leave the process at once with `code` (ftrun.exits' EXIT_*), after `line`."""
        raise NotImplementedError

    def restart(self, line: str, peers_decided: str = "") -> NoReturn:
        """Exit so that ftrun restarts this replica (EXIT_REPLICA_RESTART)."""
        raise NotImplementedError

    def log(self, msg: str) -> None:
        """A line in ftrun's words (the console and the rank's log)."""

    def log_detail(self, msg: str) -> None:
        """A line for the rank's log only."""

    # ------------------------------------------------------------ groups and collectives
    def form_group(self, prefix: str, quorum: Quorum, ranks: list, give_up: Callable[[], Optional[str]]) -> Any:
        """A group of `ranks` (this worker among them), given up (an exception) as soon as
        `give_up()` names a reason."""
        raise NotImplementedError

    def drop_group(self, group: Any) -> None:
        """Close a group at once (None: nothing)."""

    def hang_up(self, group: Any) -> None:
        """A collective of this round failed here: make every operation on `group` fail at once at
        its other members too (None: nothing). The group is dropped later, at the vote."""

    def collectives_unsettled(self) -> Optional[str]:
        """Why the round's collectives did not finish (NCCL does not fail one whose peer died), or None."""
        return None

    def injected_failure(self, rank: int, step: int, inc: int) -> Optional[str]:
        """A failure injected by a test at this step (FTRUN_FT_INJECT_FAIL), or None."""
        return None

    # ------------------------------------------------------------ the state a heal moves
    def fed(self) -> bool:
        """Whether a hot spare's feed (ft/heal/feed.py) has written into this replica's state since
        its last heal: a state that is not the committed one until a heal says so."""
        return False

    def compare_fed(self, group: Any, sending: bool, step: int) -> Optional[FedCompared]:
        """At a heal, before the transfer, on every end of the heal's group (the source at `step`):
        what the ends found of the healers' fed states (a collective), for the member core to
        decide what moves; None in a run without hot spares (nothing to compare)."""
        return None

    def agree_kept(self, group: Any, kept: bool, sending: bool) -> bool:
        """The heal's one answer from this group's (the core's `kept`): a sharded replica keeps its
        healers' state only if every shard does. A whole replica's is its own."""
        return kept

    def send_state(self, group: Any, snapshot: Snapshot, kept: bool) -> Any:
        """Send this replica's state (and `snapshot`) over the heal's group, all of it or (`kept`)
        only what the healers' fed state lacks; returns its stats."""
        raise NotImplementedError

    def receive_state(self, group: Any, on_write: Callable[[], None], kept: bool) -> Tuple[Snapshot, Any]:
        """Receive a peer's state into this replica's own objects (`on_write` once any landed),
        keeping its fed models and optimizers when `kept`; returns the snapshot it was captured
        at, and the stats. Raises HealRefused when it does not fit."""
        raise NotImplementedError

    def compare_states(self, group: Any) -> Tuple[Tuple[Tuple[int, Tuple[int, ...]], ...], Tuple[Tuple[int, str], ...]]:
        """The guard's collective over `group` (every member calls it at the same round's top):
        ((rank, fingerprint of its state) for every member, (rank, what of its state differs from
        most members', for those that differ)). Raises when a peer left mid-check."""
        raise NotImplementedError

    # ------------------------------------------------------------ what the script sees
    def took_step(self, quorum: int, rnd: int, step: int) -> None:
        """This member stepped on round `rnd` of `quorum`, to `step` (loaders advance, progress)."""

    def took_sub_step(self, quorum: int, rnd: int) -> None:
        """This member took a sub-step on round `rnd` (several ft.Optimizers; the loop step is
        counted by took_step once all of its sub-steps are taken)."""

    def decided(self, quorum: int, rnd: int, commit: bool) -> None:
        """The decision of a round this member stepped on came in."""

    def note_step(self, step: int) -> None:
        """The member's step count changed without a step (a heal, a resume, a discarded round)."""

    def group_changed(self, group: Any) -> None:
        """The member's group is now `group` (None: it has none)."""

    def incarnation(self, inc: int) -> None:
        """The member rejoined in place as incarnation `inc`."""
