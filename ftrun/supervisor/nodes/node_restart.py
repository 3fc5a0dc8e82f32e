"""Group restarts agreed across nodes (without --ft): the first failure of an attempt, and the
barrier between two attempts.

The first failure of attempt N is written to ``fail/N`` with compare-and-set, so every node reads
the same first failure and, its policy counting the same attempts, makes the same decision (the
decision is the supervisor loop's). Every node stops its workers and bumps ``stopped/N``; node 0
then clears the workers' keys, keeps rank 0's last report for the others' goodput, and sets
``go/N+1``; all start attempt N+1 together.
Functions of the coordinator (ftrun.supervisor.nodes.coordinator), which they read; the coordinator moves its
own attempt on what attempt_barrier() returns.
Must never start, stop or signal a worker, never write the coordinator's fields, and never
decide whether the group restarts.
"""

from __future__ import annotations

import socket
import time
from typing import Any, Optional, Union

from ftrun.keys import progress_key
from ftrun.supervisor.nodes import node_common as nc
from ftrun.supervisor.nodes.node_common import NODE_LOST, NODE_TIMEOUT_S, POLL_S, NodeEvent
from ftrun.wire import one_line
from ftrun.supervisor.workers.worker import Failure
from ftrun.wire import UNKNOWN_FAILURE, FirstFailure, ProgressReport


class NextAttempt(int):
    """attempt_barrier(): every node stopped; attempt N (this number) may start."""


def first_failure(self: Any, failure: Optional[Failure], remote: Optional[FirstFailure] = None) -> FirstFailure:
    """The first failure of the current attempt, the same on every node: this node's
    (`failure`, written with compare_set: the first writer wins) or another node's
    (`remote`, already agreed). Raises if the store is unreachable."""
    if failure is None:
        return remote or UNKNOWN_FAILURE
    mine = FirstFailure(self.me, failure.rank, failure.reason, failure.status_code, failure.signature)
    return FirstFailure.decode(self.store.compare_set(nc.KEYS.fail(self.attempt), "", mine.encode()))


def store_reachable(host: str, port: int, probes: int = 5) -> bool:
    """Whether the store's port still answers: `probes` connections 0.1 s apart all get in. One
    is not enough: a store whose process is being killed resets its connections before the
    kernel closes its listening socket."""
    for i in range(probes):
        if i:
            time.sleep(0.1)
        try:
            with socket.create_connection((host, port), timeout=1.0):
                pass
        except OSError:
            return False
    return True


def _keep_rank0_report(self: Any, n: int) -> None:
    """Node 0, every node stopped: keep rank 0's last report of attempt n for the other nodes
    (rank0_report), before attempt n+1's rank 0 replaces it."""
    try:
        if self.run_store.store.check([progress_key(0)]):
            self.store.set(nc.KEYS.report0(n), self.run_store.store.get(progress_key(0)))
    except Exception:  # only the goodput estimate of the other nodes depends on it
        pass


def rank0_report(store: Any, n: int) -> Optional[ProgressReport]:
    """Rank 0's last progress report of attempt n, as node 0 kept it; None when it did not."""
    try:
        if not store.check([nc.KEYS.report0(n)]):
            return None
        raw = store.get(nc.KEYS.report0(n))
    except Exception:  # the store went away: this node's own reports stand
        return None
    return ProgressReport.decode(raw)


def attempt_barrier(self: Any, fail_code: int) -> Union[NextAttempt, NodeEvent, int]:
    """After this node stopped its workers of the current attempt n: wait until every node
    has; node 0 then clears the workers' keys and lets attempt n+1 start.

    NextAttempt(n+1) when attempt n+1 may start (the coordinator then moves to it); else ftrun's
    exit status (`fail_code` when a node has already ended) or the NodeEvent that
    ended the wait (a lost node, the store gone)."""
    n = self.attempt
    store = self.store
    # Long enough for the slowest node to notice (a beat), stop (grace, then SIGKILL) and report.
    deadline = time.monotonic() + self.cfg.shutdown_timeout + NODE_TIMEOUT_S + 15.0
    try:
        store.add(nc.KEYS.stopped(n), 1)
        while True:
            if self.me == 0:
                if store.add(nc.KEYS.stopped(n), 0) >= self.nnodes:
                    try:
                        self.run_store.clear_worker_keys()
                    except Exception as e:  # the attempt may still work; say why it might not
                        self._note(f"could not clear the store between attempts: {e}")
                    _keep_rank0_report(self, n)
                    store.compare_set(nc.KEYS.fail(n + 1), "", "")
                    store.set(nc.KEYS.go(n + 1), "1")
                    return NextAttempt(n + 1)
            elif store.check([nc.KEYS.go(n + 1)]):
                return NextAttempt(n + 1)
            if self._store_lost():
                return self.store_gone(self.watch.view().store_error if self.watch else "")
            lost = self.lost_nodes()
            if lost:
                return self.check() or NODE_LOST
            ended = self._ended_nodes()
            if ended:
                # Its workers finished before the failure: a restarted group could never be whole.
                k, final = ended[0]
                self._note(f"{self._node_name(k)} has already ended (exit {final}); the group cannot restart "
                           f"without it: stopping", style="bold red")
                return fail_code
            if time.monotonic() > deadline:
                self._note(f"the other nodes did not stop attempt {n} in time; stopping", style="bold red")
                return NODE_LOST
            code = self._wait_signal(POLL_S)
            if code is not None:
                return code
    except Exception as e:
        return self.store_gone(one_line(e))
