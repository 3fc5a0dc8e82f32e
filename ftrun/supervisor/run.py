"""The supervisor: start the workers, watch them, restart them, stop them, report.

One event loop on one queue: worker exits (from the spawner, within
milliseconds), forwarded signals, and a 0.25 s tick that reads progress from
the store (hang detection, live status). The loop is the only code that
changes worker states and the only consumer of the queue; policies decide,
the spawner acts. Stopping is a state of the loop, not a wait of its own:
the workers are signalled, the loop goes on taking events (their exits, a
second signal that ends the grace) and enforcing the SIGKILL deadline, and
once the last of them has exited it carries out what the stop was for (end
the run, report the failure, restart the group).
Must never import torch on the main thread before the workers have started,
and never wait on the queue outside the loop.
"""

from __future__ import annotations

import enum
import os
import queue
import signal
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

import psutil

from ftrun.config import RunConfig, hang_after_s, store_listen_addr
from ftrun.status.state import ReplicaStatus, RunPhase, RunStatus, run_dir, run_folder_name, write_state
from ftrun.supervisor.env import base_env, common_env, log_dir, stacks_file, worker_env
from ftrun.supervisor import activity
from ftrun.supervisor.logs import ConsoleOut, Pump, RankLog, drain, open_pipes
from ftrun.supervisor.failover import NoMajority
from ftrun.supervisor.ledger import Ledger
from ftrun.supervisor.waits import Waits, replica_waits
from ftrun.supervisor.nodes import NODE_LOST, REQUEUE, NodeCoordinator, NodeEvent
from ftrun.supervisor.nodes import _one_line as nodes_one_line
from ftrun.supervisor.quorum import QuorumKeeper
from ftrun.supervisor.redirect import Redirect
from ftrun.supervisor.relay import NodeRelay, Routes
from ftrun.supervisor.report import early_signature, exit_reason, failure_report
from ftrun.supervisor.restart import Decision, GroupRestartPolicy, ReplicaRestartPolicy, Repeats
from ftrun.supervisor.spawn import (Exited, PopenSpawner, Spawned, SpawnerDied, SpawnerWarning, ZygoteSpawner,
                                   signal_group)
from ftrun.supervisor.store import STORE_TIMEOUT_S, RunStore, open_run_store
from ftrun.supervisor.worker import Failure, Worker, WorkerSpec, WorkerState
from ftrun.protocol import (DUMP_STACKS_SIGNAL, EXIT_CANNOT_GO_ON, EXIT_FAILED, EXIT_SIGNAL_BASE, EXIT_USAGE,
                            NODE_RANKS_ENV, NODE_STORE_ENV, RUN_STORE, progress_key)
from ftrun.supervisor import checkpoints, folder_lock
from ftrun.wire import NO_PROGRESS, ProgressReport

TICK_S = 0.25
HANG_DUMP_GRACE_S = 1.0
STORE_READY_TIMEOUT_S = 30.0
ADMIT_GAP_S = 1.0  # --ft, elastic: at most one late node taken in per this long (_admit_waiting)
# After SIGKILL a process is gone within milliseconds unless the kernel holds it (uninterruptible
# I/O); past this much longer the stop stops waiting for it.
KILL_WAIT_S = 10.0


# Why a failure is not restarted although budget is left (ftrun.supervisor.restart).
REPEATED = ("not restarted again: it failed the same way (the same exception at the same line) twice in a row "
            "right after start, before any step, which a restart cannot fix")


class AfterStop(enum.Enum):
    """What the loop does once every worker being stopped has exited."""

    EXIT = "end the run"                                 # with Stopping.code
    REPORT = "end the run with the failure report"       # of Stopping.failure
    RESTART_GROUP = "start the next attempt"             # once every node has stopped (attempt_barrier)


@dataclass
class Stopping:
    """The agent's stopping state: the workers signalled and not yet exited, and what comes next.

    Each worker's SIGKILL deadline is its own `kill_at` (the tick enforces it)."""

    pending: Dict[str, Worker]    # spawner tag -> worker whose exit has not been seen
    sig: int                      # the signal they were sent (a late-started one gets it too)
    then: AfterStop
    code: int                     # EXIT: ftrun's exit status; RESTART_GROUP: the failure's, for the barrier
    give_up_at: float             # grace + KILL_WAIT_S: the rest are counted as gone
    failure: Optional[Failure] = None  # REPORT


def forwarded_signals(cfg: RunConfig) -> List[int]:
    """torchrun's --signals-to-handle: the signals that stop the workers (sent on to them)."""
    return [getattr(signal, name) for name in cfg.signals_to_handle]


