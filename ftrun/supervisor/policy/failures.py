"""The failures component of the supervisor's loop: a worker that failed becomes a Failure record,
the failure policy (ftrun.supervisor.policy.failure_policy) decides what follows, and an action says what the
loop carries out: restart its replica (--ft), drop it, leave it failed, restart the group (agreed
across nodes), end the round, or give up with the failure report.

WorkerFailures owns the run's first failure, the failures after the training loop and why the run
gives up, and says why on the console. The loop (ftrun.supervisor.loop.run) sets the workers'
states its actions name, and stops and starts the processes. A group restart on several nodes agrees
on the attempt's first failure (NodeCoordinator.first_failure) before the policy decides.
Must never set a worker's state, never signal, start or stop a worker, and never be called from
outside the loop's thread.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Union

from ftrun import keys
from ftrun.config import RunConfig
from ftrun.exits import EXIT_CANNOT_GO_ON, EXIT_FAILED, EXIT_OK, EXIT_USAGE
from ftrun.supervisor.accounting.report import early_signature, error_reason, exit_reason, failure_report, worker_error
from ftrun.supervisor.policy.failure_policy import WHILE_SAVING, FailurePolicy, GroupFailed, ReplicaFailed, RestartVerdict
from ftrun.supervisor.policy.peer_restarts import forced_by_peers, peer_reason
from ftrun.supervisor.policy.stopping import AfterStop, StopRun
from ftrun.supervisor.workers.spawn import WorkerExited
from ftrun.supervisor.workers.env import error_file
from ftrun.supervisor.workers.logs import ConsoleOut
from ftrun.supervisor.workers.worker import Failure, Worker, WorkerState
from ftrun.wire import UNKNOWN_FAILURE, FirstFailure, one_line


@dataclass(frozen=True)
class ReplicaOutcome:
    """An action for the loop: the failed worker and its replica's other workers take `state` (the
    others SIGKILLed if they run); `restart`: start the replica again, as restart `restarts`, once its last process is gone;
    `given_up`: it is dropped from the run; `then`: a stop of the whole node that follows."""

    replica: int
    rank: int                 # the worker that failed
    state: WorkerState
    restart: bool = False
    restarts: int = 0
    given_up: bool = False
    then: Optional[StopRun] = None


@dataclass(frozen=True)
class RunOutcome:
    """How the run ended once every worker has: ftrun's exit status, or the failure report of `report`."""

    code: int
    report: Optional[Failure] = None
    early_exits: bool = True


def training_over(store: Any) -> bool:
    """--ft: a member has left the training loop at the run's last step (keys.FINISHED, set
    before any member leaves it): a restarted replica would train nothing."""
    if store is None or store.store is None or not store.ready.is_set():
        return False
    try:
        return bool(store.store.check([keys.FINISHED]))
    except Exception:  # the store is gone: the run's end is not known, a restart is no harm
        return False


