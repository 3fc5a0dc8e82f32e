"""Progress reports from inside a worker: heartbeats, optimizer steps and other progress, via the store.

A global optimizer step hook counts steps with no change to the user's script;
with --step-timeout, a global module forward hook and wrappers of
torch.save/torch.load count other progress (evaluation, checkpoints; the
patches are listed in ftrun/worker/patches.py), so a
long evaluation or save is not taken for a hang. Without --ft, torch.save and
torch.distributed.checkpoint's saves note the step count they were made at:
a group restart loses the steps since then (the supervisor's goodput). A daemon thread
writes a ftrun.wire.ProgressReport (and, under --ft, the member's report, a
wire.MemberReport) to the supervisor's store every HEARTBEAT_S (and at once after the first step, and once more as the worker exits), so the
supervisor can show live health, spot a hung rank, and record where each
worker stopped. On a node that relays (FTRUN_NODE_STORE, several
nodes under --ft) that store is the node's own, which never moves: the
node's ftrun reads the reports there and relays the --ft counters to the
run's store in one key per node (keys.node_info_key). A store error does
not end the reports: the thread reconnects with a bounded back-off and keeps
beating.
Must never block or slow the training loop: the hooks only bump counters.
Must never import the supervisor.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import os
import sys
import threading
import time
import warnings
from typing import Any, Callable, Optional

from ftrun.keys import HEARTBEAT_S, info_key, progress_key
from ftrun.wire import MemberReport, ProgressReport
from ftrun.worker import patches, settings

RECONNECT_MAX_S = 1.0       # back-off cap between reconnects to the store
RECONNECT_TIMEOUT_S = 5.0   # one connection attempt; the first one may wait for the store longer
FINAL_REPORT_S = 2.0        # how long an exiting worker waits for its last report to reach the store
STEP_REPORT_S = 0.05        # ftrun.ft: a committed step is reported this soon at most (20 Hz while training)
# Fault injection for tests: "START:COUNT" makes store writes number START..START+COUNT-1 fail.
INJECT_ENV = "FTRUN_INJECT_PROGRESS_FAIL"



class ProgressReporter:
    """Counts optimizer steps and other progress and reports them, with a heartbeat, to the store."""

    def __init__(self, host: str, port: int, rank: int, incarnation: int, relayed: bool = False) -> None:
        self.host, self.port = host, port
        self.relayed = relayed  # host:port is the node's store, not the run's
        self.rank = rank
        self.incarnation = incarnation
        self.steps = 0
        self.last_step_time = 0.0
        self.activity = 0           # forward passes and torch.save/torch.load calls
        self.busy = 0               # torch.save/torch.load calls running now: progress while they last
        self.global_step: Optional[int] = None  # set by ftrun.ft, which counts committed steps
        self.first_step_time = 0.0  # this process's first step: when its replica was back (goodput)
        # Without --ft: the step count when the script's latest save returned (-1: none yet);
        # a group restart loses the steps after it (ftrun.supervisor.accounting.goodput).
        self.saved_steps = -1
        self.next_sync = -1  # set by ftrun.worker.hooks after each step of a hook that syncs every few steps
        self._dcp_wrapped = False
        # ftrun.ft: a callable returning the member's report (the keeper's, and `ftrun status`'s)
        self.info_provider: Optional[Callable[[], MemberReport]] = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._writes = 0
        self._written_at = 0.0  # when the last report went out
        self._inject = _parse_inject(settings.current().inject_progress_fail)
        self._moved = False
        self._thread = threading.Thread(target=self._loop, name="ftrun-progress", daemon=True)

    def start(self) -> None:
        import torch
        from torch.nn.modules.module import register_module_forward_hook
        from torch.optim.optimizer import register_optimizer_step_post_hook

        s = settings.current()
        register_optimizer_step_post_hook(self._on_step)
        if s.step_timeout:
            # Only --step-timeout counts progress that is not a step (the default hang rule reads
            # the process's state and CPU instead): without it no worker pays a call per forward.
            register_module_forward_hook(self._on_forward)
            # torch.compile(module) warns that global hooks fire once more for its wrapper: for a
            # counter of progress that is harmless, and the user did not register this hook.
            warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks")
            patches.install("save.load", torch, "save", self._counted(torch.save))
            patches.install("save.load", torch, "load", self._counted(torch.load))
        if not s.ft:
            patches.install("save.load", torch, "save", self._saving(torch.save))
        self._thread.start()
        atexit.register(self.stop)

    def stop(self, timeout: float = FINAL_REPORT_S) -> None:
        """Write one last report and end the reports (at exit). Without it the store keeps a
        report up to HEARTBEAT_S old: an ended run would show its replicas steps short of the end."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _on_step(self, *_args: Any) -> None:
        self.steps += 1
        self.last_step_time = time.time()
        if self.steps == 1:
            self.first_step_time = self.last_step_time
            self._wake.set()

    def _on_forward(self, *_args: Any) -> None:
        # Called after every module's forward: one integer add, nothing else.
        self.activity += 1

    def _counted(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.busy += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.busy -= 1
                self.activity += 1
        return wrapper

    def _saving(self, fn: Callable) -> Callable:
        """`fn` (a save) that notes the step count it saved at, once it returns."""
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            if self.saved_steps != self.steps:
                self.saved_steps = self.steps
                self._wake.set()  # reported at once: a failure right after a save loses nothing
            return out
        return wrapper

    def _wrap_dcp(self) -> None:
        """Once the script has imported torch.distributed.checkpoint (importing it here would cost
        every worker its import time), its saves note their step count as torch.save's do."""
        dcp = sys.modules.get("torch.distributed.checkpoint")
        if dcp is None or self._dcp_wrapped or settings.current().ft:
            return
        self._dcp_wrapped = True
        for name in ("save", "async_save"):
            if callable(getattr(dcp, name, None)):
                patches.install("dcp.save", dcp, name, self._saving(getattr(dcp, name)))

    def move_to(self, addr: str) -> None:
        """The run's store moved (ftrun.ft follows it): report there from now on, unless the
        reports go to the node's store, which stays where it is (its ftrun relays them on)."""
        if self.relayed:
            return
        host, _, port = addr.rpartition(":")
        self.host, self.port = host, int(port)
        self._moved = True
        self._wake.set()

    def note_step(self, step: int, took: bool = True) -> None:
        """For ftrun.ft: the global step, just committed (`took`) or reached without a step (a
        heal, a resume, a discarded round). Reported within STEP_REPORT_S, not at the next beat:
        `ftrun status` (and a script reading it) must show the current step. Only a step taken
        dates the replica's return: a heal that lands is not yet a replica training again."""
        self.global_step = step
        now = time.time()
        if took:
            self.last_step_time = now
            if not self.first_step_time:
                self.first_step_time = now
        if now - self._written_at >= STEP_REPORT_S:
            self._wake.set()

    def _connect(self, timeout_s: float):
        import datetime
        import socket

        import torch.distributed as dist

        # A store that is gone refuses at once; torch's client would retry for the whole timeout
        # (logging a C++ stack each time) while the store moves elsewhere (ftrun.ft follows it).
        with socket.create_connection((self.host, self.port), timeout=timeout_s):
            pass

        return dist.TCPStore(self.host, self.port, None, False, datetime.timedelta(seconds=timeout_s))

    def _write(self, store, beat: int) -> None:
        self._writes += 1
        start, count = self._inject
        if start <= self._writes < start + count:
            raise RuntimeError(f"injected store error ({INJECT_ENV}, write {self._writes})")
        self._written_at = time.time()
        steps = self.global_step if self.global_step is not None else self.steps
        if self.busy:
            self.activity += 1  # a save or load that takes long is progress while it runs
        self._wrap_dcp()
        report = ProgressReport(self.incarnation, steps, self.last_step_time, time.time(), os.getpid(),
                                self.activity, self.first_step_time, self.saved_steps, self.next_sync)
        store.set(progress_key(self.rank), report.encode())
        if self.info_provider is not None:
            # The beat changes every report, so the keeper can tell a live report from a stale one.
            store.set(info_key(self.rank), dataclasses.replace(self.info_provider(), beat=beat).encode())

    def _loop(self) -> None:
        parent = os.getppid()
        store = None
        timeout_s = 60.0
        backoff = 0.0
        beat = 0
        reported = False
        while True:
            last = self._stop.is_set()  # stopping: this report is the last one, written or not
            if self._moved:
                self._moved, store = False, None
            try:
                if store is None:
                    store = self._connect(timeout_s)
                    timeout_s = RECONNECT_TIMEOUT_S
                beat += 1
                self._write(store, beat)
                backoff = 0.0
            except Exception as e:  # noqa: BLE001 - any store error: reconnect and go on beating
                store = None
                if last or os.getppid() != parent:
                    return  # our parent is gone: the parent-death signal ends this process anyway
                if not reported:  # once per process: a flapping store must not flood the log
                    reported = True
                    sys.stderr.write(f"ftrun: rank {self.rank}: progress report failed ({e}); "
                                     "reconnecting to the store and retrying\n")
                backoff = min(RECONNECT_MAX_S, max(0.05, backoff * 2))
                self._stop.wait(backoff)
                continue
            if last:
                return
            self._wake.wait(HEARTBEAT_S)
            self._wake.clear()


def _parse_inject(text: str) -> tuple:
    start, _, count = text.partition(":")
    try:
        return int(start), int(count or 1)
    except ValueError:
        return 0, 0


_reporter: Optional[ProgressReporter] = None


def start_from_env() -> Optional[ProgressReporter]:
    """Start reporting if this process runs under ftrun (FTRUN_STORE is set): to its node's
    store when its node relays, else to the run's."""
    global _reporter
    s = settings.current()
    if not s.store or _reporter is not None:
        return _reporter
    node = s.relayed
    host, _, port = (node[3] if node is not None else s.store).rpartition(":")
    _reporter = ProgressReporter(host, int(port), s.rank or 0, s.restart_count, relayed=node is not None)
    _reporter.start()
    return _reporter


def reporter() -> Optional[ProgressReporter]:
    return _reporter
