"""The supervisor: start the workers, watch them, restart them, stop them, report.

One event loop on one queue: worker exits (from the spawner, within
milliseconds), forwarded signals, and a 0.25 s tick that reads progress from
the store (hang detection, live status). The loop is the only code that
changes worker states and the only consumer of the queue; the event sources
only report (the spawner's events, ProgressReader, find_hung, the node
coordinator's check(), the quorum keeper), the loop decides, and the spawner,
the stopping state and the stores carry the decisions out. torch elastic's
`_invoke_run` is the pattern. The loop's decisions are grouped by topic in
mixins over its one state: stopping (stopping.py), worker failures and
restarts (failures.py), other nodes' news (node_decisions.py), the --ft
quorum's view (ft_follow.py).
Must never import torch on the main thread before the workers have started,
and never wait on the queue outside the loop.
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import time
from typing import Dict, List, Optional

from ftrun.config import RunConfig, hang_after_s, store_listen_addr
from ftrun.protocol import DUMP_STACKS_SIGNAL, EXIT_FAILED, NODE_RANKS_ENV, NODE_STORE_ENV
from ftrun.status.state import RunPhase, RunStatus, run_dir, run_folder_name
from ftrun.supervisor import activity, checkpoints, folder_lock
from ftrun.supervisor.env import base_env, common_env, error_file, log_dir, stacks_file, worker_env
from ftrun.supervisor.failures import FailureDecisions
from ftrun.supervisor.ft_follow import QuorumFollow
from ftrun.supervisor.hangs import HANG_DUMP_GRACE_S, find_hung
from ftrun.supervisor.ledger import Ledger
from ftrun.supervisor.logs import ConsoleOut, Pump, RankLog, open_pipes
from ftrun.supervisor.node_decisions import NodeDecisions
from ftrun.supervisor.nodes import NodeCoordinator
from ftrun.supervisor.progress_reader import ProgressReader, note_steps
from ftrun.supervisor.quorum import QuorumKeeper
from ftrun.supervisor.relay import NodeRelay
from ftrun.supervisor.restart import GroupRestartPolicy, ReplicaRestartPolicy, Repeats
from ftrun.supervisor.spawn import (PopenSpawner, Spawned, SpawnerDied, SpawnerWarning, ZygoteSpawner, WorkerExited,
                                   signal_group)
from ftrun.supervisor.status_writer import StatusWriter
from ftrun.supervisor.stopping import AfterStop, StopControl, Stopping, forwarded_signals
from ftrun.supervisor.store import RunStore, open_run_store
from ftrun.supervisor.waits import Waits, replica_waits
from ftrun.supervisor.worker import Failure, Worker, WorkerSpec, WorkerState

TICK_S = 0.25


class Supervisor(StopControl, FailureDecisions, NodeDecisions, QuorumFollow):
    """One node's agent. Its state (the workers' records, the policy, the quorum keeper, the
    stopping state, the status) is set here and shared by the loop's decisions in the mixins;
    only the loop's thread touches it (a signal handler only posts to the queue)."""

    def __init__(self, cfg: RunConfig, store: Optional[RunStore] = None,
                 zygote: Optional[ZygoteSpawner] = None, standby: Optional[RunStore] = None,
                 repeats: Optional[Repeats] = None) -> None:
        self.cfg = cfg
        # c10d: the rendezvous already hosts or joined the run's store, and started a zygote
        # while it waited for the other nodes, so torch's import is not paid after the join.
        self._given_store = store
        self._given_zygote = zygote
        self._given_standby = standby  # c10d without --ft: where the store may move between rounds
        self.stopped_by_signal: Optional[int] = None
        self.stopping: Optional[Stopping] = None
        self.events: "queue.SimpleQueue" = queue.SimpleQueue()
        self.console = ConsoleOut.for_config(cfg)
        self.folder_lock: Optional[folder_lock.FolderLock] = None
        if cfg.ft and cfg.checkpoint_dir and cfg.node_rank == 0:
            # Before anything starts (a log folder included): a second live run on the folder is
            # refused in one line (ConfigError: exit 2).
            self.folder_lock = folder_lock.acquire(cfg.checkpoint_dir, cfg.run_id,
                                                   lambda m: self.console.note(m, style="yellow"))
            count, size = folder_lock.remove_partials(cfg.checkpoint_dir)
            if count:
                self.console.note(f"removed {count} partial checkpoint folder{'s' if count != 1 else ''} that killed "
                                  f"writes left in {cfg.checkpoint_dir} ({size / 1e6:.1f} MB)", style="yellow")
        self.run_dir = run_dir(run_folder_name(cfg.run_id, cfg.nnodes, cfg.node_rank))
        self.log_dir = log_dir(cfg)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.workers = [Worker(WorkerSpec(lr, cfg.node_rank * cfg.nproc + lr)) for lr in range(cfg.nproc)]
        self.logs = {w.rank: RankLog(self.log_dir, w.rank) for w in self.workers}
        self.by_tag: Dict[str, Worker] = {}
        # c10d re-forms the run in rounds, each with its own Supervisor: `repeats` spans them.
        self.policy = (ReplicaRestartPolicy(cfg.max_restarts, cfg.min_replicas) if cfg.ft
                       else GroupRestartPolicy(cfg.max_restarts, repeats=repeats or Repeats()))
        # --ft: a replica is `k` workers (global ranks jk .. jk+k-1) that fail, stop and restart as one.
        self.k = cfg.replica_size if cfg.ft else 1
        self.respawning: Dict[int, bool] = {}  # replica -> restart pending until its last worker is gone
        self.first_failure: Optional[Failure] = None
        self.after_loop: List[Failure] = []  # --ft: failures after the run's last step (failures.py)
        self.started = time.time()
        self.status = RunStatus(
            run_id=cfg.run_id, script=cfg.script, argv=list(sys.argv), started=self.started, pid=os.getpid(),
            hook=cfg.hook.describe() if cfg.hook else None, policy=self.policy.name,
            max_restarts=cfg.max_restarts, nproc=cfg.nproc, nnodes=cfg.nnodes, node_rank=cfg.node_rank,
            log_dir=str(self.log_dir),
        )
        self.state_path = self.run_dir / "state.json"
        self.ledger = Ledger(cfg, self.started, self.run_dir, self.console)  # goodput, timeline, metrics
        self.writer = StatusWriter(self.status, self.state_path, self.ledger, self.console, cfg.node_rank)
        self.waits = Waits(self.console)  # progress of ftrun's own long waits, on a terminal only
        self._dirty = True
        self._last_write = 0.0
        self._last_poll = 0.0
        self._last_progress = 0.0
        self._last_metrics = 0.0
        self.progress = ProgressReader(self._reports_store)
        self._checkpoints = checkpoints.CheckpointWatch()
        self._sampler = activity.ProcessSampler()
        self.store: Optional[RunStore] = None
        self._store_announced = False
        # --ft: the supervisor keeps the quorum (ftrun.supervisor.quorum).
        self.quorum: Optional[QuorumKeeper] = None
        self.tick_s = 0.05 if cfg.ft else TICK_S
        # How often the state file may be rewritten while something changes: with --ft the step
        # moves every tick, and `ftrun status` must show the current one (a write is a small file).
        self.write_s = 0.1 if cfg.ft else 0.2
        self.default_hang_s, _ = hang_after_s(os.environ)  # refused at the start when not a number
        self._warned_no_ft_api = False
        self.give_up_why: Optional[str] = None  # why the run ends with a failure, when not a spent budget
        # Several machines: join, node liveness, group restarts agreed across nodes (ftrun.supervisor.nodes).
        self.nodes: Optional[NodeCoordinator] = None
        self._told_full = False
        self._admitted_at = 0.0
        self._quorum_failing = False  # said once until a poll works again
        # c10d without --ft: the agent ended this round so that the nodes re-form the run
        # (ftrun.supervisor.rendezvous runs the next round only when this says so).
        self.reform = False
        self.store_lost = False  # ...because the run's store went away with its node (it moves first)
        self.saving: Optional[checkpoints.SaveBeforeStop] = None

    # ---------------------------------------------------------------- start
    def run(self) -> int:
        for sig in forwarded_signals(self.cfg):
            signal.signal(sig, self._on_signal)
        cfg = self.cfg
        host = cfg.master_addr
        self.store = self._given_store or open_run_store(cfg, store_listen_addr(cfg))
        port = self.store.port
        if cfg.nnodes > 1 or cfg.admits_late:  # alone, an elastic --ft run still takes late nodes in
            self.nodes = NodeCoordinator(cfg, self.store, self.console, lambda: self.events.put(("nodes", None)),
                                         self._signalled, self._given_standby)
        self.common = common_env(cfg, host, port, base_env())
        self.common.pop(NODE_STORE_ENV, None)  # ours alone: one the user's shell had means nothing here
        self.common.pop(NODE_RANKS_ENV, None)
        self.relay: Optional[NodeRelay] = None
        if cfg.ft and self.nodes is not None and self.nodes.node_store is not None:
            # This node's own store: its workers vote and report through it (ftrun.supervisor.relay),
            # and learn there the run's store's next address, should it move.
            node_store = self.nodes.node_store
            self.common[NODE_STORE_ENV] = f"{node_store.host}:{node_store.port}"
            self.common[NODE_RANKS_ENV] = f"{cfg.node_rank} {cfg.node_rank * cfg.nproc} {cfg.nproc}"
            self.relay = NodeRelay(cfg.node_rank, self._node_ranks(cfg.node_rank), lambda: node_store.store,
                                   lambda: self.store.store)
        cwd = os.getcwd()
        self.cwd = cwd
        use_zygote = not cfg.no_python and os.environ.get("FTRUN_ZYGOTE", "1") != "0"
        if use_zygote and self._given_zygote is not None:
            self.spawner = self._given_zygote
            self.spawner.events = self.events  # nothing is posted before the first spawn but "ready"
        elif use_zygote:
            self.spawner = ZygoteSpawner(self.events, self.common, cwd)
        else:
            self.spawner = PopenSpawner(self.events)
        self.use_zygote = use_zygote
        self.status.metrics_url = self.ledger.start_metrics()
        self._write_state()
        self.console.note(
            f"run {cfg.run_id}: {cfg.nproc} worker{'s' if cfg.nproc != 1 else ''} of {cfg.script}"
            f"{' (' + self.policy.name + ', ' + str(cfg.max_restarts) + ' restarts)' if cfg.max_restarts else ''}"
            f"{', hook ' + cfg.hook.describe() if cfg.hook else ''}; logs in {self.log_dir}",
            style="bold blue")
        if self.status.metrics_url:
            self.console.note(f"metrics at {self.status.metrics_url}", style="blue")
        code: Optional[int] = EXIT_FAILED
        try:
            # With several nodes, no worker starts anywhere before every node has joined.
            if self.nodes is not None:
                self.nodes.waits = self.waits
            code = self.nodes.join() if self.nodes is not None else None
            self.waits.sync({}, time.time())
            if code is not None and self.nodes.summary:
                self.status.exit_summary = self.nodes.summary
            if code is None and cfg.ft:
                # Node 0 keeps the quorum of every rank; other nodes report to it through the store.
                live = self.nodes.live if self.nodes is not None else [0]
                self.quorum = QuorumKeeper(self.store, [r for k in live for r in self._node_ranks(k)],
                                           [w.rank for w in self.workers], leader=cfg.node_rank == 0,
                                           replica_size=self.k, routes=self._routes(live))
                if cfg.checkpoint_dir:
                    self.quorum.fresh_start = "resuming from the newest checkpoint, if any"
            if code is None:
                for w in self.workers:
                    self._spawn(w)
                code = self._loop()
        finally:
            code = EXIT_FAILED if code is None else code
            self._finish(code)
        return code

    def _argv(self) -> List[str]:
        cfg = self.cfg
        target = (["-m", cfg.script] if cfg.module else [cfg.script]) + list(cfg.script_args)
        if self.use_zygote:
            return target
        if cfg.no_python:
            return [cfg.script] + list(cfg.script_args)
        return [sys.executable, "-m", "ftrun.worker.bootstrap"] + target

    def _to_group_restarts(self) -> None:
        """--ft on a script that never joins a quorum (ft_follow._check_ft_api): the run goes on as
        without --ft, group restarts; restarted workers get no --ft patches, so torch's own
        init_process_group forms their default group."""
        self.policy = GroupRestartPolicy(self.cfg.max_restarts, repeats=Repeats())
        self.status.policy = self.policy.name
        self.k, self.quorum = 1, None
        self.common["FTRUN_FT"] = "0"  # the workers' --ft switch (ftrun.supervisor.env, ftrun.worker.settings)
        for w in self.workers:
            if w.state == WorkerState.STARTING and w.first_step_seen:
                w.state = WorkerState.RUNNING
        self._dirty = True

    def _spawn(self, w: Worker) -> None:
        env = worker_env(self.common, self.cfg, w.spec.local_rank, w.incarnation)
        try:  # a previous incarnation's error is not this one's
            error_file(self.cfg, w.rank).unlink()
        except OSError:
            pass
        (out_r, out_w), (err_r, err_w) = open_pipes()
        log = self.logs[w.rank]
        banner = f"===== ftrun: rank {w.rank}, incarnation {w.incarnation}, {time.strftime('%Y-%m-%d %H:%M:%S')} =====\n"
        w.pumps = [Pump(out_r, log.stdout_path, w.rank, self.console, False, banner),
                   Pump(err_r, log.stderr_path, w.rank, self.console, True, banner)]
        # A new attempt counts its own steps; with --ft the step is global.
        ft = self.quorum is not None  # --ft, and the script uses ftrun.ft (ft_follow._check_ft_api)
        w.begin_incarnation(f"{w.rank}.{w.incarnation}.{time.monotonic_ns()}",
                            WorkerState.RECOVERING if ft and w.incarnation else WorkerState.STARTING,
                            keep_steps=ft)
        self.ledger.spawned(w, time.time())
        self.by_tag[w.tag] = w
        self.progress.forget(w.rank)
        if self.quorum is not None:
            self.quorum.on_spawn(w.rank, w.incarnation)
        try:
            self.spawner.spawn(w.tag, self._argv(), env, self.cwd, out_w, err_w)
        finally:
            os.close(out_w)
            os.close(err_w)
        self._dirty = True

    # ---------------------------------------------------------------- loop
    def _on_signal(self, signum, _frame) -> None:
        # A handler runs between any two bytecodes of the main thread, which may hold a lock
        # at that moment: only an attribute write and SimpleQueue.put (documented reentrant)
        # are safe here. threading.Event.set() deadlocked when the signal came inside Event.wait.
        self.stopped_by_signal = signum
        self.events.put(("signal", signum))

    def _signalled(self, timeout: float) -> Optional[int]:
        """For waits outside the loop (nodes joining, restart barriers): wait up to `timeout`
        (a poll interval); the stopping signal if one came. The loop's own queue is left alone."""
        if self.stopped_by_signal is None:
            time.sleep(timeout)
        return self.stopped_by_signal

    def _next_event(self, timeout: float):
        try:
            return self.events.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return None

    def _loop(self) -> int:
        while True:
            result = self._step()
            if result is not None:
                return result

    def _step(self) -> Optional[int]:
        """One turn of the loop: at most one event, the tick, then what the turn leads to;
        ftrun's exit status once the run is over."""
        ev = self._next_event(self._tick_timeout())
        if ev is not None:
            self._handle(ev)
        self._tick()
        # While workers stop, the other nodes wait: a restart's barrier notices a lost
        # node, and a run that ends has nothing left to decide.
        if self.stopping is None and self.nodes is not None:
            event = self.nodes.check()
            if event is not None:
                self._on_node_event(event)
        if self.saving is not None and self.stopping is None:
            self._check_saving()
        if self.stopping is not None:
            return self._advance_stop()
        if all(w.state in (WorkerState.DONE, WorkerState.FAILED) for w in self.workers):
            return self._run_ended()
        return None

    def _tick_timeout(self) -> float:
        now = time.time()
        deadlines = [w.kill_at for w in self.workers if w.kill_at]
        if self.stopping is not None:
            deadlines.append(self.stopping.give_up_at)
        nxt = min([self._last_poll + self.tick_s] + deadlines)
        return max(0.0, min(self.tick_s, nxt - now))

    def _handle(self, ev) -> None:
        if isinstance(ev, tuple) and ev[0] == "signal":
            self._on_stop_signal(ev[1])
        elif isinstance(ev, Spawned):
            w = self.by_tag.get(ev.tag)
            if w is not None:
                w.pid = ev.pid
                self._dirty = True
                if w.stop_requested:
                    # Asked to stop before its process existed; past the grace it gets SIGKILL.
                    if not signal_group(ev.pid, self.stopping.sig if self.stopping and w.kill_at else signal.SIGKILL):
                        # Just forked: not yet the leader of its own session (the group signal is
                        # lost) and still with the zygote's handlers (SIGINT ignored). It has run
                        # nothing of the script: SIGKILL, or it would run until the grace ends.
                        try:
                            os.kill(ev.pid, signal.SIGKILL)
                        except OSError:
                            pass
        elif isinstance(ev, SpawnerWarning):
            self.console.note(ev.message, style="yellow")
        elif isinstance(ev, SpawnerDied):
            self._on_spawner_died(ev)
        elif isinstance(ev, WorkerExited):
            self._on_exit(ev)

    # ---------------------------------------------------------------- tick
    # ---------------------------------------------------------------- tick
    def _tick(self) -> None:
        now = time.time()
        for w in self.workers:
            if w.kill_at and now >= w.kill_at:
                signal_group(w.pid, signal.SIGKILL)
                w.kill_at = None
        poll = now - self._last_poll >= self.tick_s * 0.9
        if poll:
            self._last_poll = now
        # While workers stop nothing is read from the store: it may be what went away (a
        # read would then hold up the SIGKILL deadlines), and no decision waits on progress.
        if poll and self.stopping is None:
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
                self._poll_quorum(now)
                if self.nodes is not None and self.nodes.waiting:
                    self._admit_waiting()
        if now - self._last_metrics >= 1.0:
            self._last_metrics = now
            self._sampler.sample(self.workers, now)
            self._dirty = True
        # Step counts change every tick with --ft: `ftrun status` needs them a few times a
        # second, not at the 20 Hz the quorum is polled (each write is a JSON file).
        if self._dirty and now - self._last_write >= self.write_s or now - self._last_write >= 0.5:
            self._write_state()

    def _poll_progress(self, now: float) -> None:
        st = self.store
        if st is None or not st.ready.is_set():
            return
        if st.store is None:
            if not self._store_announced:
                self._store_announced = True
                self.console.note(f"could not host the run's store: {st.error}", style="bold red")
            return
        if not self._store_announced:
            self._store_announced = True
            self._on_store_ready()
        for w, report in self.progress.read_new(self.workers):
            w.last_heartbeat = now
            w.note_activity(report.activity, now)
            self.ledger.progress(w, report, now)
            if w.state == WorkerState.STARTING and self.quorum is None:
                w.state = WorkerState.RUNNING
                self._dirty = True
            if note_steps(w, report.steps, now):
                self._dirty = True

    def _reports_store(self) -> RunStore:
        """Where this node's workers report progress: the node's own store when it relays their
        reports (ftrun.supervisor.relay), else the run's."""
        return self.nodes.node_store if self.relay is not None else self.store

    def _on_store_ready(self) -> None:
        if self.quorum is not None:
            self.quorum.on_store_ready()
        self.progress.seed([w.rank for w in self.workers])

    def _check_hangs(self, now: float) -> None:
        """Name and kill hung workers (ftrun.supervisor.hangs says which, and why)."""
        explicit = self.cfg.step_timeout is not None
        limit = self.cfg.step_timeout if explicit else self.default_hang_s
        for hung in find_hung(self.workers, now, limit, explicit, self.k, self.quorum):
            w = hung.worker
            w.hang_reason = hung.reason
            w.state = WorkerState.HUNG
            self.ledger.hung(w, now, limit)
            self.console.note(f"rank {w.rank} (pid {w.pid}) is {w.hang_reason}: killing it; its Python stacks "
                              f"go to {stacks_file(self.cfg, w.rank)}", style="bold red")
            if w.pid:
                try:
                    os.kill(w.pid, DUMP_STACKS_SIGNAL)
                except OSError:
                    pass
            w.kill_at = now + HANG_DUMP_GRACE_S
            self._dirty = True

    # ---------------------------------------------------------------- state
    def _write_state(self) -> None:
        self.writer.write(self.workers, self.quorum, self.nodes)
        self._last_write = time.time()
        self._dirty = False

    def _fill_goodput(self, end: bool = False) -> None:
        self.writer.fill_goodput(end)

    def _read_last_reports(self) -> None:
        """Take in the report each worker writes as it exits (ftrun.worker.progress), so the
        ended run's state says where every replica stopped, not where it was a beat earlier."""
        if not self._store_announced:
            return  # the keys were never created: a read would wait for them (for minutes)
        reports = self.progress.read_last(self.workers)
        if reports is None:
            return  # the store is gone: the last figures read stand
        for w, report in reports:
            w.steps = report.steps
            self.ledger.progress(w, report, time.time())
        if self.quorum is not None:
            try:
                self.quorum.poll(time.time())  # the replicas' last info: the run's final figures
            except Exception:
                pass

    def _finish(self, code: int) -> None:
        # Nothing may outlive ftrun: whatever still runs (the loop was left by an error, or a
        # stop is under way) is killed now, by the same stopping state the loop drives.
        self.waits.close()
        if self.stopping is not None:
            self.stopping.then, self.stopping.code = AfterStop.EXIT, code
            self._kill_stopping_now()
        elif any(self.by_tag.get(w.tag) is w for w in self.workers):
            self._begin_stop(signal.SIGKILL, 0.0, AfterStop.EXIT, code)
        while self.stopping is not None:
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
        self._read_last_reports()
        if self.cfg.checkpoint_dir and self.store is not None and self.store.store is not None and \
                (code == 0 or self.stopped_by_signal is not None):
            self._poll_checkpoint()  # the last one was published a moment before its writer exited
        if self.folder_lock is not None:
            self.folder_lock.release()
        self.status.phase = RunPhase.ENDED.value
        self.status.exit_code = code
        self.status.ended = time.time()
        if code == 0:
            self.status.exit_summary = "all workers finished"
        elif self.first_failure is not None:
            self.status.exit_summary = f"rank {self.first_failure.rank} {self.first_failure.reason}"
        else:
            self.status.exit_summary = f"stopped (exit {code})"
        self._write_state()
        if code == 0:
            self.console.note(f"run {self.cfg.run_id} finished in {time.time() - self.started:.1f} s", style="bold green")
        self._fill_goodput(end=True)  # the books closed, the timeline's last write, the summary
        self._write_state()
        for line, style in checkpoints.last_lines(self.status.checkpoint):
            self.console.note(line, style=style)


def run_supervisor(cfg: RunConfig) -> int:
    """Run `cfg` to the end; returns ftrun's exit status."""
    return Supervisor(cfg).run()