class WorkerFailures:
    """Failures, the policy's verdicts on them, and how the run ends."""

    def __init__(self, cfg: RunConfig, console: ConsoleOut, policy: FailurePolicy) -> None:
        self.cfg = cfg
        self.console = console
        self.policy = policy
        self.first_failure: Optional[Failure] = None
        self.after_loop: List[Failure] = []  # --ft: failures after the run's last step
        self.give_up_why: Optional[str] = None  # why the run ends with a failure, when not a spent budget

    def new_attempt(self) -> None:
        """A group restart: the new attempt's first failure is what counts."""
        self.first_failure = None

    # ------------------------------------------------------------ an exit that is a failure
    def cannot_go_on(self, w: Worker, ev: WorkerExited, tail: List[str]) -> Optional[StopRun]:
        """A worker found that the run cannot go on as started (a checkpoint of another model or
        optimizer, a script that misuses ftrun.ft): restarting cannot change that. End the run
        as bad input, with the worker's own line. None for any other exit."""
        if ev.exit_code != EXIT_CANNOT_GO_ON or w.hang_reason:
            return None
        recorded = worker_error(error_file(self.cfg, w.rank), w.started)
        if recorded is not None:
            why = recorded.message
        else:  # its last ftrun.ft line when the file could not be written; "" for a script's own exit 78
            line = next((line.strip() for line in reversed(tail) if line.startswith("ftrun.ft: ")), "")
            why = line.split("ftrun.ft: ", 1)[-1].removeprefix("detail: ")
        if not why:
            return None
        self.console.note(f"{why}; stopping the run (exit 2)", style="bold red")
        return StopRun(signal.SIGTERM, self.cfg.shutdown_timeout, AfterStop.EXIT, EXIT_USAGE, summary=why)

    def describe(self, w: Worker, ev: WorkerExited, tail: List[str], k: int, ft: bool, workers: Sequence[Worker],
                 log_path: str) -> Failure:
        """The failure record of a worker's exit (kept as its last failure, and as the run's first)."""
        # The worker's own structured error (TORCHELASTIC_ERROR_FILE) before its stderr's words.
        error = None if ev.signal or w.hang_reason else worker_error(error_file(self.cfg, w.rank), w.started)
        peers = ft and not w.hang_reason and forced_by_peers(ev.exit_code, error)
        reason = w.hang_reason or (peer_reason(error.message, w.rank // k, k, workers, time.time())
                                   if peers else error_reason(ev.exit_code, error) if error is not None
                                   else exit_reason(ev.exit_code, ev.signal, tail, ev.pid, w.rss_bytes))
        early = not w.first_step_seen and not w.hang_reason and not ev.signal
        signature = (error.signature if error is not None else early_signature(tail)) if early else None
        failure = Failure(rank=w.rank, pid=ev.pid, exit_code=ev.exit_code, signal=ev.signal, reason=reason,
                          when=time.time(), stderr_tail=tail, log_path=log_path, signature=signature, by_peers=peers)
        w.last_failure = failure
        if self.first_failure is None and not peers:
            self.first_failure = failure
        return failure

    def after_training(self, w: Worker, failure: Failure) -> None:
        """A worker failed in the script's code after the training loop (an evaluation, a final
        save): the run failed, as under torchrun. No restart (it would train nothing and run that
        code again); the others end what they are doing, then the report (run_ended)."""
        self.after_loop.append(failure)
        self.console.note(f"rank {w.rank} (pid {failure.pid}) {failure.reason} after the training loop had ended; "
                          f"not restarted (nothing is left to train): the run fails once the others end",
                          style="bold red")

    # ------------------------------------------------------------ --ft: the replica
    def replica_failed(self, w: Worker, failure: Failure, workers: Sequence[Worker], k: int,
                       saving: bool) -> ReplicaOutcome:
        """--ft: the failed worker's replica fails as a unit; the policy says whether it restarts."""
        rep = w.rank // k
        live_after = len({o.rank // k for o in workers if o.alive and o.rank // k != rep})
        who = f"rank {w.rank}" if k == 1 else f"rank {w.rank} of replica {rep}"
        others_done = any(o.state == WorkerState.DONE for o in workers)
        act = self.policy.on_replica_failure(ReplicaFailed(rep, live_after, failure.signature, failure.by_peers,
                                                           others_done, saving))
        if act.verdict is RestartVerdict.NOT_RESTARTED:
            named = f"rank {w.rank}" if act.why == WHILE_SAVING else who
            self.console.note(f"{named} {failure.reason} {act.why}; not restarted", style="yellow")
            return ReplicaOutcome(rep, w.rank, WorkerState.FAILED)
        if act.verdict is RestartVerdict.RESTART_REPLICA:
            budget = ("not counted against its restart budget" if not act.counted
                      else f"restart {act.restarts} of {self.policy.max_restarts}")
            alone = "it alone" if k == 1 else f"its replica ({k} workers, ranks {rep * k}-{rep * k + k - 1}) alone"
            self.console.note(f"{who} (pid {failure.pid}) {failure.reason}; restarting {alone} "
                              f"({budget}); the others keep training", style="bold yellow")
            return ReplicaOutcome(rep, w.rank, WorkerState.RESTARTING, restart=True, restarts=act.restarts)
        why = act.why or f"its restart budget ({self.policy.max_restarts}) is spent"
        if act.verdict is RestartVerdict.DROP_REPLICA:
            self.console.note(f"{who} {failure.reason}; {why}: carrying on with {live_after} "
                              f"replica{'s' if live_after != 1 else ''} (--min-replicas {self.policy.min_replicas})",
                              style="bold red")
            return ReplicaOutcome(rep, w.rank, WorkerState.FAILED, given_up=True)
        self.give_up_why = why
        return ReplicaOutcome(rep, w.rank, WorkerState.FAILED, then=StopRun(
            signal.SIGTERM, self.cfg.shutdown_timeout, AfterStop.REPORT, failure.status_code, failure))

    # ------------------------------------------------------------ the group
    def group_failed(self, w: Optional[Worker], failure: Optional[Failure], remote: Optional[FirstFailure],
                     nodes: Any, workers: Sequence[Worker], can_reform: bool) -> Union[StopRun, Any]:
        """Without --ft: a failure here (w, failure) or on another node (remote) stops every
        worker; the group restarts while the budget lasts. With several nodes the first
        failure of the attempt is agreed in the store, so every node decides alike. The node
        coordinator's event (a NodeEvent) when the store went away meanwhile (the loop decides on it)."""
        info = (FirstFailure(self.cfg.node_rank, failure.rank, failure.reason, failure.status_code, failure.signature)
                if failure is not None else remote or UNKNOWN_FAILURE)
        if nodes is not None:
            try:
                info = nodes.first_failure(failure, remote)
            except Exception as e:
                if failure is not None and not nodes.store_reachable():
                    return nodes.store_gone(one_line(e))
        code = info.code or 1
        here = nodes is None or (failure is not None and info.node == self.cfg.node_rank and info.rank == failure.rank)
        origin = (f"rank {info.rank} on node {info.node}" if nodes is not None
                  else f"rank {info.rank} (pid {failure.pid})" if failure is not None else f"rank {info.rank}")
        act = self.policy.on_group_failure(GroupFailed(info.rank, info.signature, can_reform))
        grace = self.cfg.shutdown_timeout
        summary = f"{origin} {info.reason}"
        if act.why:
            self.give_up_why = act.why
        if act.verdict is RestartVerdict.END_ROUND:
            # c10d: a failure ends the round; every node comes back to re-form (ftrun.supervisor.nodes.rendezvous).
            self.console.note(f"{origin} {info.reason}; ending round {self.cfg.round}: every node stops its "
                              f"workers and the run re-forms (restart {self.cfg.round + 1} of "
                              f"{self.cfg.total_restarts})", style="bold yellow")
            return StopRun(signal.SIGTERM, grace, AfterStop.EXIT, code, summary=summary, reform=True)
        if act.verdict is RestartVerdict.GIVE_UP and here and failure is not None:
            return StopRun(signal.SIGTERM, grace, AfterStop.REPORT, code, failure, summary=summary)
        if act.verdict is RestartVerdict.GIVE_UP:
            budget = self.cfg.max_restarts if self.cfg.total_restarts is None else self.cfg.total_restarts
            why = self.give_up_why or f"restart budget spent ({budget} restart{'s' if budget != 1 else ''})"
            self.console.note(f"{origin} {info.reason}; {why}; stopping this node's workers", style="bold red")
            return StopRun(signal.SIGTERM, grace, AfterStop.EXIT, code, summary=summary)
        where = "" if nodes is None else f" on {self.cfg.nnodes} nodes"
        self.console.note(f"{origin} {info.reason}; restarting all {self.cfg.world_size} workers{where} "
                          f"(restart {act.restarts} of {self.policy.max_restarts})", style="bold yellow")
        return StopRun(signal.SIGTERM, grace, AfterStop.RESTART_GROUP, code)

    # ------------------------------------------------------------ the end
    def run_ended(self, workers: Sequence[Worker]) -> RunOutcome:
        """Every worker has ended: ftrun's exit status, 0 only when each one's last process exited 0.
        A failure after the training loop gets the failure report; a replica given up after its
        restart budget (the others trained on) ends the run with its status."""
        lost = [w for w in workers if w.state == WorkerState.FAILED]
        if self.after_loop:
            self.first_failure = min(self.after_loop, key=lambda f: f.when)
            ranks = ", ".join(str(f.rank) for f in sorted(self.after_loop, key=lambda f: f.rank))
            self.give_up_why = (f"rank{'s' if len(self.after_loop) > 1 else ''} {ranks} failed after the training "
                                f"loop had ended; not restarted: nothing was left to train")
            return RunOutcome(self.first_failure.status_code, self.first_failure, early_exits=False)
        if not lost:
            return RunOutcome(EXIT_OK)
        if any(w.state == WorkerState.DONE for w in workers) or not self.first_failure:
            failures = [w.last_failure for w in lost if w.last_failure is not None]
            first = min(failures, key=lambda f: f.when) if failures else None
            code = first.status_code if first is not None else EXIT_FAILED
            self.first_failure = first or self.first_failure
            self.console.note(
                f"finished with {len(workers) - len(lost)} of {len(workers)} replicas; "
                + "; ".join(f"rank {w.rank} was given up after {w.restarts} restart(s): "
                            f"{w.last_failure.reason if w.last_failure else 'failed'}" for w in lost)
                + f"; exit {code}: not every worker finished", style="bold yellow")
            return RunOutcome(code)
        return RunOutcome(self.first_failure.status_code)

    def report(self, failure: Failure, workers: Sequence[Worker], early_exits: bool = True) -> Any:
        """The failure report (a rich Text). `early_exits`: name ranks that exited 0 before the
        failure as its likely cause (not after the training loop, where all do)."""
        first = self.first_failure or failure
        attempts = self.give_up_why or (f"restart budget spent ({self.cfg.max_restarts} restart"
                                        f"{'s' if self.cfg.max_restarts != 1 else ''}, {self.policy.name})")
        return failure_report(first, attempts, workers if early_exits else ())
