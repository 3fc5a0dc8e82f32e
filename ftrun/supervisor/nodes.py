"""Several machines, one run: join, node heartbeats, and group restarts agreed through the store.

One ftrun per node; node 0's supervisor hosts the run's TCPStore and every
supervisor (node 0 included) talks to it as a client. Everything the nodes
agree on is a key under ``ftrun/nodes/``:

- join: each node bumps ``claim/K`` (a second claimant of rank K sees 2 and
  stops: exit 2) and waits until every rank is claimed; no worker starts on
  any node before that.
- liveness: a thread per node bumps ``beat/K`` every BEAT_S and reads the
  others' counters; a counter that stops moving for NODE_TIMEOUT_S (by the
  reader's own clock, so clocks need not agree) means that node went away.
  ``final/K`` holds a node's exit status once it ends, so an ended node is
  never mistaken for a lost one. Losing the store means node 0 went away.
- group restarts (without --ft): the first failure of attempt N is written to
  ``fail/N`` with compare-and-set, so every node reads the same first failure
  and, its policy counting the same attempts, makes the same decision. Every
  node stops its workers and bumps ``stopped/N``; node 0 then clears the
  workers' keys and sets ``go/N+1``; all start attempt N+1 together.
- status: each node publishes its replica table to ``table/K``; every node's
  state file carries all of them, so `ftrun status` on any node shows the run.

With --ft the replica policy and the quorum keeper handle failures; this
module then only reports lost and ended nodes to ``Supervisor._on_node_lost``
when the keeper defines it, and otherwise carries on.
Must never start or signal a worker itself (the supervisor does, through its
own methods), never decide a restart from local knowledge alone, and never
import torch at module level (the store it uses is built off the CLI path).
"""

from __future__ import annotations

import datetime
import enum
import json
import os
import signal
import socket
import threading
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from ftrun.protocol import NodeKeys
from ftrun.status.state import ReplicaStatus, WorkerState
from ftrun.supervisor.restart import Decision
from ftrun.supervisor.worker import Failure, Worker

if TYPE_CHECKING:  # pragma: no cover
    from ftrun.supervisor.run import Supervisor

BEAT_S = 0.25
NODE_TIMEOUT_S = float(os.environ.get("FTRUN_NODE_TIMEOUT", "3"))
POLL_S = 0.05
# Exit status for a run that cannot form (duplicate rank, nodes that never
# came, node 0 unreachable): nothing was started, as for bad input.
JOIN_FAILED = 2
NODE_LOST = 1

KEYS = NodeKeys()


def use_round(n: int) -> None:
    """Put every node key of this process under rendezvous round n (ftrun.protocol.NodeKeys)."""
    global KEYS
    KEYS = NodeKeys(n)


class NodeState(str, enum.Enum):
    RUNNING = "running"   # heartbeating
    ENDED = "ended"       # its ftrun finished and said so (final/K)
    LOST = "lost"         # no heartbeat for NODE_TIMEOUT_S and no final word


class StoreState(str, enum.Enum):
    UP = "up"
    LOST = "lost"         # node 0 (the store) went away


def state_dir_name(cfg: Any) -> str:
    """The run's folder name on this machine: per node, so two nodes on one machine keep apart."""
    return cfg.run_id if cfg.nnodes == 1 else f"{cfg.run_id}.node{cfg.node_rank}"


