"""The supervisor: start the workers, watch them, restart them, stop them, report.

One event loop on one queue: worker exits (from the spawner, within
milliseconds), forwarded signals, and a 0.25 s tick that reads progress from
the store (hang detection, live status). The loop is the only code that
changes the worker table and the only consumer of the queue; the event sources
only report (the spawner's events, the progress reader, find_hung, the node
coordinator's check(), the quorum keeper). torch elastic's `_invoke_run` is
the pattern: the loop alone decides what happens, and each component owns its
own state, takes events and returns an action the loop carries out:
  the failure policy and the failures (policy/failure_policy.py, policy/failures.py): ReplicaOutcome, StopRun;
  stopping (policy/stopping.py): the stop under way, the save before it, the signal;
  other nodes' news (nodes/node_decisions.py): StopRun, RemoteFailure, StoreMoved;
  the --ft quorum's view (ft/quorum_view.py): QuorumNews;
  accounting (accounting/accounts.py): the status, progress, goodput and checkpoints.
Must never import torch on the main thread before the workers have started,
and never wait on the queue outside the loop.
"""

from __future__ import annotations

import os
import queue
import signal
import time
from typing import Optional, Union

from ftrun.config import RunConfig, hang_after_s, store_listen_addr
from ftrun.exits import EXIT_FAILED
from ftrun.supervisor.accounting import checkpoints
from ftrun.supervisor.accounting.accounts import Accounting
from ftrun.supervisor.accounting.waits import Waits, replica_waits
from ftrun.supervisor.ft.quorum_view import QuorumView
from ftrun.supervisor.loop import start
from ftrun.supervisor.loop.signals import RunSignals
from ftrun.supervisor.loop.table import WorkerTable
from ftrun.supervisor.nodes.coordinator import NodeCoordinator
from ftrun.supervisor.nodes.node_common import NodeEvent
from ftrun.supervisor.nodes.node_decisions import NodeNews, RemoteFailure, StoreMoved, can_reform
from ftrun.supervisor.relay import NodeRelay
from ftrun.supervisor.policy.failure_policy import FailurePolicy
from ftrun.supervisor.policy.failures import ReplicaOutcome, WorkerFailures, training_over
from ftrun.supervisor.policy.hangs import find_hung
from ftrun.supervisor.policy.restart import Repeats
from ftrun.supervisor.policy.stopping import AfterStop, AskSave, EndGrace, Stopper, StopRun, forwarded_signals
from ftrun.supervisor.ft.quorum import QuorumKeeper
from ftrun.supervisor.store import RunStore, open_run_store
from ftrun.supervisor.workers.env import error_file, log_dir, stacks_file, worker_env
from ftrun.supervisor.workers.logs import ConsoleOut, Pump, drain, open_pipes
from ftrun.supervisor.workers.spawn import WorkerExited, Spawned, SpawnerDied, SpawnerWarning, ZygoteSpawner
from ftrun.supervisor.workers.worker import Failure, Worker, WorkerState

TICK_S = 0.25
STORE_READY_TIMEOUT_S = 30.0

Action = Union[StopRun, EndGrace, AskSave, ReplicaOutcome, RemoteFailure, StoreMoved, NodeEvent, None]