class Supervisor:
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
        self.started = time.time()
        self.status = RunStatus(
            run_id=cfg.run_id, script=cfg.script, argv=list(sys.argv), started=self.started, pid=os.getpid(),
            hook=cfg.hook.describe() if cfg.hook else None, policy=self.policy.name,
            max_restarts=cfg.max_restarts, nproc=cfg.nproc, nnodes=cfg.nnodes, node_rank=cfg.node_rank,
            log_dir=str(self.log_dir),
        )
        self.state_path = self.run_dir / "state.json"
        self.ledger = Ledger(cfg, self.started, self.run_dir, self.console)  # goodput, timeline, metrics
        self._ledger_failed = False
        self.waits = Waits(self.console)  # progress of ftrun's own long waits, on a terminal only
        self._dirty = True
        self._last_write = 0.0
        self._last_poll = 0.0
        self._last_progress = 0.0
        self._last_metrics = 0.0
        self._progress_seen: Dict[int, object] = {}  # rank -> the raw report last decoded
        self._checkpoints = checkpoints.CheckpointWatch()
        self._procs: Dict[int, activity.ProcessWatch] = {}
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

    def _spawn(self, w: Worker) -> None:
        env = worker_env(self.common, self.cfg, w.spec.local_rank, w.incarnation)
        (out_r, out_w), (err_r, err_w) = open_pipes()
        log = self.logs[w.rank]
        banner = f"===== ftrun: rank {w.rank}, incarnation {w.incarnation}, {time.strftime('%Y-%m-%d %H:%M:%S')} =====\n"
        w.pumps = [Pump(out_r, log.stdout_path, w.rank, self.console, False, banner),
                   Pump(err_r, log.stderr_path, w.rank, self.console, True, banner)]
        # A new attempt counts its own steps; with --ft the step is global.
        w.begin_incarnation(f"{w.rank}.{w.incarnation}.{time.monotonic_ns()}",
                            WorkerState.RECOVERING if self.cfg.ft and w.incarnation else WorkerState.STARTING,
                            keep_steps=self.cfg.ft)
        self.ledger.spawned(w, time.time())
        self.by_tag[w.tag] = w
        self._progress_seen.pop(w.rank, None)
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
            if any(w.state == WorkerState.DONE for w in self.workers) or not self.first_failure:
                lost = [w for w in self.workers if w.state == WorkerState.FAILED]
                if lost:
                    done = len(self.workers) - len(lost)
                    self.console.note(
                        f"finished with {done} of {len(self.workers)} replicas; "
                        + "; ".join(f"rank {w.rank} was given up after {w.restarts} restart(s): "
                                    f"{w.last_failure.reason if w.last_failure else 'failed'}" for w in lost),
                        style="bold yellow")
                return 0
            return self.first_failure.status_code
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
        elif isinstance(ev, Exited):
            self._on_exit(ev)

    def _on_stop_signal(self, signum: int) -> None:
        self.stopped_by_signal = signum
        name = signal.Signals(signum).name
        st = self.stopping
        if st is None and self.saving is not None:
            self.console.note(f"received {name} again: stopping without waiting for the checkpoint", style="bold yellow")
            self.saving = None
            self._begin_stop(signum, self.cfg.shutdown_timeout, AfterStop.EXIT, EXIT_SIGNAL_BASE + signum)
            return
        if st is None and self._save_before_stop(signum):
            return
        if st is None:
            self.console.note(f"received {name}: stopping all workers "
                              f"(grace {self.cfg.shutdown_timeout:g} s)", style="bold yellow")
            self._begin_stop(signum, self.cfg.shutdown_timeout, AfterStop.EXIT, EXIT_SIGNAL_BASE + signum)
            return
        # Already stopping: the signal ends the grace, and asks for no new attempt.
        instead = ""
        if st.then is AfterStop.RESTART_GROUP:
            st.then, st.code, instead = AfterStop.EXIT, EXIT_SIGNAL_BASE + signum, "no restart; "
        in_grace = any(w.kill_at for w in st.pending.values())
        if in_grace or instead:
            self.console.note(f"received {name}: {instead}{'no more grace, killing the workers now' if in_grace else ''}"
                              .rstrip("; "), style="bold yellow")
        self._kill_stopping_now()

    def _save_before_stop(self, signum: int) -> bool:
        """--ft with --checkpoint-dir, on the node keeping the quorum: have the replicas stop at one
        round boundary and save the last committed step before they are signalled. False when
        there is nothing to save (no epoch yet, nobody holds the trained state, the loop ended)."""
        q = self.quorum
        if not (self.cfg.checkpoint_dir and q is not None and q.leader) or \
                any(w.state == WorkerState.DONE for w in self.workers):
            return False
        try:
            writer = q.stop()
        except Exception:  # noqa: BLE001 - the store is gone: nothing can coordinate a save
            return False
        if writer is None:
            return False
        now = time.time()
        grace = self.cfg.shutdown_timeout
        self.saving = checkpoints.SaveBeforeStop(signum, now, now + grace)
        self.console.note(f"received {signal.Signals(signum).name}: saving a checkpoint of the last committed step "
                          f"(replica {writer}), then stopping all workers (at most {grace:g} s in all: "
                          f"--shutdown-timeout)", style="bold yellow")
        self._dirty = True
        return True

    def _check_saving(self) -> None:
        """While the replicas save before stopping: signal the workers once that is over."""
        sv = self.saving
        now = time.time()
        try:
            said = sv.outcome(self.store, now, any(w.alive for w in self.workers))
        except Exception:  # noqa: BLE001 - the store went away: nothing is coming
            said = ("the run's store went away before the checkpoint was written; stopping all workers", "bold red")
        if said is None:
            return
        self.saving = None
        self.console.note(said[0], style=said[1])
        self._begin_stop(sv.sig, max(min(1.0, self.cfg.shutdown_timeout), sv.deadline - now), AfterStop.EXIT,
                         EXIT_SIGNAL_BASE + sv.sig)

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

    def _on_exit(self, ev: Exited) -> None:
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
        if self.quorum is not None:
            # first: the survivors may be waiting for its vote
            self.quorum.on_exit(w.rank, w.incarnation, finished=ev.exit_code == 0 and not w.hang_reason)
        for p in w.pumps:
            p.done.wait(0.5)
        self._dirty = True
        if ev.exit_code == 0 and not w.hang_reason:
            w.state = WorkerState.DONE
            w.finished_at = time.time()
            self.ledger.done(w, w.finished_at)
            return
        tail = list(w.pumps[1].tail) if len(w.pumps) > 1 else []
        if ev.exit_code == EXIT_CANNOT_GO_ON and not w.hang_reason and any(l.startswith("ftrun.ft: ") for l in tail):
            self._cannot_go_on(w, tail)
            return
        reason = w.hang_reason or exit_reason(ev.exit_code, ev.signal, tail)
        early = not w.first_step_seen and not w.hang_reason and not ev.signal
        failure = Failure(rank=w.rank, pid=ev.pid, exit_code=ev.exit_code, signal=ev.signal, reason=reason,
                          when=time.time(), stderr_tail=tail, log_path=str(self.logs[w.rank].stderr_path),
                          signature=early_signature(tail) if early else None)
        w.last_failure = failure
        if self.first_failure is None:
            self.first_failure = failure
        self.ledger.failed(w, failure, time.time(), ev.seen)
        self._on_failure(w, failure)

    def _cannot_go_on(self, w: Worker, tail: List[str]) -> None:
        """A worker found that the run cannot go on as started (a checkpoint of another model or
        optimizer, a script that misuses ftrun.ft): restarting cannot change that. End the run
        as bad input, with the worker's own line."""
        w.state = WorkerState.FAILED
        why = next((line.strip() for line in reversed(tail) if line.startswith("ftrun.ft: ")), "")
        why = why.split("ftrun.ft: ", 1)[-1] or f"rank {w.rank} found that the run cannot go on"
        self.console.note(f"{why}; stopping the run (exit 2)", style="bold red")
        self.status.exit_summary = why
        self._begin_stop(signal.SIGTERM, self.cfg.shutdown_timeout, AfterStop.EXIT, EXIT_USAGE)

    def _on_failure(self, w: Worker, failure: Failure) -> None:
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
        decision = self.policy.on_failure(rep, live_after, failure.signature)
        if decision is Decision.RESTART_REPLICA:
            used = self.policy.restarts[rep]
            alone = ("it alone" if self.k == 1 else
                     f"its replica ({self.k} workers, ranks {rep * self.k}-{rep * self.k + self.k - 1}) alone")
            self.console.note(f"{who} (pid {failure.pid}) {failure.reason}; restarting {alone} "
                              f"(restart {used} of {self.policy.max_restarts}); the others keep training",
                              style="bold yellow")
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
                       remote: Optional[dict] = None) -> None:
        """Without --ft: a failure here (w, failure) or on another node (remote) stops every
        worker; the group restarts while the budget lasts. With several nodes the first
        failure of the attempt is agreed in the store, so every node decides alike."""
        if w is not None:
            w.state = WorkerState.FAILED
        info = {"node": self.cfg.node_rank, "rank": failure.rank if failure else -1,
                "reason": failure.reason if failure else "failed", "code": failure.status_code if failure else 1,
                "signature": failure.signature if failure else None}
        if self.nodes is not None:
            try:
                info = self.nodes.first_failure(failure, remote)
            except Exception as e:
                if failure is not None and not self.nodes.store_reachable():
                    self._on_node_event(self.nodes.store_gone(nodes_one_line(e)))
                    return
        code = int(info.get("code") or 1)
        here = self.nodes is None or (failure is not None and info["node"] == self.cfg.node_rank
                                      and info["rank"] == failure.rank)
        origin = (f"rank {info['rank']} on node {info['node']}" if self.nodes is not None
                  else f"rank {info['rank']} (pid {failure.pid})" if failure is not None else f"rank {info['rank']}")
        decision = self.policy.on_failure(int(info["rank"]), info.get("signature"))
        grace = self.cfg.shutdown_timeout
        if decision is not Decision.RESTART_GROUP:
            if self.policy.repeated:
                self.give_up_why = REPEATED
            self.status.exit_summary = f"{origin} {info['reason']}"
            if self._can_reform() and not self.policy.repeated:
                # c10d: a failure ends the round; every node comes back to re-form (ftrun.supervisor.rendezvous).
                self.reform = True
                self.console.note(f"{origin} {info['reason']}; ending round {self.cfg.round}: every node stops its "
                                  f"workers and the run re-forms (restart {self.cfg.round + 1} of "
                                  f"{self.cfg.total_restarts})", style="bold yellow")
                self._begin_stop(signal.SIGTERM, grace, AfterStop.EXIT, code)
            elif here and failure is not None:
                self._begin_stop(signal.SIGTERM, grace, AfterStop.REPORT, code, failure)
            else:
                budget = self.cfg.max_restarts if self.cfg.total_restarts is None else self.cfg.total_restarts
                why = self.give_up_why or f"restart budget spent ({budget} restart{'s' if budget != 1 else ''})"
                self.console.note(f"{origin} {info['reason']}; {why}; stopping this node's workers",
                                  style="bold red")
                self._begin_stop(signal.SIGTERM, grace, AfterStop.EXIT, code)
            return
        where = "" if self.nodes is None else f" on {self.cfg.nnodes} nodes"
        self.console.note(f"{origin} {info['reason']}; restarting all {self.cfg.world_size} workers{where} "
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

    def _node_ranks(self, k: int) -> List[int]:
        return list(range(k * self.cfg.nproc, (k + 1) * self.cfg.nproc))

    def _routes(self, live: List[int]) -> Optional[Routes]:
        """The nodes of `live` whose workers vote through their node's store (each published its
        store as it joined; node 0's workers vote in the run's store it hosts)."""
        if self.nodes is None or not self.nodes.standby:
            return None
        return Routes({k: (self.nodes.standby[k], self._node_ranks(k)) for k in live if k in self.nodes.standby})

    def _add_node(self, k: int) -> None:
        """Late node k's replicas become ranks of the quorum, voting through its own store."""
        standby = self.nodes.standby.get(k)
        self.quorum.add_ranks(self._node_ranks(k), (k, standby) if standby else None)

    def _admit_waiting(self) -> None:
        """Node 0, --ft on an elastic run: late nodes take free places, first come first served,
        one a second at most (the tick calls again): every other node learns of one from the node
        list before the next comes, so no two nodes count the run's nodes more than one apart
        (ftrun.supervisor.failover.keeps_running)."""
        nodes = self.nodes
        while nodes.waiting and len(nodes.live) < self.cfg.max_nodes:
            if time.monotonic() - self._admitted_at < ADMIT_GAP_S:
                return
            k = nodes.waiting.pop(0)
            if not nodes.still_waiting(k):
                continue
            self._add_node(k)  # their keys exist before anyone reads them
            nodes.admit(k)
            self._admitted_at = time.monotonic()
            self.console.note(f"node {k} joins the running run ({len(nodes.live)} of at most {self.cfg.max_nodes} "
                              f"nodes); its replicas heal from a peer", style="bold cyan")
        if nodes.waiting and not self._told_full:
            self._told_full = True
            self.console.note(f"node{'s' if len(nodes.waiting) > 1 else ''} {', '.join(map(str, nodes.waiting))} "
                              f"wait{'s' if len(nodes.waiting) == 1 else ''} for a place: the run has its "
                              f"{self.cfg.max_nodes} nodes", style="yellow")

    def _on_node_event(self, ev: NodeEvent) -> None:
        """What the other nodes' coordinator saw: the store gone, a node lost, another node's failure."""
        if ev.kind == "remote_failure":
            self.ledger.remote_failure(ev.info, time.time())
            self._group_failure(None, None, ev.info)
            return
        live = [w for w in self.workers if w.alive]
        if ev.kind == "node_waiting":
            self.nodes.waiting.append(ev.node)
            self._admit_waiting()
            return
        if ev.kind == "node_joined":
            if self.quorum is not None:
                self._add_node(ev.node)
            self.console.note(f"{ev.text}; its replicas heal from a peer", style="cyan")
            return
        if ev.kind == "store_gone" and self.cfg.ft and self.nodes.may_move():
            self._move_store(ev)
            return
        if ev.kind == "store_gone" and self._can_reform() and self.nodes.may_move_between_rounds():
            self.reform = self.store_lost = True
            self.status.exit_summary = "node 0 (the run's store) went away"
            self.console.note(f"{ev.text}; ending round {self.cfg.round}: the nodes that remain move the run's store "
                              f"and re-form the run (restart {self.cfg.round + 1} of {self.cfg.total_restarts})",
                              style="bold yellow")
            self._begin_stop(signal.SIGTERM, self.cfg.shutdown_timeout, AfterStop.EXIT, NODE_LOST)
            return
        if ev.kind == "node_lost" and self.cfg.ft and not self.nodes.majority_kept():
            self._lost_majority(f"{ev.text}; this node and the nodes it still sees are fewer than half of the "
                                f"run's {self.nodes.layout_size}")
            return
        if ev.kind == "node_lost" and self.cfg.ft:
            self.console.note(f"{ev.text}; carrying on without its replicas (--ft)", style="bold yellow")
            self._on_node_lost(ev.node)
            if self.cfg.admits_late and self.nodes.me == self.nodes.host_node:
                self.nodes.drop(ev.node)
                self._told_full = False
                self._admit_waiting()
            return
        if ev.kind == "node_lost" and self._can_reform():
            self.reform = True
            self.console.note(f"{ev.text}; ending round {self.cfg.round}: the nodes that remain re-form the run "
                              f"(restart {self.cfg.round + 1} of {self.cfg.total_restarts})", style="bold yellow")
        elif ev.kind == "node_lost":
            self.console.note(f"{ev.text}; stopping this node's workers (without --ft the run needs every node)",
                              style="bold red")
        else:
            what = (f"stopping this node's {len(live)} worker{'s' if len(live) != 1 else ''}" if live
                    else "ending this node's run")
            self.console.note(f"{ev.text}; {what}", style="bold red")
        self.status.exit_summary = ev.text if ev.kind == "node_lost" else "node 0 (the run's store) went away"
        code = NODE_LOST
        if ev.kind == "store_gone" and self.cfg.ft:
            # Nothing here can go on without the store: a scheduler that requeues on this status
            # restarts the job, which resumes from --checkpoint-dir (docs/guides/checkpoints.md: requeue).
            code = REQUEUE
            self.console.note(f"exit {REQUEUE}: requeue the job to resume"
                              f"{' from ' + self.cfg.checkpoint_dir if self.cfg.checkpoint_dir else ''}",
                              style="bold yellow")
        self._begin_stop(signal.SIGTERM, self.cfg.shutdown_timeout, AfterStop.EXIT, code)

    def _move_store(self, ev: NodeEvent) -> None:
        """--ft: the run's store is lost with its node; the surviving nodes agree on a new host
        (ftrun.supervisor.failover), and this node's keeper and workers follow it. The replicas
        keep their state: each rejoins, and the first epoch on the new store is healed from the
        replica holding the newest complete step."""
        t0 = time.monotonic()
        self.console.note(f"{ev.text}; moving the run's store to a surviving node", style="bold yellow")
        before = self.nodes.layout_size  # an elastic run counts only the new layout after the move
        try:
            elected = self.nodes.fail_over()
        except NoMajority as e:
            self._lost_majority(f"the run's store could not move: {e}")
            return
        host, _, port = elected.addr.rpartition(":")
        if not self.cfg.workers_master_addr:
            self.common["MASTER_ADDR"] = host
        self.common["MASTER_PORT"] = port
        self.common["FTRUN_STORE"] = elected.addr
        old = self.quorum
        self.quorum = QuorumKeeper(self.store, [r for k in elected.nodes for r in self._node_ranks(k)],
                                   [w.rank for w in self.workers], leader=elected.host == self.cfg.node_rank,
                                   replica_size=self.k, routes=self._routes(elected.nodes))
        self.quorum.fresh_start = old.fresh_start
        self.quorum.epoch_id = old.epoch_id + 1  # above every epoch a replica may have seen
        self.quorum.info = dict(old.info)  # the replicas' last words, until they speak again
        self.quorum.moved = True
        self.quorum.awaited = set(old.members) or None
        for w in self.workers:
            self.quorum.alive[w.rank] = w.incarnation if w.alive else None
        self._on_store_ready()
        self.nodes.node_store.store.set(RUN_STORE, f"{self.nodes.gen} {elected.addr}")
        if self.cfg.admits_late and elected.host == self.cfg.node_rank:
            # Nodes started from now on with the run's line find the run here (c10d, elastic).
            self.nodes.open_to_late_nodes(host)
            Redirect(self.cfg.endpoint, self.cfg.run_id, elected.addr).start()
        if self.relay is not None:  # members waiting for a decision of the old store follow the new one
            self.relay.moved(old.epoch_id + 1)
        self.console.note(f"node {elected.host} hosts the run's store now, at {elected.addr} ({len(elected.nodes)} "
                          f"of {before} nodes, agreed in {time.monotonic() - t0:.1f} s); the "
                          f"replicas keep their state and rejoin", style="bold cyan")
        self._dirty = True

    def _lost_majority(self, why: str) -> None:
        """--ft: this node may no longer go on (a second run could form elsewhere): stop its workers."""
        text = f"{why}; stopping this node so that no second run can form"
        self.console.note(text, style="bold red")
        self.status.exit_summary = text
        self.console.note(f"exit {REQUEUE}: requeue the job to resume"
                          f"{' from ' + self.cfg.checkpoint_dir if self.cfg.checkpoint_dir else ''}",
                          style="bold yellow")
        self._begin_stop(signal.SIGTERM, self.cfg.shutdown_timeout, AfterStop.EXIT, REQUEUE)

    def _can_reform(self) -> bool:
        """c10d without --ft: torchrun's restart is a new round of the rendezvous, within its budget."""
        return (self.cfg.rdzv == "c10d" and not self.cfg.ft and self.cfg.total_restarts is not None
                and self.cfg.round < self.cfg.total_restarts)

    def _clean_store_for_new_attempt(self) -> None:
        if self.store is None or not self.store.wait(STORE_READY_TIMEOUT_S):
            return
        try:
            self.store.clear_worker_keys()
        except Exception as e:  # the attempt may still work; say why it might not
            self.console.note(f"could not clear the store between attempts: {e}", style="yellow")

    def _give_up(self, failure: Failure) -> int:
        first = self.first_failure or failure
        attempts = self.give_up_why or (f"restart budget spent ({self.cfg.max_restarts} restart"
                                        f"{'s' if self.cfg.max_restarts != 1 else ''}, {self.policy.name})")
        drain([p for w in self.workers for p in w.pumps])  # the report comes after the workers' lines
        self._fill_goodput(end=True)  # the goodput summary, before the report: the report is the last word
        self.console.renderable(failure_report(first, attempts, self.workers))
        return first.status_code

    # ---------------------------------------------------------------- stopping
    def _begin_stop(self, sig: int, grace: float, then: AfterStop, code: int,
                    failure: Optional[Failure] = None) -> None:
        """Enter the stopping state: `sig` to every worker that still has a process (a stop is
        always the whole node's), SIGKILL after `grace`; the loop does `then` once all have exited."""
        now = time.time()
        pending = {w.tag: w for w in self.workers if self.by_tag.get(w.tag) is w}
        for w in pending.values():
            w.stop_requested = True
            signal_group(w.pid, sig)
            if sig != signal.SIGKILL:
                w.kill_at = now + grace if w.kill_at is None else min(w.kill_at, now + grace)
        self.stopping = Stopping(pending, sig, then, code, now + grace + KILL_WAIT_S, failure)
        self._dirty = True

    def _kill_stopping_now(self) -> None:
        """End the grace: SIGKILL every worker being stopped (one not started yet gets it once it is)."""
        for w in self.stopping.pending.values():
            signal_group(w.pid, signal.SIGKILL)
            w.kill_at = None

    def _stopped(self, w: Worker) -> None:
        """A worker being stopped is gone (its exit seen, or counted as gone)."""
        self.by_tag.pop(w.tag, None)
        if self.stopping is not None:
            self.stopping.pending.pop(w.tag, None)
        w.kill_at = None
        self.ledger.stopped(w, time.time())
        if w.state not in (WorkerState.RESTARTING, WorkerState.FAILED):
            w.state = WorkerState.STOPPED
        if self.quorum is not None:
            self.quorum.on_exit(w.rank, w.incarnation)
        for p in w.pumps:
            p.done.wait(0.5)
        self._dirty = True
        if self.respawning:
            self._respawn_replicas()

    def _advance_stop(self) -> Optional[int]:
        """After each turn while stopping: once the last worker is gone, do what the stop was
        for; ftrun's exit status when that ends the run."""
        st = self.stopping
        if st.pending and time.time() >= st.give_up_at:
            ranks = ", ".join(str(w.rank) for w in st.pending.values())
            self.console.note(f"rank {ranks} still running {KILL_WAIT_S:g} s past the grace, SIGKILL notwithstanding; "
                              f"no longer waiting", style="bold red")
            if isinstance(self.spawner, ZygoteSpawner):
                self.spawner.close()  # workers die with their zygote (parent-death signal)
                if st.then is AfterStop.RESTART_GROUP:
                    st.then, st.code = AfterStop.EXIT, EXIT_FAILED  # no zygote, no new attempt
            for w in list(st.pending.values()):
                self._stopped(w)
        if st.pending:
            return None
        self.stopping = None
        if st.then is AfterStop.RESTART_GROUP:
            return self._restart_group(st.code)
        if st.then is AfterStop.REPORT:
            return self._give_up(st.failure)
        return st.code

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
            self._sample_metrics(now)
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
        reports = self._reports_store()
        if reports.store is None:
            return
        keys = [progress_key(w.rank) for w in self.workers]
        try:
            values = reports.multi_get(keys)
        except Exception:
            return
        for w, raw in zip(self.workers, values):
            if raw == self._progress_seen.get(w.rank):
                continue
            self._progress_seen[w.rank] = raw
            report = ProgressReport.decode(raw)
            if report is None or report.incarnation != w.incarnation or not w.alive:
                continue
            steps = report.steps
            w.last_heartbeat = now
            w.note_activity(report.activity, now)
            self.ledger.progress(w, report, now)
            if w.state == WorkerState.STARTING and self.quorum is None:
                w.state = WorkerState.RUNNING
                self._dirty = True
            self._note_steps(w, steps, now)

    def _note_steps(self, w: Worker, steps: int, now: float) -> None:
        """A worker's step count as last reported (its progress key, or under --ft its report to
        the quorum, read every tick)."""
        if steps == w.steps or steps <= 0:
            return
        if w.last_step_time and steps > w.steps:
            dt = max(1e-3, now - w.last_step_time)
            rate = (steps - w.steps) / dt
            w.steps_per_s = rate if w.steps_per_s == 0 else 0.7 * w.steps_per_s + 0.3 * rate
        w.steps = steps
        w.last_step_time = now
        w.first_step_seen = True
        self._dirty = True

    def _poll_quorum(self, now: float) -> None:
        q = self.quorum
        try:
            if self.relay is not None:
                self.relay.poll(now)
            q.poll(now)
        except Exception as e:  # the store went away: the loop's other checks will say so
            if not self._quorum_failing:
                self._quorum_failing = True
                self.console.note(f"quorum poll failed: {nodes_one_line(e)}", style="yellow")
            return
        self._quorum_failing = False
        if self.cfg.checkpoint_dir and now == self._last_progress:
            self._poll_checkpoint()  # a few times a second, with the progress poll
        while q.history:
            self.console.note(q.history.pop(0), style="cyan")
        for w in self.workers:
            info = q.info.get(w.rank)
            if w.alive and info and info.get("inc") == w.incarnation and w.first_step_seen:
                # Fresher than the progress key (read a few times a second): the step now.
                self._note_steps(w, int(info.get("step") or 0), now)
        for w in self.workers:
            if w.state in (WorkerState.RECOVERING, WorkerState.STARTING, WorkerState.RUNNING) and w.alive:
                if q.replica_fields(w.rank)["in_quorum"] and w.state != WorkerState.RUNNING:
                    if w.state == WorkerState.RECOVERING and w.last_failure is not None:
                        took = now - w.last_failure.when
                        w.rejoin_s = took
                        who = (f"rank {w.rank}" if self.k == 1 else
                               f"replica {w.rank // self.k} (rank {w.rank} failed)")
                        if q.epoch_id in q.fresh_epochs:
                            self.console.note(f"{who} is training again {took:.2f} s after it failed; no replica "
                                              f"held the trained state: {q.fresh_start}", style="green")
                        else:
                            self.console.note(f"{who} is training again, healed from a peer "
                                              f"{took:.2f} s after it failed", style="green")
                    w.state = WorkerState.RUNNING
                    self._dirty = True
        if not self._warned_no_ft_api:
            plain = [w.rank for w in self.workers if w.first_step_seen and not q.info.get(w.rank)]
            if plain:
                self._warned_no_ft_api = True
                self.console.note(
                    f"--ft: rank {plain[0]} trains without ftrun.ft (it never asked to join a quorum), so a failed "
                    f"replica cannot heal from a peer; wrap the model, optimizer and loop with ftrun.ft "
                    f"(see scripts/train_ft.py), or drop --ft for group restarts", style="bold yellow")
        if self.status.quorum_id != q.epoch_id:
            self._dirty = True  # the run's figures are taken at every write (_write_state)

    def _poll_checkpoint(self) -> None:
        """The newest good checkpoint and the saves failed since, for `ftrun status`."""
        try:
            ck = self._checkpoints.poll(self.store)
        except Exception:
            return
        if ck is not None:
            self.status.checkpoint = ck
            self.ledger.checkpoint(ck)  # once per good checkpoint (a failed save changes nothing there)
            self._dirty = True

    def _reports_store(self) -> RunStore:
        """Where this node's workers report progress: the node's own store when it relays their
        reports (ftrun.supervisor.relay), else the run's."""
        return self.nodes.node_store if self.relay is not None else self.store

    def _on_store_ready(self) -> None:
        if self.quorum is not None:
            self.quorum.on_store_ready()
        # Every progress key exists from the start, so multi_get never waits for one.
        reports = self._reports_store()
        reports.wait(STORE_TIMEOUT_S)  # the node's store, built alongside the run's: up by now
        for w in self.workers:
            try:
                reports.store.compare_set(progress_key(w.rank), "", NO_PROGRESS.encode())
            except Exception:
                pass

    def _check_hangs(self, now: float) -> None:
        """Name and kill hung workers: by --step-timeout's rule when given, else by the default
        rule, which can only take a worker that does nothing (stopped, or idle while waited for)."""
        explicit = self.cfg.step_timeout is not None
        limit = self.cfg.step_timeout if explicit else self.default_hang_s
        live = (WorkerState.RUNNING, WorkerState.RECOVERING, WorkerState.STARTING)
        # A replica of several workers hangs as one: its other workers wait for the hung one inside
        # the replica's own collectives. One culprit per replica is killed (the replica restarts
        # whole): a worker whose process is stopped or whose heartbeat stopped before one that waits.
        order = sorted(self.workers, key=lambda o: not (o.stopped_for(now) >= limit or
                                                         (o.last_heartbeat and now - o.last_heartbeat > limit)))
        named = {o.rank // self.k for o in self.workers if o.kill_at or o.state == WorkerState.HUNG}
        for w in order:
            if w.state not in live or not w.alive or w.kill_at or w.rank // self.k in named:
                continue
            reason = self._hung_restarting(w, now, limit) or (
                self._hung_by_step_timeout(w, now, limit) if explicit else self._hung_by_default(w, now, limit))
            if reason is None:
                continue
            w.hang_reason = reason
            w.state = WorkerState.HUNG
            self.ledger.hung(w, now, limit)
            named.add(w.rank // self.k)
            self.console.note(f"rank {w.rank} (pid {w.pid}) is {w.hang_reason}: killing it; its Python stacks "
                              f"go to {stacks_file(self.cfg, w.rank)}", style="bold red")
            if w.pid:
                try:
                    os.kill(w.pid, DUMP_STACKS_SIGNAL)
                except OSError:
                    pass
            w.kill_at = now + HANG_DUMP_GRACE_S
            self._dirty = True

    def _hung_by_step_timeout(self, w: Worker, now: float, limit: float) -> Optional[str]:
        """--step-timeout S: no heartbeat, or no step (with --ft: its peers waited for its step) for S."""
        if w.last_heartbeat and now - w.last_heartbeat > limit:
            return f"hung (no heartbeat for {limit:g} s)"
        if self.quorum is not None:
            # With --ft every replica stalls while one hangs: only the one the others have
            # been waiting for all along is hung, never a replica that waits for it.
            if self.quorum.waited_for_s(w.rank) > limit:
                return f"hung (its peers waited {limit:g} s for its step)"
        elif (w.state == WorkerState.RUNNING and w.first_step_seen and w.last_step_time
              and w.since_progress(now) > limit):
            return f"hung (no optimizer step or other progress for {limit:g} s)"
        return None

    def _hung_restarting(self, w: Worker, now: float, limit: float) -> Optional[str]:
        """--ft, either rule: a restarted replica that has not asked to join the run yet and whose
        every worker has done nothing (no CPU, no I/O, no child at work) for the limit is hung as
        any other, e.g. one blocked in a group its peers formed long ago. Its peers do not wait
        for it (it is in no epoch yet), so the waited-for rules never see it."""
        if self.quorum is None or w.state != WorkerState.RECOVERING:
            return None
        mates = self._replica(w.rank // self.k)
        if any(self.quorum.replica_fields(m.rank)["ft_phase"] not in (None, "init") for m in mates):
            return None  # it asked to join: the quorum's own waits and timeouts take over
        if all(m.idle_for(now) >= limit for m in mates):
            return f"hung (restarted, it did nothing for {limit:g} s before asking to rejoin: no CPU, no I/O)"
        return None

    def _hung_by_default(self, w: Worker, now: float, limit: float) -> Optional[str]:
        """No --step-timeout: a worker whose process has been stopped (SIGSTOP, SIGTSTP) for the
        limit; with --ft also one its peers have waited for that long while it did nothing (no CPU,
        no I/O, no child process at work: ftrun.supervisor.activity). A worker that computes (an
        evaluation, a save) or waits on I/O or a child process is never taken by this rule."""
        if w.stopped_for(now) >= limit:
            return f"hung (its process was stopped for {limit:g} s)"
        if self.quorum is not None and self.quorum.waited_for_s(w.rank) >= limit and w.idle_for(now) >= limit:
            mates = [m for m in self.workers if m is not w and m.rank // self.k == w.rank // self.k]
            if any(m.stopped_since is not None for m in mates):
                return None  # it waits for a stopped mate: that one is the culprit, named by its stop
            return (f"hung (its peers waited {limit:g} s for its step while it did nothing: no CPU, no I/O, "
                    f"no child at work)")
        return None

    def _on_node_lost(self, node: int) -> None:
        """--ft: a lost node's replicas are dead in the quorum at once (only node 0's keeper decides)."""
        q = self.quorum
        if q is None or not q.leader:
            return
        if q.routes is not None:  # its store went with it: votes for its members go to the run's store
            q.routes.lose(node)
        for rank in range(node * self.cfg.nproc, (node + 1) * self.cfg.nproc):
            inc = q.alive.get(rank)
            if inc is not None:
                q.on_exit(rank, inc)

    def _sample_metrics(self, now: float) -> None:
        for w in self.workers:
            if not w.pid or not w.alive:
                continue
            proc = self._procs.get(w.pid)
            if proc is None:
                proc = activity.watch(w.pid)  # its first sample comes a second from now
                if proc is not None:
                    self._procs[w.pid] = proc
                continue
            try:
                sample = proc.sample()
            except (psutil.Error, OSError):
                self._procs.pop(w.pid, None)
                continue
            w.cpu_percent = sample.cpu_percent
            w.rss_bytes = sample.rss_bytes
            w.note_process(sample.stopped, sample.quiet, now)

    # ---------------------------------------------------------------- state
    def _replica_status(self, w: Worker) -> ReplicaStatus:
        return ReplicaStatus(
            rank=w.rank, local_rank=w.spec.local_rank, pid=w.pid, state=w.state.value, restarts=w.restarts,
            step=w.steps, steps_per_s=round(w.steps_per_s, 3), last_heartbeat=w.last_heartbeat,
            last_step_time=w.last_step_time, cpu_percent=w.cpu_percent, rss_bytes=w.rss_bytes,
            last_failure=w.last_failure.reason if w.last_failure else None, node_rank=self.cfg.node_rank,
            **(self.quorum.replica_fields(w.rank) if self.quorum is not None else {}),
        )

    def _write_state(self) -> None:
        if self.quorum is not None:
            # Every write, not only when the epoch changes: the figures move with every step.
            for k, v in self.quorum.run_fields().items():
                setattr(self.status, k, v)
        self.status.replicas = [self._replica_status(w) for w in self.workers]
        if self.nodes is not None:
            self.status.replicas = self.nodes.all_replicas(self.status.replicas)
        self._fill_goodput()
        try:
            write_state(self.state_path, self.status)
        except OSError:
            pass
        self._last_write = time.time()
        self._dirty = False

    def _rank0_report(self, attempt: int) -> Optional[ProgressReport]:
        """Rank 0's last progress report of the stopped `attempt`, on a node that does not run it
        (a script's checkpoint is usually saved there). Node 0 keeps a copy before the next
        attempt starts: by the time this node reads, the new rank 0 has replaced its report."""
        if self.cfg.node_rank == 0 or self.nodes is None:
            return None
        return self.nodes.rank0_report(attempt)

    def _fill_goodput(self, end: bool = False) -> None:
        """The goodput figures (state, timeline, metrics; at the end the summary too). Accounting
        must never take the run down: an error in it is said once, and the run goes on."""
        try:
            if end:
                self.ledger.finish(self.status, self.status.ended or time.time())
            else:
                self.ledger.fill(self.status, time.time())
        except Exception as e:  # noqa: BLE001
            if not self._ledger_failed:
                self._ledger_failed = True
                self.console.note(f"internal error in the goodput accounting ({type(e).__name__}: {e}); "
                                  f"the run goes on without it", style="yellow")

    def _read_last_reports(self) -> None:
        """Take in the report each worker writes as it exits (ftrun.worker.progress), so the
        ended run's state says where every replica stopped, not where it was a beat earlier."""
        st = self._reports_store()
        if st is None or st.store is None or not self._store_announced:
            return  # the keys were never created: a read would wait for them (for minutes)
        wanted = [progress_key(w.rank) for w in self.workers]
        try:
            if not st.store.check(wanted):
                return
            values = st.multi_get(wanted)
        except Exception:  # the store (node 0's) is gone: the last figures read stand
            return
        for w, raw in zip(self.workers, values):
            report = ProgressReport.decode(raw)
            if report is not None and report.incarnation == w.incarnation and report.steps > 0:
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