class _Watch(threading.Thread):
    """Heartbeats for this node, and the other nodes' beats, final words, tables and failures.

    Runs on its own store connection so a main loop busy stopping workers
    (up to the shutdown grace) never misses a beat."""

    def __init__(self, coord: "NodeCoordinator") -> None:
        super().__init__(name="ftrun-nodes", daemon=True)
        self.coord = coord
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.store_state = StoreState.UP
        self.store_error = ""
        self.states: Dict[int, NodeState] = {k: NodeState.RUNNING for k in coord.others}
        self.finals: Dict[int, str] = {}
        self.tables: Dict[int, List[Dict[str, Any]]] = {}
        self.fail: Dict[int, str] = {}      # attempt -> first failure (JSON), once set
        self.silent_s: Dict[int, float] = {}
        self.local_table: Optional[str] = None
        self._published: Optional[str] = None

    def run(self) -> None:
        c = self.coord
        try:
            import torch.distributed as dist

            store = dist.TCPStore(c.host, c.port, None, False, datetime.timedelta(seconds=NODE_TIMEOUT_S))
        except Exception as e:  # node 0 went away between the join and now
            self._lose_store(e)
            return
        last_value: Dict[int, bytes] = {}
        last_change: Dict[int, float] = {k: time.monotonic() for k in c.others}
        while not self.stop.is_set():
            try:
                store.add(KEYS.beat(c.me), 1)
                table = self.local_table
                if table is not None and table != self._published:
                    store.set(KEYS.table(c.me), table)
                    self._published = table
                attempt = c.attempt
                keys = ([KEYS.beat(k) for k in c.others] + [KEYS.final(k) for k in c.others]
                        + [KEYS.table(k) for k in c.others] + [KEYS.fail(attempt)])
                values = store.multi_get(keys)
            except Exception as e:
                if not self.stop.is_set():
                    self._lose_store(e)
                return
            now = time.monotonic()
            n = len(c.others)
            changed = False
            with self.lock:
                for i, k in enumerate(c.others):
                    beat, final, table_raw = values[i], values[n + i], values[2 * n + i]
                    if beat != last_value.get(k):
                        last_value[k] = beat
                        last_change[k] = now
                    self.silent_s[k] = now - last_change[k]
                    try:
                        self.tables[k] = json.loads(table_raw or b"[]")
                    except ValueError:
                        pass
                    old = self.states[k]
                    if final:
                        self.finals[k] = final.decode(errors="replace")
                        new = NodeState.ENDED
                    elif old is NodeState.LOST or now - last_change[k] > NODE_TIMEOUT_S:
                        new = NodeState.LOST
                    else:
                        new = NodeState.RUNNING
                    if new is not old:
                        self.states[k] = new
                        changed = True
                fail = values[-1]
                if fail and attempt not in self.fail:
                    self.fail[attempt] = fail.decode(errors="replace")
                    changed = True
            if changed:
                c.wake()
            self.stop.wait(BEAT_S)

    def _lose_store(self, e: BaseException) -> None:
        with self.lock:
            self.store_state = StoreState.LOST
            self.store_error = _one_line(e)
        self.coord.wake()


def _one_line(e: BaseException) -> str:
    """torch's store errors carry C++ frames after the first line; people need only the first."""
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__


