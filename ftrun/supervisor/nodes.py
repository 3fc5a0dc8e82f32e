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
- late nodes (--ft on an elastic c10d run): node 0 keeps the run's node list
  in ``live``; it sees late nodes arrive at the round (the rendezvous
  counter), reports each as "node_waiting", and carries out the agent's
  admission (admit(): the node's admit key, a longer ``live``). Every other
  node reports a node new in ``live`` as "node_joined" and watches it too.
- status: each node publishes its replica table to ``table/K``; every node's
  state file carries all of them, so `ftrun status` on any node shows the run.
- the store moves (--ft, three nodes or more, static or elastic c10d): every
  node but node 0 hosts a standby store and publishes its address in
  ``standby/K`` (a late node as it asks in); when the store is lost,
  fail_over() carries out the election of ftrun.supervisor.failover and
  follows the new host (which then plays node 0's part here, but for taking
  late nodes in); majority_kept() says whether the host may go on after
  losing nodes. Majorities count the run's nodes (layout_size): a static
  layout's, or on an elastic run every node taken in on this store but those
  that ended and said so, and late nodes never seen to beat (they lose the
  store before their first beat mid-join and stop: counting them would leave
  the others short of a majority they hold). Under c10d without --ft the
  rendezvous keeps each node's standby store across rounds and moves the
  store between two rounds; a round only publishes it here and says whether
  a move may follow (may_move_between_rounds()).

It is a source of events and a set of agreements for the supervisor's one
loop (ftrun.supervisor.run): `check()` reports what happened to the other
nodes and the store as a NodeEvent, `first_failure()` and
`attempt_barrier()` carry out the cross-node agreements of a group restart;
the loop decides and acts. Must never start, stop or signal a worker, never
decide a restart, never hold the Supervisor, and never import torch at module
level (the store it uses is built off the CLI path).
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
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional, Set

from ftrun.protocol import (EXIT_FAILED, progress_key, EXIT_REQUEUE, EXIT_SIGNAL_BASE, EXIT_USAGE, RDZV, RDZV_HOST, NodeKeys, rdzv_admit,
                            rdzv_arrivals)
from ftrun.status.state import ReplicaStatus
from ftrun.supervisor import failover
from ftrun.supervisor.logs import ConsoleOut
from ftrun.supervisor.store import BoundedStore, RunStore, bind_listener
from ftrun.supervisor.worker import Failure

BEAT_S = 0.25
def _node_timeout() -> float:
    try:  # checked with the rest of the input (ftrun.config.validate); never a crash at import
        return min(3600.0, max(0.5, float(os.environ.get("FTRUN_NODE_TIMEOUT", "3"))))
    except ValueError:
        return 3.0


NODE_TIMEOUT_S = _node_timeout()
POLL_S = 0.05
# Exit status for a run that cannot form (duplicate rank, nodes that never
# came, node 0 unreachable): nothing was started, as for bad input.
JOIN_FAILED = EXIT_USAGE
NODE_LOST = EXIT_FAILED
# --ft, node 0 (the run's store and quorum keeper) lost: the other nodes end with this status,
# for schedulers to requeue the job, which resumes from --checkpoint-dir (ftrun.protocol).
REQUEUE = EXIT_REQUEUE

KEYS = NodeKeys()
# Fault injection for tests: a late node holds here, taken in but not yet joined (no beat),
# until this file exists (at most a minute).
INJECT_JOIN_HOLD_ENV = "FTRUN_INJECT_JOIN_HOLD"


def use_round(n: int) -> None:
    """Put every node key of this process under rendezvous round n (ftrun.protocol.NodeKeys)."""
    global KEYS
    KEYS = NodeKeys(n)


class NodeState(str, enum.Enum):
    RUNNING = "running"   # heartbeating
    ENDED = "ended"       # its ftrun finished and said so (final/K)
    LOST = "lost"         # no heartbeat for NODE_TIMEOUT_S and no final word


@dataclass(frozen=True)
class NodeEvent:
    """What check() saw. kind: "store_gone" (the store's host went away), "node_lost" (node `node`
    went away or ended in failure; `text` says which), "remote_failure" (another node's
    first failure of the current attempt, `info` as agreed in the store); with --ft on an
    elastic c10d run, "node_waiting" (node 0: late node `node` asks to join the running
    round) and "node_joined" (node 0 took late node `node` in)."""

    kind: str
    text: str = ""
    node: int = -1
    info: Optional[Dict[str, Any]] = None


class StoreState(str, enum.Enum):
    UP = "up"
    LOST = "lost"         # node 0 (the store) went away


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
        self.joined: List[int] = []   # late nodes seen in the live list, not yet reported
        self.arrived = 0              # node 0: arrivals at the round (node ranks 1..arrived-1 asked in)

    def run(self) -> None:
        c = self.coord
        try:
            import torch.distributed as dist

            # Bounded: a machine that vanished without a reset would hold an add for ever.
            store = BoundedStore(dist.TCPStore(c.host, c.port, None, False, datetime.timedelta(seconds=NODE_TIMEOUT_S)),
                                 NODE_TIMEOUT_S)
        except Exception as e:  # node 0 went away between the join and now
            self._lose_store(e)
            return
        last_value: Dict[int, bytes] = {}
        last_change: Dict[int, float] = {k: time.monotonic() for k in c.others}
        while not self.stop.is_set():
            others = list(c.others)
            try:
                store.add(KEYS.beat(c.me), 1)
                table = self.local_table
                if table is not None and table != self._published:
                    store.set(KEYS.table(c.me), table)
                    self._published = table
                attempt = c.attempt
                keys = ([KEYS.beat(k) for k in others] + [KEYS.final(k) for k in others]
                        + [KEYS.table(k) for k in others] + [KEYS.fail(attempt), KEYS.live])
                values = store.multi_get(keys)
                # node 0 alone: how many nodes asked to join the round (--ft takes late nodes in)
                arrived = 1 + int(store.add(c.arrivals_key, 0)) if c.arrivals_key else 0
            except Exception as e:
                if not self.stop.is_set():
                    self._lose_store(e)
                return
            now = time.monotonic()
            n = len(others)
            changed = False
            with self.lock:
                for i, k in enumerate(others):
                    beat, final, table_raw = values[i], values[n + i], values[2 * n + i]
                    if beat != last_value.get(k):
                        last_value[k] = beat
                        last_change[k] = now
                        if beat and beat != b"0":  # its first beat: a late node has finished joining
                            c.beaten.add(k)
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
                fail = values[-2]
                if fail and attempt not in self.fail:
                    self.fail[attempt] = fail.decode(errors="replace")
                    changed = True
                for k in _node_list(values[-1]):
                    if k != c.me and k not in self.states:  # node 0 took a late node in
                        self.states[k] = NodeState.RUNNING
                        last_change[k] = now
                        c.others.append(k)
                        self.joined.append(k)
                        changed = True
                if arrived > self.arrived:
                    self.arrived = arrived
                    changed = True
            if changed:
                c.wake()
            self.stop.wait(BEAT_S)

    def _lose_store(self, e: BaseException) -> None:
        with self.lock:
            self.store_state = StoreState.LOST
            self.store_error = _one_line(e)
        self.coord.wake()


def route_ip(host: str) -> str:
    """This machine's address on the way to `host` (the interface the others reach us on); no packet
    is sent: connecting a UDP socket only picks the route."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return host


def _node_list(raw: bytes) -> List[int]:
    try:
        return [int(k) for k in json.loads(raw or b"[]")]
    except (ValueError, TypeError):
        return []


def _one_line(e: BaseException) -> str:
    """torch's store errors carry C++ frames after the first line; people need only the first."""
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__


class NodeCoordinator:
    """This node's side of a multi-node run: an event source and the agreements between nodes.

    `wake` posts an event to the supervisor's queue (its loop then calls check());
    `signalled` says whether a signal asked the run to stop (waits here end at once)."""

    def __init__(self, cfg: Any, run_store: RunStore, console: ConsoleOut, wake: Callable[[], None],
                 signalled: Callable[[float], Optional[int]], standby: Optional[RunStore] = None) -> None:
        self.run_store = run_store
        self.console = console
        self._wake = wake
        self._signalled = signalled
        self.summary = ""  # the one line a failed join ended with
        self.cfg = cfg
        self.me = cfg.node_rank
        self.nnodes = cfg.nnodes
        self.host = cfg.master_addr
        self.port = cfg.master_port
        self.attempt = 0
        self._handled_attempt = -1
        self._reported: Dict[int, NodeState] = {}
        self.watch: Optional[_Watch] = None
        self.who: Dict[int, str] = {}
        # --ft on an elastic c10d run: nodes may join the running round. `live` is the run's
        # node list as node 0 keeps it; node 0 watches the round's arrivals for late nodes.
        self.late = cfg.nodes_live is not None
        self.live: List[int] = list(cfg.nodes_live) if self.late else list(range(cfg.nnodes))
        self.others = [k for k in self.live if k != cfg.node_rank]
        self.arrivals_key = rdzv_arrivals(cfg.round) if cfg.admits_late and self.me == 0 else ""
        self._next_arrival = cfg.nnodes
        self.waiting: List[int] = []  # node 0: late nodes waiting for a place (the run has max nodes)
        self.waits: Any = None  # ftrun.supervisor.waits.Waits: progress while the nodes join, on a terminal
        # --ft on three nodes or more: the store moves when its node is lost
        # (ftrun.supervisor.failover). Every node but node 0 hosts a standby store from the start.
        self.host_node = 0
        self.gen = 0
        # The run's nodes on this store, the lost included: majorities count them all. A static
        # layout has its nnodes; an elastic one also counts every node taken in since (_seen).
        self._seen = set(self.live)
        # Late nodes taken in (elastic) and the nodes seen to beat: a late node counts in majorities
        # once it has beaten, i.e. finished its join (see layout_size).
        self._late: Set[int] = set()
        self.beaten: Set[int] = set()
        self.elastic = cfg.rdzv == "c10d"
        self.can_move = bool(cfg.ft and (self.elastic or cfg.nnodes >= 3))
        self.standby: Dict[int, str] = {}
        # c10d: the rendezvous keeps this node's standby store for the whole run (ftrun.supervisor.
        # rendezvous); without --ft it moves the store between two rounds, this round publishes it.
        self.node_store: Optional[RunStore] = standby
        # --ft: every node but node 0 (which hosts the run's store) has a store of its own, through
        # which its workers vote (ftrun.supervisor.relay); on three nodes or more it is also the
        # node's standby store. A static layout's is made here, an elastic one's by the rendezvous.
        if cfg.ft and standby is None and cfg.rdzv == "static" and cfg.nnodes >= 2 and self.me != 0:
            ip = route_ip(self.host)
            listener = bind_listener(ip, 0)
            self.node_store = RunStore(ip, listener.getsockname()[1], listener)

    # ------------------------------------------------------------ helpers
    @property
    def layout_size(self) -> int:
        """The run's nodes a majority is counted from: the lost ones too (a node cut off may still
        run), but on an elastic run not the nodes that ended and said so (they never act again),
        nor late nodes never seen to beat. Such a node lost the store before it finished joining
        and stops; it can take part in no move, and counting it could leave the nodes that remain
        short of a majority they hold. Sides that differ by a node in this way can never both hold
        a majority: floor((n-1)/2) + 1 + floor(n/2) + 1 nodes are more than the n - 1 beside the
        lost host."""
        if not (self.elastic and self.cfg.ft):  # without --ft every node ends a round that re-forms
            return self.nnodes
        ended = {k for k, _ in self._ended_nodes()}
        return len(self._seen - ended - (self._late - self.beaten))

    def wake(self) -> None:
        self._wake()

    @property
    def store(self) -> Any:
        return self.run_store.store

    def _note(self, text: str, style: str = "bold yellow") -> None:
        self.console.note(text, style=style)

    def _wait_signal(self, timeout: float) -> Optional[int]:
        """Wait up to `timeout` (a poll interval of a store wait); a signal that asks the run
        to stop ends it at once with that signal's exit status."""
        signum = self._signalled(timeout)
        if signum is not None:
            self._note(f"received {signal.Signals(signum).name}: stopping", style="bold yellow")
            return EXIT_SIGNAL_BASE + signum
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
        while not self.run_store.ready.is_set():
            code = self._wait_signal(POLL_S)
            if code is not None:
                return code
        if self.run_store.store is None:
            err = self.run_store.error
            if self.me == 0:
                return self._join_failed(f"node 0 could not host the run's store on {where}: {_one_line(err)}")
            return self._join_failed(
                f"node {self.me} could not reach node 0's store at {where}: {_one_line(err)}; "
                f"check that node 0's ftrun runs with --master-port {self.port} and that {self.host} "
                f"is node 0's address as seen from this machine")
        store = self.store
        if self.late:
            return self._join_late(t0, where)
        layout = f"{cfg.nnodes} {cfg.nproc} {cfg.run_id}"
        try:
            if self.me == 0:
                store.set(KEYS.live, json.dumps(self.live))
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
            if self.node_store is not None:
                store.set(KEYS.standby(self.me), f"{self.node_store.host}:{self.node_store.port}")
            if store.add(KEYS.claim(self.me), 1) > 1:
                holder = store.get(KEYS.who(self.me)).decode() if store.check([KEYS.who(self.me)]) else "another ftrun"
                return self._join_failed(
                    f"node rank {self.me} is already taken by {holder}; give each node its own --node-rank "
                    f"(0..{cfg.nnodes - 1})")
            store.set(KEYS.who(self.me), f"{socket.gethostname()} pid {os.getpid()}")
            claims = [KEYS.claim(k) for k in range(self.nnodes)]
            since = time.time()
            while True:
                if store.check(claims):
                    break
                if self.waits is not None and self.waits.enabled:  # a person waits at a terminal
                    joined = sum(1 for c in claims if store.check([c]))
                    self.waits.sync({"nodes": (f"waiting for the nodes of run {cfg.run_id} to join", since, joined,
                                               self.nnodes)}, time.time())
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
                if (cfg.ft or self.node_store is not None) and store.check([KEYS.standby(k)]):  # node 0 routes votes there
                    self.standby[k] = store.get(KEYS.standby(k)).decode()
            if self.node_store is not None:
                self.standby[self.me] = f"{self.node_store.host}:{self.node_store.port}"
        except Exception as e:  # node 0 went away while we joined
            return self._join_failed(f"lost node 0's store at {where} while joining: {_one_line(e)}")
        self.watch = _Watch(self)
        self.watch.start()
        self._note(f"node {self.me} of {self.nnodes}: all nodes joined run {cfg.run_id} at {where} "
                   f"in {time.monotonic() - t0:.1f} s; ranks {self.me * cfg.nproc}..{(self.me + 1) * cfg.nproc - 1} "
                   f"of {cfg.world_size} start here", style="bold blue")
        return None

    def _join_late(self, t0: float, where: str) -> Optional[int]:
        """A node node 0 took into a running --ft round (ftrun.supervisor.rendezvous): the
        others are already training, so there is no barrier; its replicas join the quorum and heal."""
        cfg = self.cfg
        hold = os.environ.get(INJECT_JOIN_HOLD_ENV)
        if hold:
            deadline = time.monotonic() + 60
            while not os.path.exists(hold) and time.monotonic() < deadline:
                code = self._wait_signal(POLL_S)
                if code is not None:
                    return code
        try:  # its beat, final, table, standby and who keys were written when it asked in
            self.store.add(KEYS.claim(self.me), 1)
            if self.store.check([RDZV_HOST]):  # a store that moved: its host, and how often it moved
                host_node, gen = self.store.get(RDZV_HOST).decode().split()
                self.host_node, self.gen = int(host_node), int(gen)
            for k in self.others:
                self._learn_who(k)
            if self.node_store is not None:
                self.standby[self.me] = f"{self.node_store.host}:{self.node_store.port}"
        except Exception as e:
            return self._join_failed(f"lost node 0's store at {where} while joining: {_one_line(e)}")
        self.watch = _Watch(self)
        self.watch.start()
        self._note(f"node {self.me}: joined the running run {cfg.run_id} at {where} in {time.monotonic() - t0:.1f} s "
                   f"beside node{'s' if len(self.others) > 1 else ''} {', '.join(map(str, self.others))}; ranks "
                   f"{self.me * cfg.nproc}..{(self.me + 1) * cfg.nproc - 1} start here and heal from a peer",
                   style="bold blue")
        return None

    def _join_failed(self, text: str) -> int:
        # One line, as for any bad input: nothing was started.
        self.console.note(f"error: {text}", style="bold red")
        self.summary = text
        return JOIN_FAILED

    # ------------------------------------------------------------ watching (every tick)
    def check(self) -> Optional[NodeEvent]:
        """After each tick: what happened to the store, the other nodes, and their failures."""
        w = self.watch
        if w is None:
            return None
        with w.lock:
            store_state, store_error = w.store_state, w.store_error
            states = dict(w.states)
            finals = dict(w.finals)
            silent = dict(w.silent_s)
            fail = w.fail.get(self.attempt)
            joined = w.joined.pop(0) if w.joined else None
            arrived = w.arrived
        if store_state is StoreState.LOST:
            return self.store_gone(store_error)
        # Another node's failure first: a node that gave up on it also ends, and
        # its end must not be reported as the cause.
        if fail and not self.cfg.ft and self._handled_attempt < self.attempt:
            try:
                return NodeEvent("remote_failure", info=json.loads(fail))
            except ValueError:
                return NodeEvent("remote_failure", info={"node": -1, "rank": -1, "reason": "failed", "code": 1})
        if joined is not None:
            self._learn_who(joined)
            if joined not in self.live:
                self.live.append(joined)
            self._seen.add(joined)
            self._late.add(joined)
            return NodeEvent("node_joined", f"{self._node_name(joined)} joined the running run", node=joined)
        if arrived > self._next_arrival:
            k = self._next_arrival
            try:
                ready = self.store.check([KEYS.who(k)])  # it wrote its keys: the others may read them
            except Exception as e:
                return self.store_gone(_one_line(e))
            if ready:
                self._next_arrival += 1
                if self.still_waiting(k):  # not withdrawn (stopped) already
                    self._learn_who(k)
                    return NodeEvent("node_waiting", f"{self._node_name(k)} asks to join the running run", node=k)
        for k, st in states.items():
            if st is NodeState.RUNNING or self._reported.get(k) is st:
                continue
            self._reported[k] = st
            if st is NodeState.ENDED and finals.get(k) == "0":
                continue  # its workers finished; ours are finishing too
            what = (f"went away (no heartbeat for {silent.get(k, NODE_TIMEOUT_S):.1f} s)" if st is NodeState.LOST
                    else f"ended (exit {finals.get(k)})")
            return NodeEvent("node_lost", f"{self._node_name(k)} {what}", node=k)
        return None

    def _learn_who(self, k: int) -> None:
        """Node k's name, and its store (where its workers vote, and where the run's store may move)."""
        try:
            if self.store.check([KEYS.who(k)]):
                self.who[k] = self.store.get(KEYS.who(k)).decode()
            if self.cfg.ft and self.store.check([KEYS.standby(k)]):
                self.standby[k] = self.store.get(KEYS.standby(k)).decode()
        except Exception:
            pass  # the watch reports a lost store

    # ------------------------------------------------------------ late nodes (node 0, --ft, elastic c10d)
    def admit(self, k: int) -> None:
        """Take late node k into the running round: the others learn of it from the live list,
        it learns from its admit key. The agent decided there is a place for it."""
        w = self.watch
        with w.lock:
            w.states[k] = NodeState.RUNNING  # before it is in `others`: the watch reads both
        self.others.append(k)
        self.live.append(k)
        self._seen.add(k)
        self._late.add(k)
        self.store.set(KEYS.live, json.dumps(self.live))
        self.store.set(rdzv_admit(self.cfg.round, k), "1")

    def still_waiting(self, k: int) -> bool:
        """Whether late node k still waits for a place (it withdraws when stopped or when the round ends)."""
        try:
            return not self.store.get(KEYS.final(k))
        except Exception:
            return False

    def drop(self, k: int) -> None:
        """A lost node leaves the live list (a late node admitted next is not told to wait for it)."""
        if k in self.live:
            self.live.remove(k)
            try:
                self.store.set(KEYS.live, json.dumps(self.live))
            except Exception:
                pass  # the watch reports a lost store

    def store_gone(self, why: str) -> NodeEvent:
        if self.watch is not None:
            self.watch.stop.set()
        return NodeEvent("store_gone", f"node {self.host_node} (the run's store at {self.host}:{self.port}) "
                                       f"went away ({why})", node=self.host_node)

    # ------------------------------------------------------------ the store moves (--ft)
    def may_move(self) -> bool:
        """Whether this node can take part in moving the run's store (ftrun.supervisor.failover)."""
        return (self.can_move and self.me != self.host_node and self.node_store is not None
                and self.layout_size >= 3)

    def fail_over(self) -> failover.Elected:
        """The run's store is lost: agree with the surviving nodes on the next host, and follow it.
        Raises failover.NoMajority when this node may not go on."""
        lost = self.host_node
        gone = set(self.lost_nodes())
        candidates = [k for k in sorted(self.live) if k != lost and k not in gone and k in self.standby]
        if not self.node_store.wait(NODE_TIMEOUT_S):
            raise failover.NoMajority(f"this node's standby store is not up ({self.node_store.error})")
        gen = self.gen + 1

        def prepare(store: Any) -> None:
            # This node's keys exist in the new store before the layout forms: the others' watch
            # reads them all at once from then on.
            store.set(KEYS.beat(self.me), "0")
            store.set(KEYS.final(self.me), "")
            store.set(KEYS.table(self.me), "[]")
            store.set(KEYS.who(self.me), f"{socket.gethostname()} pid {os.getpid()}")
            store.set(KEYS.standby(self.me), self.standby[self.me])  # for nodes that join there later
            store.compare_set(KEYS.fail(self.attempt), "", "")
            store.compare_set(KEYS.live, "", "[]")

        elected = failover.elect(self.me, gen, candidates, self.standby, self.node_store.store, self.layout_size,
                                 NODE_TIMEOUT_S, prepare, lambda: self._signalled(0) is not None)
        host, _, port = elected.addr.rpartition(":")
        self.gen = gen
        self.host_node = elected.host
        self.host, self.port = host, int(port)
        self.run_store.adopt(elected.store, host, int(port))
        self.live = sorted(elected.nodes)
        self.others = [k for k in self.live if k != self.me]
        if self.elastic:  # the nodes that did not choose the new host stop: they count no more
            self._seen = set(self.live)
        if elected.host == self.me:
            elected.store.set(KEYS.live, json.dumps(self.live))
        self.watch = _Watch(self)
        self.watch.start()
        return elected

    def open_to_late_nodes(self, master_addr: str) -> None:
        """The new host of an elastic --ft run: nodes that come now (sent here from the original
        endpoint, ftrun.supervisor.redirect) ask this store to take them in, as they asked node 0's.
        Their node ranks come after every rank the run has used."""
        n, s = self.cfg.round, self.store
        top = max(self._seen | set(self.live) | {self.me})
        s.set(KEYS.layout, f"{self.nnodes} {self.cfg.nproc} {self.cfg.run_id}")
        s.set(RDZV_HOST, f"{self.me} {self.gen}")
        s.set(RDZV + "master_addr", master_addr)
        s.set(RDZV + f"{n}/size", str(len(self.live)))
        s.set(RDZV + "round", str(n))
        s.add(rdzv_arrivals(n), top - int(s.add(rdzv_arrivals(n), 0)))  # the next one is node top + 1
        self._next_arrival = top + 1
        self.arrivals_key = rdzv_arrivals(n)

    def may_move_between_rounds(self) -> bool:
        """c10d without --ft: whether the run's store, lost with its node, can move to the nodes
        that remain (a round of three nodes or more; the rendezvous moves it and re-forms)."""
        return (self.node_store is not None and not self.cfg.ft and self.me != self.host_node
                and self.layout_size >= 3)

    def majority_kept(self) -> bool:
        """The host's side goes on while it holds at least half of the run's nodes: a side
        without it needs more than half to move the store, so the two never both go on."""
        if not self.can_move or self.me != self.host_node or self.layout_size < 3:  # nobody could move it
            return True
        return failover.keeps_running(1 + len(self.others) - len(self.lost_nodes()), self.layout_size,
                                      strict=self.elastic)

    def lost_nodes(self, ended: bool = True) -> List[int]:
        """Nodes gone silent, and (`ended`) those that ended with a failure."""
        w = self.watch
        if w is None:
            return []
        with w.lock:
            return [k for k, st in w.states.items() if st is NodeState.LOST
                    or ended and st is NodeState.ENDED and w.finals.get(k) != "0"]

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
    def first_failure(self, failure: Optional[Failure], remote: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """The first failure of the current attempt, the same on every node: this node's
        (`failure`, written with compare_set: the first writer wins) or another node's
        (`remote`, already agreed). Raises if the store is unreachable."""
        self._handled_attempt = self.attempt
        if failure is None:
            return remote or {"node": -1, "rank": -1, "reason": "failed", "code": 1}
        mine = json.dumps({"node": self.me, "rank": failure.rank, "reason": failure.reason,
                           "code": failure.status_code, "signature": failure.signature})
        return json.loads(self.store.compare_set(KEYS.fail(self.attempt), "", mine).decode())

    def store_reachable(self, probes: int = 5) -> bool:
        """Whether the store's port still answers: `probes` connections 0.1 s apart all get in. One
        is not enough: a store whose process is being killed resets its connections before the
        kernel closes its listening socket."""
        for i in range(probes):
            if i:
                time.sleep(0.1)
            try:
                with socket.create_connection((self.host, self.port), timeout=1.0):
                    pass
            except OSError:
                return False
        return True

    def _keep_rank0_report(self, n: int) -> None:
        """Node 0, every node stopped: keep rank 0's last report of attempt n for the other nodes
        (rank0_report), before attempt n+1's rank 0 replaces it."""
        try:
            if self.run_store.store.check([progress_key(0)]):
                self.store.set(KEYS.report0(n), self.run_store.store.get(progress_key(0)))
        except Exception:  # only the goodput estimate of the other nodes depends on it
            pass

    def rank0_report(self, n: int) -> Optional[List[str]]:
        """Rank 0's last progress report of attempt n, as node 0 kept it; None when it did not."""
        try:
            if not self.store.check([KEYS.report0(n)]):
                return None
            raw = self.store.get(KEYS.report0(n))
        except Exception:  # the store went away: this node's own reports stand
            return None
        return (raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)).split()

    def attempt_barrier(self, fail_code: int) -> Optional[NodeEvent | int]:
        """After this node stopped its workers of the current attempt n: wait until every node
        has; node 0 then clears the workers' keys and lets attempt n+1 start.

        None when attempt n+1 may start (the coordinator is then in it); else ftrun's
        exit status (`fail_code` when a node has already ended) or the NodeEvent that
        ended the wait (a lost node, the store gone)."""
        n = self.attempt
        store = self.store
        # Long enough for the slowest node to notice (a beat), stop (grace, then SIGKILL) and report.
        deadline = time.monotonic() + self.cfg.shutdown_timeout + NODE_TIMEOUT_S + 15.0
        try:
            store.add(KEYS.stopped(n), 1)
            while True:
                if self.me == 0:
                    if store.add(KEYS.stopped(n), 0) >= self.nnodes:
                        try:
                            self.run_store.clear_worker_keys()
                        except Exception as e:  # the attempt may still work; say why it might not
                            self._note(f"could not clear the store between attempts: {e}")
                        self._keep_rank0_report(n)
                        store.compare_set(KEYS.fail(n + 1), "", "")
                        store.set(KEYS.go(n + 1), "1")
                        self.attempt = n + 1
                        return None
                elif store.check([KEYS.go(n + 1)]):
                    self.attempt = n + 1
                    return None
                if self._store_lost():
                    return self.store_gone(self.watch.store_error if self.watch else "")
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
            return self.store_gone(_one_line(e))

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
        if self.me == self.host_node:
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
