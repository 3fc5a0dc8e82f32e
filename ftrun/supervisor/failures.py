"""What the loop decides when a worker exits or fails: done, restart its replica (--ft), restart
the group (agreed across nodes), drop a replica, or give up with the failure report.

A restart decision asks the policy (ftrun.supervisor.restart), which counts the
budget; a group restart on several nodes agrees on the attempt's first failure
and waits at the attempt barrier (ftrun.supervisor.node_restart) before the
next attempt starts.
Part of the Supervisor (a mixin: the decisions read and write the loop's own
worker table, policy, quorum, ledger and stopping state). Must never be called
from outside the loop's thread, nor wait but at the attempt barrier.
"""

from __future__ import annotations

import signal
import time
from typing import List, Optional

from ftrun import protocol as keys
from ftrun.protocol import EXIT_CANNOT_GO_ON, EXIT_FAILED, EXIT_OK, EXIT_USAGE
from ftrun.supervisor.logs import drain
from ftrun.supervisor.nodes import NodeEvent, one_line
from ftrun.supervisor.peer_restarts import forced_by_peers, peer_reason
from ftrun.supervisor.env import error_file
from ftrun.supervisor.report import early_signature, error_reason, exit_reason, failure_report, worker_error
from ftrun.supervisor.restart import Decision, GroupRestartPolicy
from ftrun.supervisor.spawn import WorkerExited, SpawnerDied, signal_group
from ftrun.supervisor.stopping import AfterStop
from ftrun.supervisor.worker import Failure, Worker, WorkerState
from ftrun.wire import UNKNOWN_FAILURE, FirstFailure, ProgressReport

STORE_READY_TIMEOUT_S = 30.0


# Why a failure is not restarted although budget is left (ftrun.supervisor.restart).
REPEATED = ("not restarted again: it failed the same way (the same exception at the same line) twice in a row "
            "right after start, before any step, which a restart cannot fix")