class Supervisor:
    """One node's agent: the loop, the worker table, and the components it asks. Only the loop's
    thread touches it (a signal handler only posts to the queue, through the Stopper)."""

    def __init__(self, cfg: RunConfig, store: Optional[RunStore] = None,
                 zygote: Optional[ZygoteSpawner] = None, standby: Optional[RunStore] = None,
                 repeats: Optional[Repeats] = None, signals: Optional[RunSignals] = None) -> None:
        self.cfg = cfg
        # c10d: the run's signals are caught once for all its rounds (ftrun.supervisor.loop.signals);
        # a lone Supervisor catches its own.
        self._given_signals = signals
        # c10d: the rendezvous already hosts or joined the run's store, and started a zygote
        # while it waited for the other nodes, so torch's import is not paid after the join.
        self._given_store = store
        self._given_zygote = zygote
        self._given_standby = standby  # c10d without --ft: where the store may move between rounds
        self.events: "queue.SimpleQueue" = queue.SimpleQueue()
        self.console = ConsoleOut.for_config(cfg)
        # Before anything starts (a log folder included): a second live run on the folder is refused.
        self.folder_lock = start.lock_folder(cfg, self.console)
        self.log_dir = log_dir(cfg)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.table = WorkerTable(cfg.node_rank, cfg.nproc, self.log_dir)
        self.workers = self.table.workers
        # c10d re-forms the run in rounds, each with its own Supervisor: `repeats` spans them.
        self.policy = FailurePolicy(cfg.ft, cfg.max_restarts, cfg.min_replicas, repeats)
        self.failures = WorkerFailures(cfg, self.console, self.policy)
        self.stopper = Stopper(cfg, self.console, self.events)
        self.node_news = NodeNews(cfg, self.console)
        # --ft: a replica is `k` workers (global ranks jk .. jk+k-1) that fail, stop and restart as one.
        self.k = cfg.replica_size if cfg.ft else 1
        self.quorum_view = QuorumView(self.console, self.k)
        self.books = Accounting(cfg, self.console, self.policy.name, str(self.log_dir), self._reports_store)
        self.waits = Waits(self.console)  # progress of ftrun's own long waits, on a terminal only
        self._last_poll = 0.0
        self._last_progress = 0.0
        self.store: Optional[RunStore] = None
        # --ft: the supervisor keeps the quorum (ftrun.supervisor.ft.quorum).
        self.quorum: Optional[QuorumKeeper] = None
        self.tick_s = 0.05 if cfg.ft else TICK_S
        self.default_hang_s, _ = hang_after_s(os.environ)  # refused at the start when not a number
        # Several machines: join, node liveness, group restarts agreed across nodes (ftrun.supervisor.nodes.coordinator).
        self.nodes: Optional[NodeCoordinator] = None
        self.relay: Optional[NodeRelay] = None
        # c10d without --ft: the agent ended this round so that the nodes re-form the run
        # (ftrun.supervisor.nodes.rendezvous runs the next round only when this says so).
        self.reform = False
        self.store_lost = False  # ...because the run's store went away with its node (it moves first)

    # ---------------------------------------------------------------- start
    def run(self) -> int:
        cfg = self.cfg
        signals = self._given_signals or RunSignals(forwarded_signals(cfg))
        if self._given_signals is None:
            signals.install()
        signals.deliver_to(self.stopper.on_signal)
        try:
            return self._run()
        finally:
            signals.deliver_to(None)  # between rounds the rendezvous's waits read it (loop/c10d.py)

    def _run(self) -> int:
        cfg = self.cfg
        self.store = self._given_store or open_run_store(cfg, store_listen_addr(cfg))
        if cfg.nnodes > 1 or cfg.admits_late:  # alone, an elastic --ft run still takes late nodes in
            self.nodes = NodeCoordinator(cfg, self.store, self.console, lambda: self.events.put(("nodes", None)),
                                         self.stopper.wait_signal, self._given_standby, self.waits)
        self.common, self.relay = start.workers_common(cfg, self.store, self.nodes)
        self.cwd = os.getcwd()
        self.spawner = start.spawner(cfg, self.events, self.common, self.cwd, self._given_zygote)
        metrics_url = self.books.start_metrics()
        self._write_state()
        self.console.note(
            f"run {cfg.run_id}: {cfg.nproc} worker{'s' if cfg.nproc != 1 else ''} of {cfg.script}"
            f"{' (' + self.policy.name + ', ' + str(cfg.max_restarts) + ' restarts)' if cfg.max_restarts else ''}"
            f"{', hook ' + cfg.hook.describe() if cfg.hook else ''}; logs in {self.log_dir}",
            style="bold blue")
        if metrics_url:
            self.console.note(f"metrics at {metrics_url}", style="blue")
        code: Optional[int] = EXIT_FAILED
        try:
            # With several nodes, no worker starts anywhere before every node has joined.
            code = self.nodes.join() if self.nodes is not None else None
            self.waits.sync({}, time.time())
            if code is not None and self.nodes.summary:
                self.books.summary(self.nodes.summary)
            if code is None and cfg.ft:
                self.quorum = start.first_quorum(cfg, self.store, self.nodes, [w.rank for w in self.workers], self.k)
            if code is None:
                for w in self.workers:
                    self._spawn(w)
                code = self._loop()
        finally:
            code = EXIT_FAILED if code is None else code
            self._finish(code)
        return code

    def _to_group_restarts(self) -> None:
        """--ft on a script that never joins a quorum (QuorumView.plain_script): the run goes on as
        without --ft, group restarts; restarted workers get no --ft patches, so torch's own
        init_process_group forms their default group."""
        self.policy.to_group_restarts()
        self.books.policy(self.policy.name)
        self.k, self.quorum = 1, None
        self.common["FTRUN_FT"] = "0"  # the workers' --ft switch (ftrun.supervisor.workers.env, ftrun.worker.settings)
        for w in self.workers:
            if w.state == WorkerState.STARTING and w.first_step_seen:
                self.table.mark(w, WorkerState.RUNNING)

    def _spawn(self, w: Worker) -> None:
        env = worker_env(self.common, self.cfg, w.spec.local_rank, w.incarnation)
        try:  # a previous incarnation's error is not this one's
            error_file(self.cfg, w.rank).unlink()
        except OSError:
            pass
        (out_r, out_w), (err_r, err_w) = open_pipes()
        log = self.table.logs[w.rank]
        banner = f"===== ftrun: rank {w.rank}, incarnation {w.incarnation}, {time.strftime('%Y-%m-%d %H:%M:%S')} =====\n"
        w.pumps = [Pump(out_r, log.stdout_path, w.rank, self.console, False, banner),
                   Pump(err_r, log.stderr_path, w.rank, self.console, True, banner)]
        # A new attempt counts its own steps; with --ft the step is global.
        ft = self.quorum is not None  # --ft, and the script uses ftrun.ft (QuorumView.plain_script)
        self.table.started(w, WorkerState.RECOVERING if ft and w.incarnation else WorkerState.STARTING, keep_steps=ft)
        self.books.ledger.spawned(w, time.time())
        self.books.progress.forget(w.rank)
        if self.quorum is not None:
            self.quorum.on_spawn(w.rank, w.incarnation)
        try:
            self.spawner.spawn(w.tag, start.argv(self.cfg), env, self.cwd, out_w, err_w)
        finally:
            os.close(out_w)
            os.close(err_w)
        self.books.changed()

    # ---------------------------------------------------------------- loop
    def _loop(self) -> int:
        while (result := self._step()) is None:
            pass
        return result

    def _step(self) -> Optional[int]:
        """One turn of the loop: at most one event, the tick, then what the turn leads to;
        ftrun's exit status once the run is over."""
        try:
            self._handle(self.events.get(timeout=max(0.0, self._tick_timeout())))
        except queue.Empty:
            pass
        self._tick()
        # While workers stop, the other nodes wait: a restart's barrier notices a lost
        # node, and a run that ends has nothing left to decide.
        if self.stopper.current is None and self.nodes is not None:
            self._apply(self.nodes.check())
        if self.stopper.saving is not None and self.stopper.current is None:
            self._apply(self.stopper.check_saving(self.store, any(w.alive for w in self.workers)))
        if self.stopper.current is not None:
            return self._advance_stop()
        if all(w.state in (WorkerState.DONE, WorkerState.FAILED) for w in self.workers):
            out = self.failures.run_ended(self.workers)
            return self._give_up(out.report, out.early_exits) if out.report is not None else out.code
        return None

    def _tick_timeout(self) -> float:
        now = time.time()
        deadlines = [w.kill_at for w in self.workers if w.kill_at]
        if self.stopper.current is not None:
            deadlines.append(self.stopper.current.give_up_at)
        nxt = min([self._last_poll + self.tick_s] + deadlines)
        return max(0.0, min(self.tick_s, nxt - now))

    def _handle(self, ev) -> None:
        if isinstance(ev, tuple) and ev[0] == "signal":
            can_save = (self.quorum is not None and self.quorum.leader
                        and not any(w.state == WorkerState.DONE for w in self.workers))
            self._apply(self.stopper.on_stop_signal(ev[1], can_save))
            self.books.changed()
        elif isinstance(ev, Spawned):
            st = self.stopper.current
            if self.table.on_spawned(ev, st.sig if st else None):
                self.books.changed()
        elif isinstance(ev, SpawnerWarning):
            self.console.note(ev.message, style="yellow")
        elif isinstance(ev, SpawnerDied):
            self._on_spawner_died(ev)
        elif isinstance(ev, WorkerExited):
            self._on_exit(ev)

    def _tick(self) -> None:
        now = time.time()
        self.table.kill_overdue(now)
        poll = now - self._last_poll >= self.tick_s * 0.9
        if poll:
            self._last_poll = now
        # While workers stop nothing is read from the store: it may be what went away (a
        # read would then hold up the SIGKILL deadlines), and no decision waits on progress.
        if poll and self.stopper.current is None:
            # Progress and hangs a few times a second; with --ft the quorum (joins, failed
            # votes for the dead) every tick. Every store read here takes CPU from the workers.
            if now - self._last_progress >= TICK_S * 0.9:
                self._last_progress = now
                self._poll_progress(now)
                if self.cfg.step_timeout != 0:
                    self._check_hangs(now)
                if self.quorum is not None and self.waits.enabled:
                    q = self.quorum
                    self.waits.sync(replica_waits(q.info, q.alive, self.k, q.local), now)
            if self.quorum is not None:
                news = self.quorum_view.poll(self.quorum, self.relay, self.workers, self.books.progress, now,
                                             self.nodes is not None, self.books.status.quorum_id)
                if self.cfg.checkpoint_dir and now == self._last_progress:
                    self.books.poll_checkpoint(self.store)  # a few times a second, with the progress poll
                self.table.mark_ranks(news.training, WorkerState.RUNNING)
                if news.to_group:
                    self._to_group_restarts()
                if news.changed:
                    self.books.changed()
                if self.quorum is not None and self.nodes is not None and self.nodes.waiting:
                    self.node_news.admit_waiting(self.quorum, self.nodes)
        self.books.tick(self.workers, self.quorum, self.nodes, now)

    def _poll_progress(self, now: float) -> None:
        if self.books.store_found(self.store):
            self._on_store_ready()
        self.table.mark_ranks(self.books.read_progress(self.store, self.workers, self.quorum is not None, now),
                              WorkerState.RUNNING)

    def _reports_store(self) -> RunStore:
        """Where this node's workers report progress: the node's own store when it relays their
        reports (ftrun.supervisor.relay), else the run's."""
        return self.nodes.node_store if self.relay is not None else self.store

    def _on_store_ready(self) -> None:
        if self.quorum is not None:
            self.quorum.on_store_ready()
        self.books.progress.seed([w.rank for w in self.workers])

    def _check_hangs(self, now: float) -> None:
        """Name and kill hung workers (ftrun.supervisor.policy.hangs says which, and why)."""
        explicit = self.cfg.step_timeout is not None
        limit = self.cfg.step_timeout if explicit else self.default_hang_s
        for hung in find_hung(self.workers, now, limit, explicit, self.k, self.quorum):
            self.books.ledger.hung(hung.worker, now, limit)
            self.table.hung(hung.worker, hung.reason, now, stacks_file(self.cfg, hung.worker.rank), self.console)
            self.books.changed()

    def _write_state(self) -> None:
        self.books.write(self.workers, self.quorum, self.nodes)

    # ---------------------------------------------------------------- exits and failures
    def _on_spawner_died(self, ev: SpawnerDied) -> None:
        stop, gone = self.stopper.spawner_died(ev, self.workers)
        self._apply(stop)
        for w in gone:
            self._stopped(w)

    def _on_exit(self, ev: WorkerExited) -> None:
        w = self.table.on_exit(ev)
        if w is None:
            return  # an old incarnation that was already accounted for
        if w.stop_requested:
            self._stopped(w)
            return
        over = self.quorum is not None and training_over(self.store)
        if self.quorum is not None:
            # first: the survivors may be waiting for its vote. Past the run's last step it left the
            # loop, whatever it did after: no quorum may start without it (nobody trains again).
            self.quorum.on_exit(w.rank, w.incarnation, finished=over or ev.exit_code == 0 and not w.hang_reason)
        for p in w.pumps:
            p.done.wait(0.5)
        self.books.changed()
        if ev.exit_code == 0 and not w.hang_reason:
            self.table.mark(w, WorkerState.DONE)
            w.finished_at = time.time()
            self.books.ledger.done(w, w.finished_at)
            return
        tail = list(w.pumps[1].tail) if len(w.pumps) > 1 else []
        stop = self.failures.cannot_go_on(w, ev, tail)
        if stop is not None:
            self.table.mark(w, WorkerState.FAILED)
            self._apply(stop)
            return
        failure = self.failures.describe(w, ev, tail, self.k, self.quorum is not None, self.workers,
                                         str(self.table.logs[w.rank].stderr_path))
        self.books.ledger.failed(w, failure, time.time(), ev.seen)
        if over:
            self.table.mark(w, WorkerState.FAILED)
            self.failures.after_training(w, failure)
            return
        self._on_failure(w, failure)

    def _on_failure(self, w: Worker, failure: Failure) -> None:
        # a script without ftrun.ft under --ft gets group restarts (QuorumView.plain_script)
        if self.quorum_view.plain_script(self.quorum, self.workers, self.nodes is not None):
            self._to_group_restarts()
        if self.policy.group:
            self.table.mark(w, WorkerState.FAILED)
            self._apply(self._group_restarting(
                self.failures.group_failed(w, failure, None, self.nodes, self.workers, can_reform(self.cfg)), w))
        else:
            out = self.failures.replica_failed(w, failure, self.workers, self.k, self.stopper.saving is not None)
            self.table.mark(w, out.state)
            self._apply(out)

    def _group_restarting(self, action: Action, failed: Optional[Worker] = None) -> Action:
        """A group restart's stop: the failed worker and every live one show as restarting while they stop."""
        if isinstance(action, StopRun) and action.then is AfterStop.RESTART_GROUP:
            for o in self.workers:
                if o is failed or o.alive:
                    self.table.mark(o, WorkerState.RESTARTING)
        return action

    def _apply(self, action: Action) -> None:
        """Carry out what a component decided."""
        if isinstance(action, StopRun):
            if action.summary is not None:
                self.books.summary(action.summary)
            self.reform = self.reform or action.reform
            self.store_lost = self.store_lost or action.store_lost
            if action.then is AfterStop.RESTART_GROUP:
                self._write_state()  # `ftrun status` shows the restart while the group stops
            self.table.stop(self.stopper.begin(self.table.running(), action), action.sig, action.grace, time.time())
            self.books.changed()
        elif isinstance(action, EndGrace):
            self.table.kill(self.stopper.waiting_for())
        elif isinstance(action, AskSave):
            try:
                writer = self.quorum.stop() if self.quorum is not None else None
            except Exception:  # noqa: BLE001 - the store is gone: nothing can coordinate a save
                writer = None
            self._apply(self.stopper.save_or_stop(action.signum, writer))
        elif isinstance(action, ReplicaOutcome):
            self._replica_outcome(action)
        elif isinstance(action, RemoteFailure):
            self.books.ledger.remote_failure(action.failure, time.time())
            self._apply(self._group_restarting(self.failures.group_failed(None, None, action.failure, self.nodes,
                                                                          self.workers, can_reform(self.cfg))))
        elif isinstance(action, StoreMoved):
            self.quorum = action.quorum
            self.common.update(action.env)
            self._on_store_ready()
            self.node_news.publish_move(action, self.nodes, self.relay)
            self.books.changed()
        elif isinstance(action, NodeEvent):
            self._apply(self.node_news.on_event(action, self.nodes, self.quorum, self.workers, self.store, self.k))

    def _replica_outcome(self, out: ReplicaOutcome) -> None:
        """--ft: the failed replica's other workers are SIGKILLed at once (nothing of theirs is worth a
        grace, and a collective with their dead peer would hold them, NCCL included)."""
        replica = self.table.replica(out.replica, self.k)
        self.table.kill_replica(out.replica, self.k, out.state)
        if out.given_up:
            self.books.ledger.given_up(next(o for o in replica if o.rank == out.rank), time.time())
        if out.restart:
            for o in replica:
                o.restarts = out.restarts
            self._write_state()  # `ftrun status` shows it restarting, then recovering, then running
            self.table.restart_later(out.replica)
            self._respawn_replicas()
        if out.then is not None:
            self._apply(out.then)

    def _respawn_replicas(self) -> None:
        """Start every replica whose restart waits, once the last of its old processes is gone."""
        if self.stopper.current is None:
            for o in self.table.respawns(self.k):
                self._spawn(o)

    def _stopped(self, w: Worker) -> None:
        """A worker being stopped is gone (its exit seen, or counted as gone)."""
        self.table.gone(w)
        self.stopper.gone(w)
        w.kill_at = None
        self.books.ledger.stopped(w, time.time())
        if w.state not in (WorkerState.RESTARTING, WorkerState.FAILED):
            self.table.mark(w, WorkerState.STOPPED)
        if self.quorum is not None:
            self.quorum.on_exit(w.rank, w.incarnation)
        for p in w.pumps:
            p.done.wait(0.5)
        self.books.changed()
        self._respawn_replicas()

    def _advance_stop(self) -> Optional[int]:
        """After each turn while stopping: once the last worker is gone, do what the stop was
        for; ftrun's exit status when that ends the run."""
        overdue = self.stopper.overdue(time.time())
        if overdue and isinstance(self.spawner, ZygoteSpawner):
            self.spawner.close()  # workers die with their zygote (parent-death signal)
            if self.stopper.current.then is AfterStop.RESTART_GROUP:
                self.stopper.exit_instead(EXIT_FAILED)  # no zygote, no new attempt
        for w in overdue:
            self._stopped(w)
        st = self.stopper.finished()
        if st is None:
            return None
        if st.then is AfterStop.RESTART_GROUP:
            return self._restart_group(st.code)
        if st.then is AfterStop.REPORT:
            return self._give_up(st.failure)
        return st.code

    def _restart_group(self, code: int) -> Optional[int]:
        """Every worker of this node has stopped: start the next attempt once every node has
        (`code`: the failure's status, for a node that ended meanwhile); else ftrun's exit status."""
        attempt = self.nodes.attempt if self.nodes is not None else 0
        if self.nodes is not None:
            waited = self.nodes.attempt_barrier(code)
            if isinstance(waited, NodeEvent):
                self._apply(waited)
                return None
            if waited is not None:
                return waited
        elif self.store is not None and self.store.wait(STORE_READY_TIMEOUT_S):
            try:
                self.store.clear_worker_keys()
            except Exception as e:  # the attempt may still work; say why it might not
                self.console.note(f"could not clear the store between attempts: {e}", style="yellow")
        # Where each rank stopped and last saved (the steps this attempt lost); rank 0's from node 0
        # on another node (its checkpoint is usually saved there), kept before the next attempt.
        self.books.read_last_reports(self.workers, self.quorum)
        rank0 = self.nodes.rank0_report(attempt) if self.nodes is not None and self.cfg.node_rank != 0 else None
        self.books.ledger.group_restart(time.time(), rank0)
        self.books.group_restarted(self.policy.group_restarts)
        for o in self.workers:
            o.incarnation = self.policy.group_restarts
            o.restarts = self.policy.group_restarts
            self._spawn(o)
        self.failures.new_attempt()
        return None

    def _give_up(self, failure: Failure, early_exits: bool = True) -> int:
        """The failure report; ftrun's exit status."""
        drain([p for w in self.workers for p in w.pumps])  # the report comes after the workers' lines
        self.books.fill_goodput(end=True)  # the goodput summary, before the report: the report is the last word
        self.console.renderable(self.failures.report(failure, self.workers, early_exits))
        return (self.failures.first_failure or failure).status_code

    def _finish(self, code: int) -> None:
        # Nothing may outlive ftrun: whatever still runs (the loop was left by an error, or a
        # stop is under way) is killed now, by the same stopping state the loop drives.
        self.waits.close()
        if self.stopper.current is not None:
            self.stopper.exit_instead(code)
            self.table.kill(self.stopper.waiting_for())
        elif self.table.running():
            self._apply(StopRun(signal.SIGKILL, 0.0, AfterStop.EXIT, code))
        while self.stopper.current is not None:
            self._step()
        if self.relay is not None:
            try:  # the workers' last reports, while the run's store is surely up: node 0 waits in leave()
                self.relay.push_reports()
            except Exception:
                pass
        if self.nodes is not None:
            self.nodes.leave(code)
        for w in self.workers:
            for p in w.pumps:
                p.done.wait(1.0)
        self.spawner.close()
        self.books.read_last_reports(self.workers, self.quorum)
        if self.cfg.checkpoint_dir and self.store is not None and self.store.store is not None and \
                (code == 0 or self.stopper.signalled is not None):
            self.books.poll_checkpoint(self.store)  # the last one was published a moment before its writer exited
        if self.folder_lock is not None:
            self.folder_lock.release()
        self.books.ended(code, self.failures.first_failure)
        self._write_state()
        if code == 0:
            self.console.note(f"run {self.cfg.run_id} finished in {time.time() - self.books.started:.1f} s",
                              style="bold green")
        self.books.fill_goodput(end=True)  # the books closed, the timeline's last write, the summary
        self._write_state()
        for line, style in checkpoints.last_lines(self.books.status.checkpoint):
            self.console.note(line, style=style)


def run_supervisor(cfg: RunConfig) -> int:
    """Run `cfg` to the end; returns ftrun's exit status."""
    return Supervisor(cfg).run()
