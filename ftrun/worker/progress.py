"""Progress reports from inside a worker: heartbeats and optimizer steps, via the store.

A global optimizer step hook counts steps with no change to the user's script;
a daemon thread writes `incarnation steps last_step_time now` to the
supervisor's store every HEARTBEAT_S (and at once after the first step), so
the supervisor can show live health and spot a hung rank.
Must never block or slow the training loop: the hook only bumps a counter.
Must never import the supervisor.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Optional

from ftrun.protocol import HEARTBEAT_S, info_key, progress_key


class ProgressReporter:
    """Counts optimizer steps and reports them, with a heartbeat, to the store."""

    def __init__(self, host: str, port: int, rank: int, incarnation: int) -> None:
        self.host, self.port = host, port
        self.rank = rank
        self.incarnation = incarnation
        self.steps = 0
        self.last_step_time = 0.0
        self.global_step: Optional[int] = None  # set by ftrun.ft, which counts committed steps
        self.info_provider = None  # ftrun.ft: a callable returning a JSON-able dict for `ftrun status`
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ftrun-progress", daemon=True)

    def start(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        register_optimizer_step_post_hook(self._on_step)
        self._thread.start()

    def _on_step(self, *_args) -> None:
        self.steps += 1
        self.last_step_time = time.time()
        if self.steps == 1:
            self._wake.set()

    def note_step(self, step: int) -> None:
        """For ftrun.ft: the global step just committed."""
        self.global_step = step
        self.last_step_time = time.time()

    def _loop(self) -> None:
        import datetime

        import torch.distributed as dist

        try:
            store = dist.TCPStore(self.host, self.port, None, False, datetime.timedelta(seconds=60))
        except Exception:
            return  # no store, no reports; training itself is unaffected
        key = progress_key(self.rank)
        beat = 0
        while not self._stop.is_set():
            steps = self.global_step if self.global_step is not None else self.steps
            beat += 1
            try:
                store.set(key, f"{self.incarnation} {steps} {self.last_step_time:.3f} {time.time():.3f} {os.getpid()}")
                if self.info_provider is not None:
                    # "beat" changes every report, so the keeper can tell a live report from a stale one.
                    store.set(info_key(self.rank), json.dumps({**self.info_provider(), "beat": beat}))
            except Exception:
                return  # the supervisor is gone; the parent-death signal ends us
            self._wake.wait(HEARTBEAT_S)
            self._wake.clear()


_reporter: Optional[ProgressReporter] = None


def start_from_env() -> Optional[ProgressReporter]:
    """Start reporting if this process runs under ftrun (FTRUN_STORE is set)."""
    global _reporter
    store = os.environ.get("FTRUN_STORE")
    if not store or _reporter is not None:
        return _reporter
    host, _, port = store.rpartition(":")
    _reporter = ProgressReporter(host, int(port), int(os.environ.get("RANK", "0")),
                                 int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    _reporter.start()
    return _reporter


def reporter() -> Optional[ProgressReporter]:
    return _reporter