class FailureDecisions:
    """The failure and restart part of the Supervisor's loop (ftrun.supervisor.run holds the state)."""

    def _on_spawner_died(self, ev: SpawnerDied) -> None:
        st = self.stopping
        if st is None and not any(w.alive for w in self.workers):
            return
        if st is None:
            lost = ", ".join(str(w.rank) for w in self.workers if w.tag in ev.lost) or "none"
            self.console.note(f"internal error: {ev.reason}; workers lost with it: rank {lost}; stopping",
                              style="bold red")
            self._begin_stop(signal.SIGTERM, self.cfg.shutdown_timeout, AfterStop.EXIT, EXIT_FAILED)
            return
        # Mid-stop: the workers being stopped died with it (parent-death signal; the spawner
        # SIGKILLs what is left), and one whose start was still in flight will never report.
        if st.then is AfterStop.RESTART_GROUP:
            self.console.note(f"internal error: {ev.reason}; no worker can be started: stopping", style="bold red")
            st.then, st.code = AfterStop.EXIT, EXIT_FAILED
        for w in list(st.pending.values()):
            self._stopped(w)

    def _on_exit(self, ev: WorkerExited) -> None:
        w = self.by_tag.get(ev.tag)
        if w is None or ev.tag != w.tag:
            self.by_tag.pop(ev.tag, None)
            return  # an old incarnation that was already accounted for
        signal_group(ev.pid, signal.SIGKILL)  # nothing the worker started may outlive it
        w.pid = ev.pid
        if w.stop_requested:
            self._stopped(w)
            return
        self.by_tag.pop(ev.tag)
        w.kill_at = None
        over = self._training_over()
        if self.quorum is not None:
            # first: the survivors may be waiting for its vote. Past the run's last step it left the
            # loop, whatever it did after: no epoch may start without it (nobody trains again).
            self.quorum.on_exit(w.rank, w.incarnation, finished=over or ev.exit_code == 0 and not w.hang_reason)
        for p in w.pumps:
            p.done.wait(0.5)
        self._dirty = True
        if ev.exit_code == 0 and not w.hang_reason:
            w.state = WorkerState.DONE
            w.finished_at = time.time()
            self.ledger.done(w, w.finished_at)
            return
        tail = list(w.pumps[1].tail) if len(w.pumps) > 1 else []
        if ev.exit_code == EXIT_CANNOT_GO_ON and not w.hang_reason:
            why = self._why_it_cannot_go_on(w, tail)
            if why:
                self._cannot_go_on(w, why)
                return
        # The worker's own structured error (TORCHELASTIC_ERROR_FILE) before its stderr's words.
        error = None if ev.signal or w.hang_reason else worker_error(error_file(self.cfg, w.rank), w.started)
        peers = self.quorum is not None and not w.hang_reason and forced_by_peers(ev.exit_code, error)
        reason = w.hang_reason or (peer_reason(error.message, w.rank // self.k, self.k, self.workers, time.time())
                                   if peers else error_reason(ev.exit_code, error) if error is not None
                                   else exit_reason(ev.exit_code, ev.signal, tail, ev.pid, w.rss_bytes))
        early = not w.first_step_seen and not w.hang_reason and not ev.signal
        signature = (error.signature if error is not None else early_signature(tail)) if early else None
        failure = Failure(rank=w.rank, pid=ev.pid, exit_code=ev.exit_code, signal=ev.signal, reason=reason,
                          when=time.time(), stderr_tail=tail, log_path=str(self.logs[w.rank].stderr_path),
                          signature=signature, by_peers=peers)
        w.last_failure = failure
        if self.first_failure is None and not peers:
            self.first_failure = failure
        self.ledger.failed(w, failure, time.time(), ev.seen)
        if over:
            self._failed_after_loop(w, failure)
            return
        self._on_failure(w, failure)

    def _training_over(self) -> bool:
        """--ft: a member has left the training loop at the run's last step (protocol.FINISHED, set
        before any member leaves it): a restarted replica would train nothing."""
        st = self.store
        if self.quorum is None or st is None or st.store is None or not st.ready.is_set():
            return False
        try:
            return bool(st.store.check([keys.FINISHED]))
        except Exception:  # the store is gone: the run's end is not known, a restart is no harm
            return False

    def _failed_after_loop(self, w: Worker, failure: Failure) -> None:
        """A worker failed in the script's code after the training loop (an evaluation, a final
        save): the run failed, as under torchrun. No restart (it would train nothing and run that
        code again); the others end what they are doing, then the report (_run_ended)."""
        w.state = WorkerState.FAILED
        self.after_loop.append(failure)
        self.console.note(f"rank {w.rank} (pid {failure.pid}) {failure.reason} after the training loop had ended; "
                          f"not restarted (nothing is left to train): the run fails once the others end",
                          style="bold red")

    def _why_it_cannot_go_on(self, w: Worker, tail: List[str]) -> str:
        """The reason a worker that exited EXIT_CANNOT_GO_ON recorded in its error file; from its
        last ftrun.ft line when the file could not be written; "" for a script's own exit 78."""
        recorded = worker_error(error_file(self.cfg, w.rank), w.started)
        if recorded is not None:
            return recorded.message
        line = next((line.strip() for line in reversed(tail) if line.startswith("ftrun.ft: ")), "")
        return line.split("ftrun.ft: ", 1)[-1].removeprefix("detail: ")

    def _cannot_go_on(self, w: Worker, why: str) -> None:
        """A worker found that the run cannot go on as started (a checkpoint of another model or
        optimizer, a script that misuses ftrun.ft): restarting cannot change that. End the run
        as bad input, with the worker's own line."""
        w.state = WorkerState.FAILED
        self.console.note(f"{why}; stopping the run (exit 2)", style="bold red")
        self.status.exit_summary = why
        self._begin_stop(signal.SIGTERM, self.cfg.shutdown_timeout, AfterStop.EXIT, EXIT_USAGE)

    def _on_failure(self, w: Worker, failure: Failure) -> None:
        self._check_ft_api()  # a script without ftrun.ft under --ft gets group restarts (ft_follow.py)
        if isinstance(self.policy, GroupRestartPolicy):
            self._group_failure(w, failure)
            return
        # replica policy (--ft): the failed worker's replica fails as a unit
        rep = w.rank // self.k
        mates = [o for o in self._replica(rep) if o is not w]
        if self.saving is not None:  # the run is stopping: nothing restarts
            w.state = WorkerState.FAILED
            self._stop_mates(mates, WorkerState.FAILED)
            self.console.note(f"rank {w.rank} {failure.reason} while the run saves before stopping; not restarted",
                              style="yellow")
            return
        live_after = len({o.rank // self.k for o in self.workers if o.alive and o.rank // self.k != rep})
        who = f"rank {w.rank}" if self.k == 1 else f"rank {w.rank} of replica {rep}"
        if any(o.state == WorkerState.DONE for o in self.workers):
            # The others have left the training loop: there is no step left to heal into.
            w.state = WorkerState.FAILED
            self._stop_mates(mates, WorkerState.FAILED)
            self.console.note(f"{who} {failure.reason} after the others finished; not restarted",
                              style="yellow")
            return
        # A restart the others' decision forced (peer_restarts.py) is not this replica's failure.
        decision = (Decision.RESTART_REPLICA if failure.by_peers
                    else self.policy.on_failure(rep, live_after, failure.signature))
        if decision is Decision.RESTART_REPLICA:
            used = self.policy.restarts.get(rep, 0)
            budget = ("not counted against its restart budget" if failure.by_peers
                      else f"restart {used} of {self.policy.max_restarts}")
            alone = ("it alone" if self.k == 1 else
                     f"its replica ({self.k} workers, ranks {rep * self.k}-{rep * self.k + self.k - 1}) alone")
            self.console.note(f"{who} (pid {failure.pid}) {failure.reason}; restarting {alone} "
                              f"({budget}); the others keep training", style="bold yellow")
            w.state = WorkerState.RESTARTING
            self._stop_mates(mates, WorkerState.RESTARTING)
            for o in [w] + mates:
                o.restarts = used
            self._write_state()  # `ftrun status` shows it restarting, then recovering, then running
            self.respawning[rep] = True
            self._respawn_replicas()
            return
        w.state = WorkerState.FAILED
        self._stop_mates(mates, WorkerState.FAILED)
        why = (REPEATED if self.policy.repeated else
               f"its restart budget ({self.policy.max_restarts}) is spent")
        if decision is Decision.DROP_REPLICA:
            self.ledger.given_up(w, time.time())
            self.console.note(f"{who} {failure.reason}; {why}: carrying on with {live_after} "
                              f"replica{'s' if live_after != 1 else ''} (--min-replicas {self.policy.min_replicas})",
                              style="bold red")
            return
        self.give_up_why = why
        self._begin_stop(signal.SIGTERM, self.cfg.shutdown_timeout, AfterStop.REPORT, failure.status_code, failure)

    def _replica(self, rep: int) -> List[Worker]:
        return [o for o in self.workers if o.rank // self.k == rep]

    def _stop_mates(self, mates: List[Worker], state: WorkerState) -> None:
        """The other workers of a failed replica: SIGKILL at once (nothing of theirs is worth a
        grace, and a collective with their dead peer would hold them, NCCL included)."""
        for o in mates:
            if self.by_tag.get(o.tag) is o:
                o.state = state
                o.stop_requested = True  # its exit is a stop, not a failure of its own
                signal_group(o.pid, signal.SIGKILL)  # one not started yet gets it once it is
            elif o.alive:
                o.state = state

    def _respawn_replicas(self) -> None:
        """Start every replica whose restart waits, once the last of its old processes is gone."""
        if self.stopping is not None:
            return
        for rep in [r for r in self.respawning if not any(self.by_tag.get(o.tag) is o for o in self._replica(r))]:
            del self.respawning[rep]
            workers = self._replica(rep)
            inc = max(o.incarnation for o in workers) + 1  # one incarnation for the whole replica
            for o in workers:
                o.incarnation = inc
                self._spawn(o)

    def _group_failure(self, w: Optional[Worker], failure: Optional[Failure],
                       remote: Optional[FirstFailure] = None) -> None:
        """Without --ft: a failure here (w, failure) or on another node (remote) stops every
        worker; the group restarts while the budget lasts. With several nodes the first
        failure of the attempt is agreed in the store, so every node decides alike."""
        if w is not None:
            w.state = WorkerState.FAILED
        info = (FirstFailure(self.cfg.node_rank, failure.rank, failure.reason, failure.status_code, failure.signature)
                if failure is not None else remote or UNKNOWN_FAILURE)
        if self.nodes is not None:
            try:
                info = self.nodes.first_failure(failure, remote)
            except Exception as e:
                if failure is not None and not self.nodes.store_reachable():
                    self._on_node_event(self.nodes.store_gone(one_line(e)))
                    return
        code = info.code or 1
        here = self.nodes is None or (failure is not None and info.node == self.cfg.node_rank
                                      and info.rank == failure.rank)
        origin = (f"rank {info.rank} on node {info.node}" if self.nodes is not None
                  else f"rank {info.rank} (pid {failure.pid})" if failure is not None else f"rank {info.rank}")
        decision = self.policy.on_failure(info.rank, info.signature)
        grace = self.cfg.shutdown_timeout
        if decision is not Decision.RESTART_GROUP:
            if self.policy.repeated:
                self.give_up_why = REPEATED
            self.status.exit_summary = f"{origin} {info.reason}"
            if self._can_reform() and not self.policy.repeated:
                # c10d: a failure ends the round; every node comes back to re-form (ftrun.supervisor.rendezvous).
                self.reform = True
                self.console.note(f"{origin} {info.reason}; ending round {self.cfg.round}: every node stops its "
                                  f"workers and the run re-forms (restart {self.cfg.round + 1} of "
                                  f"{self.cfg.total_restarts})", style="bold yellow")
                self._begin_stop(signal.SIGTERM, grace, AfterStop.EXIT, code)
            elif here and failure is not None:
                self._begin_stop(signal.SIGTERM, grace, AfterStop.REPORT, code, failure)
            else:
                budget = self.cfg.max_restarts if self.cfg.total_restarts is None else self.cfg.total_restarts
                why = self.give_up_why or f"restart budget spent ({budget} restart{'s' if budget != 1 else ''})"
                self.console.note(f"{origin} {info.reason}; {why}; stopping this node's workers",
                                  style="bold red")
                self._begin_stop(signal.SIGTERM, grace, AfterStop.EXIT, code)
            return
        where = "" if self.nodes is None else f" on {self.cfg.nnodes} nodes"
        self.console.note(f"{origin} {info.reason}; restarting all {self.cfg.world_size} workers{where} "
                          f"(restart {self.policy.restarts} of {self.policy.max_restarts})", style="bold yellow")
        for o in self.workers:
            o.state = WorkerState.RESTARTING if o is w or o.alive else o.state
        self._write_state()  # `ftrun status` shows the restart while the group stops
        self._begin_stop(signal.SIGTERM, grace, AfterStop.RESTART_GROUP, code)

    def _restart_group(self, code: int) -> Optional[int]:
        """Every worker of this node has stopped: start the next attempt once every node has
        (`code`: the failure's status, for a node that ended meanwhile); else ftrun's exit status."""
        attempt = self.nodes.attempt if self.nodes is not None else 0
        if self.nodes is not None:
            waited = self.nodes.attempt_barrier(code)
            if isinstance(waited, NodeEvent):
                self._on_node_event(waited)
                return None
            if waited is not None:
                return waited
        else:
            self._clean_store_for_new_attempt()
        self._read_last_reports()  # where each rank stopped and last saved: the steps this attempt lost
        self.ledger.group_restart(time.time(), self._rank0_report(attempt))
        self.status.group_restarts = self.policy.restarts
        for o in self.workers:
            o.incarnation = self.policy.restarts
            o.restarts = self.policy.restarts
            self._spawn(o)
        self.first_failure = None  # a new attempt: its first failure is what counts
        return None

    def _clean_store_for_new_attempt(self) -> None:
        if self.store is None or not self.store.wait(STORE_READY_TIMEOUT_S):
            return
        try:
            self.store.clear_worker_keys()
        except Exception as e:  # the attempt may still work; say why it might not
            self.console.note(f"could not clear the store between attempts: {e}", style="yellow")

    def _run_ended(self) -> int:
        """Every worker has ended: ftrun's exit status, 0 only when each one's last process exited 0.
        A failure after the training loop gets the failure report; a replica given up after its
        restart budget (the others trained on) ends the run with its status."""
        lost = [w for w in self.workers if w.state == WorkerState.FAILED]
        if self.after_loop:
            self.first_failure = min(self.after_loop, key=lambda f: f.when)
            ranks = ", ".join(str(f.rank) for f in sorted(self.after_loop, key=lambda f: f.rank))
            self.give_up_why = (f"rank{'s' if len(self.after_loop) > 1 else ''} {ranks} failed after the training "
                                f"loop had ended; not restarted: nothing was left to train")
            return self._give_up(self.first_failure, early_exits=False)
        if not lost:
            return EXIT_OK
        if any(w.state == WorkerState.DONE for w in self.workers) or not self.first_failure:
            failures = [w.last_failure for w in lost if w.last_failure is not None]
            first = min(failures, key=lambda f: f.when) if failures else None
            code = first.status_code if first is not None else EXIT_FAILED
            self.first_failure = first or self.first_failure
            self.console.note(
                f"finished with {len(self.workers) - len(lost)} of {len(self.workers)} replicas; "
                + "; ".join(f"rank {w.rank} was given up after {w.restarts} restart(s): "
                            f"{w.last_failure.reason if w.last_failure else 'failed'}" for w in lost)
                + f"; exit {code}: not every worker finished", style="bold yellow")
            return code
        return self.first_failure.status_code

    def _give_up(self, failure: Failure, early_exits: bool = True) -> int:
        """The failure report; ftrun's exit status. `early_exits`: name ranks that exited 0
        before the failure as its likely cause (not after the training loop, where all do)."""
        first = self.first_failure or failure
        attempts = self.give_up_why or (f"restart budget spent ({self.cfg.max_restarts} restart"
                                        f"{'s' if self.cfg.max_restarts != 1 else ''}, {self.policy.name})")
        drain([p for w in self.workers for p in w.pumps])  # the report comes after the workers' lines
        self._fill_goodput(end=True)  # the goodput summary, before the report: the report is the last word
        self.console.renderable(failure_report(first, attempts, self.workers if early_exits else ()))
        return first.status_code

    def _rank0_report(self, attempt: int) -> Optional[ProgressReport]:
        """Rank 0's last progress report of the stopped `attempt`, on a node that does not run it
        (a script's checkpoint is usually saved there). Node 0 keeps a copy before the next
        attempt starts: by the time this node reads, the new rank 0 has replaced its report."""
        if self.cfg.node_rank == 0 or self.nodes is None:
            return None
        return self.nodes.rank0_report(attempt)