class NodeCoordinator:
    """This node's side of a multi-node run; the Supervisor calls it from a few places."""

    def __init__(self, sup: "Supervisor") -> None:
        self.sup = sup
        cfg = sup.cfg
        self.cfg = cfg
        self.me = cfg.node_rank
        self.nnodes = cfg.nnodes
        self.others = [k for k in range(cfg.nnodes) if k != cfg.node_rank]
        self.host = cfg.master_addr
        self.port = cfg.master_port
        self.attempt = 0
        self._handled_attempt = -1
        self._reported: Dict[int, NodeState] = {}
        self.watch: Optional[_Watch] = None
        self.who: Dict[int, str] = {}

    # ------------------------------------------------------------ helpers
    def wake(self) -> None:
        """Wake the supervisor's loop (an unknown event is ignored there; the tick then calls check())."""
        self.sup.events.put(("nodes", None))

    @property
    def store(self) -> Any:
        return self.sup.store.store

    def _note(self, text: str, style: str = "bold yellow") -> None:
        self.sup.console.note(text, style=style)

    def _wait_signal(self, timeout: float) -> Optional[int]:
        """Sleep up to `timeout` on the supervisor's queue; a forwarded signal returns its exit status."""
        ev = self.sup._next_event(timeout)
        if isinstance(ev, tuple) and ev[0] == "signal":
            self.sup.stopped_by_signal = ev[1]
            self._note(f"received {signal.Signals(ev[1]).name}: stopping", style="bold yellow")
            return 128 + ev[1]
        return None

    def _node_name(self, k: int) -> str:
        who = self.who.get(k)
        return f"node {k}" + (f" ({who})" if who else "")

    # ------------------------------------------------------------ join
    def join(self) -> Optional[int]:
        """Block until every node has joined. None when joined, else ftrun's exit status."""
        cfg = self.cfg
        t0 = time.monotonic()
        deadline = t0 + cfg.join_timeout
        where = f"{self.host}:{self.port}"
        while not self.sup.store.ready.is_set():
            code = self._wait_signal(POLL_S)
            if code is not None:
                return code
        if self.sup.store.store is None:
            err = self.sup.store.error
            if self.me == 0:
                return self._join_failed(f"node 0 could not host the run's store on {where}: {_one_line(err)}")
            return self._join_failed(
                f"node {self.me} could not reach node 0's store at {where}: {_one_line(err)}; "
                f"check that node 0's ftrun runs with --master-port {self.port} and that {self.host} "
                f"is node 0's address as seen from this machine")
        store = self.store
        layout = f"{cfg.nnodes} {cfg.nproc} {cfg.run_id}"
        try:
            if self.me == 0:
                store.set(KEYS.layout, layout)
            else:
                while not store.check([KEYS.layout]):
                    code = self._wait_signal(POLL_S)
                    if code is not None:
                        return code
                    if time.monotonic() > deadline:
                        return self._join_failed(f"{where} answers but is not an ftrun store of this run")
                theirs = store.get(KEYS.layout).decode()
                if theirs != layout:
                    nn, npr, rid = theirs.split(" ", 2)
                    return self._join_failed(
                        f"node 0 runs --nnodes {nn} --nproc {npr} --run-id {rid}, this node --nnodes {cfg.nnodes} "
                        f"--nproc {cfg.nproc} --run-id {cfg.run_id}; every node needs the same three")
            # This node's keys exist before it claims its rank, so the others'
            # multi_get never waits on a key that is not there yet.
            store.set(KEYS.beat(self.me), "0")
            store.set(KEYS.final(self.me), "")
            store.set(KEYS.table(self.me), "[]")
            store.compare_set(KEYS.fail(0), "", "")
            if store.add(KEYS.claim(self.me), 1) > 1:
                holder = store.get(KEYS.who(self.me)).decode() if store.check([KEYS.who(self.me)]) else "another ftrun"
                return self._join_failed(
                    f"node rank {self.me} is already taken by {holder}; give each node its own --node-rank "
                    f"(0..{cfg.nnodes - 1})")
            store.set(KEYS.who(self.me), f"{socket.gethostname()} pid {os.getpid()}")
            claims = [KEYS.claim(k) for k in range(self.nnodes)]
            while True:
                if store.check(claims):
                    break
                if time.monotonic() > deadline:
                    missing = [str(k) for k in range(self.nnodes) if not store.check([KEYS.claim(k)])]
                    hint = (" (under Slurm: start ftrun with srun, one task per node)"
                            if os.environ.get("SLURM_JOB_ID") else "")
                    return self._join_failed(
                        f"node{'s' if len(missing) > 1 else ''} {', '.join(missing)} of {self.nnodes} did not join "
                        f"within --join-timeout {cfg.join_timeout:g} s; start ftrun there with the same --nnodes, "
                        f"--master-addr {self.host} and --master-port {self.port}{hint}")
                code = self._wait_signal(POLL_S)
                if code is not None:
                    return code
            for k in self.others:
                if store.check([KEYS.who(k)]):
                    self.who[k] = store.get(KEYS.who(k)).decode()
        except Exception as e:  # node 0 went away while we joined
            return self._join_failed(f"lost node 0's store at {where} while joining: {_one_line(e)}")
        self.watch = _Watch(self)
        self.watch.start()
        self._note(f"node {self.me} of {self.nnodes}: all nodes joined run {cfg.run_id} at {where} "
                   f"in {time.monotonic() - t0:.1f} s; ranks {self.me * cfg.nproc}..{(self.me + 1) * cfg.nproc - 1} "
                   f"of {cfg.world_size} start here", style="bold blue")
        return None

    def _join_failed(self, text: str) -> int:
        # One line, as for any bad input: nothing was started.
        self.sup.console.note(f"error: {text}", style="bold red")
        self.sup.status.exit_summary = text
        return JOIN_FAILED

    # ------------------------------------------------------------ watching (every tick)
    def check(self) -> Optional[int]:
        """After each tick: act on a lost store, lost or ended nodes, and other nodes' failures."""
        w = self.watch
        if w is None:
            return None
        with w.lock:
            store_state, store_error = w.store_state, w.store_error
            states = dict(w.states)
            finals = dict(w.finals)
            silent = dict(w.silent_s)
            fail = w.fail.get(self.attempt)
        if store_state is StoreState.LOST:
            return self._store_gone(store_error)
        # Another node's failure first: a node that gave up on it also ends, and
        # its end must not be reported as the cause.
        if fail and not self.cfg.ft and self._handled_attempt < self.attempt:
            return self.on_group_failure(None, None, fail)
        for k, st in states.items():
            if st is NodeState.RUNNING or self._reported.get(k) is st:
                continue
            self._reported[k] = st
            if st is NodeState.ENDED and finals.get(k) == "0":
                continue  # its workers finished; ours are finishing too
            what = (f"went away (no heartbeat for {silent.get(k, NODE_TIMEOUT_S):.1f} s)" if st is NodeState.LOST
                    else f"ended (exit {finals.get(k)})")
            if self.cfg.ft:
                hook = getattr(self.sup, "_on_node_lost", None)
                self._note(f"{self._node_name(k)} {what}; carrying on without its replicas (--ft)")
                if hook is not None:
                    hook(k)
                continue
            self._note(f"{self._node_name(k)} {what}; stopping this node's workers "
                       f"(without --ft the run needs every node)", style="bold red")
            self.sup.status.exit_summary = f"node {k} {what}"
            self.sup._stop_all(signal.SIGTERM, self.cfg.shutdown_timeout)
            return NODE_LOST
        return None

    def _store_gone(self, why: str) -> int:
        where = f"{self.host}:{self.port}"
        live = [w for w in self.sup.workers if w.alive]
        self._note(f"node 0 (the run's store at {where}) went away ({why}); stopping this node's "
                   f"{len(live)} worker{'s' if len(live) != 1 else ''}", style="bold red")
        self.sup.status.exit_summary = f"node 0 (the run's store) went away"
        self.sup._stop_all(signal.SIGTERM, self.cfg.shutdown_timeout)
        if self.watch is not None:
            self.watch.stop.set()
        return NODE_LOST

    def _lost_nodes(self) -> List[int]:
        w = self.watch
        if w is None:
            return []
        with w.lock:
            return [k for k, st in w.states.items() if st is NodeState.LOST
                    or st is NodeState.ENDED and w.finals.get(k) != "0"]

    def _ended_nodes(self) -> List[tuple]:
        w = self.watch
        if w is None:
            return []
        with w.lock:
            return [(k, w.finals.get(k)) for k, st in sorted(w.states.items()) if st is NodeState.ENDED]

    def _store_lost(self) -> bool:
        w = self.watch
        return w is not None and w.store_state is StoreState.LOST

    # ------------------------------------------------------------ group restarts
    def on_group_failure(self, w: Optional[Worker], failure: Optional[Failure],
                         remote: Optional[str] = None) -> Optional[int]:
        """A failure in attempt N, here (w, failure) or on another node (remote): the same decision everywhere."""
        sup = self.sup
        n = self.attempt
        self._handled_attempt = n
        if w is not None:
            w.state = WorkerState.FAILED
        try:
            if failure is not None:
                mine = json.dumps({"node": self.me, "rank": failure.rank, "reason": failure.reason,
                                   "code": failure.status_code})
                # The first failure of the attempt wins on every node; later ones are its echoes.
                first = self.store.compare_set(KEYS.fail(n), "", mine).decode()
            else:
                first = remote or ""
            info = json.loads(first)
        except Exception as e:
            if failure is not None and not self._store_reachable():
                return self._store_gone(_one_line(e))
            info = {"node": self.me, "rank": failure.rank if failure else -1,
                    "reason": failure.reason if failure else "failed", "code": failure.status_code if failure else 1}
        origin = f"rank {info['rank']} on node {info['node']}"
        decision = sup.policy.on_failure(int(info["rank"]))
        others = [o for o in sup.workers if o is not w and o.alive]
        if decision is not Decision.RESTART_GROUP and self.cfg.total_restarts is not None \
                and self.cfg.round < self.cfg.total_restarts:
            # c10d: a failure ends the round; every node comes back to re-form (ftrun.supervisor.rendezvous).
            self._note(f"{origin} {info['reason']}; ending round {self.cfg.round}: every node stops its workers "
                       f"and the run re-forms", style="bold yellow")
            sup._stop_workers(others, signal.SIGTERM, self.cfg.shutdown_timeout)
            sup.status.exit_summary = f"{origin} {info['reason']}"
            return int(info.get("code") or 1)
        if decision is not Decision.RESTART_GROUP:
            if failure is not None and info["node"] == self.me and info["rank"] == failure.rank:
                sup._stop_workers(others, signal.SIGTERM, self.cfg.shutdown_timeout)
                return sup._give_up(failure)
            self._note(f"{origin} {info['reason']}; restart budget spent ({self.cfg.max_restarts} restart"
                       f"{'s' if self.cfg.max_restarts != 1 else ''}); stopping this node's workers",
                       style="bold red")
            sup._stop_workers(others, signal.SIGTERM, self.cfg.shutdown_timeout)
            sup.status.exit_summary = f"{origin} {info['reason']}"
            return int(info.get("code") or 1)
        self._note(f"{origin} {info['reason']}; restarting all {self.cfg.world_size} workers on {self.nnodes} nodes "
                   f"(restart {sup.policy.restarts} of {sup.policy.max_restarts})")
        for o in sup.workers:
            o.state = WorkerState.RESTARTING if o is w or o.alive else o.state
        sup._stop_workers(others, signal.SIGTERM, self.cfg.shutdown_timeout)
        code = self._attempt_barrier(n, int(info.get("code") or 1))
        if code is not None:
            return code
        self.attempt = n + 1
        sup.status.group_restarts = sup.policy.restarts
        for o in sup.workers:
            o.incarnation = sup.policy.restarts
            o.restarts = sup.policy.restarts
            sup._spawn(o)
        sup.first_failure = None
        return None

    def _attempt_barrier(self, n: int, fail_code: int) -> Optional[int]:
        """Every node has stopped attempt n; node 0 has cleaned the store; attempt n+1 may start.

        None when attempt n+1 may start; else ftrun's exit status (`fail_code`
        when the group cannot restart because a node has already ended)."""
        store = self.store
        # Long enough for the slowest node to notice (a beat), stop (grace, then SIGKILL) and report.
        deadline = time.monotonic() + self.cfg.shutdown_timeout + NODE_TIMEOUT_S + 15.0
        try:
            store.add(KEYS.stopped(n), 1)
            while True:
                if self.me == 0:
                    if store.add(KEYS.stopped(n), 0) >= self.nnodes:
                        self.sup._clean_store_for_new_attempt()
                        store.compare_set(KEYS.fail(n + 1), "", "")
                        store.set(KEYS.go(n + 1), "1")
                        return None
                elif store.check([KEYS.go(n + 1)]):
                    return None
                if self._store_lost():
                    return self._store_gone(self.watch.store_error if self.watch else "")
                lost = self._lost_nodes()
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
            return self._store_gone(_one_line(e))

    def _store_reachable(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=1.0):
                return True
        except OSError:
            return False

    # ------------------------------------------------------------ status
    def all_replicas(self, local: List[ReplicaStatus]) -> List[ReplicaStatus]:
        """This node's replicas (published for the others) followed by every other node's."""
        w = self.watch
        if w is None:
            return local
        w.local_table = json.dumps([asdict(r) for r in local], separators=(",", ":"))
        known = set(ReplicaStatus.__dataclass_fields__)
        out = list(local)
        with w.lock:
            tables = dict(w.tables)
            states = dict(w.states)
        for k in sorted(tables):
            for r in tables[k]:
                rep = ReplicaStatus(**{key: v for key, v in r.items() if key in known})
                if states.get(k) is NodeState.LOST and rep.state not in ("done", "failed", "stopped"):
                    rep.state = "lost"
                out.append(rep)
        out.sort(key=lambda r: r.rank)
        return out

    # ------------------------------------------------------------ leaving
    def leave(self, code: int) -> None:
        """Say how this node ended; node 0 keeps the store up until every other node has said so too."""
        w = self.watch
        if w is None:
            return
        try:
            if not self._store_lost():
                self.store.set(KEYS.final(self.me), str(code))
        except Exception:
            pass
        if self.me == 0:
            self._wait_for_others()
        w.stop.set()

    def _wait_for_others(self) -> None:
        """Node 0 hosts the store: leaving before the others have ended would strand them.

        --rdzv-conf close_timeout=S bounds the wait (torchrun's time for a run to close);
        without it node 0 waits as long as the others keep beating."""
        announced = False
        close = self.cfg.close_timeout if "close_timeout" in self.cfg.rdzv_conf else None
        deadline = time.monotonic() + close if close is not None else None
        while True:
            if deadline is not None and time.monotonic() > deadline:
                self._note(f"other nodes still running after close_timeout={close:g} s; leaving", style="bold red")
                return
            w = self.watch
            with w.lock:
                pending = [k for k, st in w.states.items() if st is NodeState.RUNNING]
                lost = [k for k, st in w.states.items() if st is NodeState.LOST]
            for k in lost:
                if self._reported.get(k) is not NodeState.LOST:
                    self._reported[k] = NodeState.LOST
                    self._note(f"{self._node_name(k)} went away (no heartbeat for {NODE_TIMEOUT_S:g} s)",
                               style="bold red")
            if not pending or w.store_state is StoreState.LOST:
                return
            if not announced:
                announced = True
                self._note(f"waiting for node{'s' if len(pending) > 1 else ''} {', '.join(map(str, pending))} "
                           f"to end (this node hosts the run's store)", style="dim")
            if self._wait_signal(POLL_S) is not None:
                return
