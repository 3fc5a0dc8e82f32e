"""c10d rendezvous: the same command on every node forms one run; node ranks are given at join.

`ftrun --nnodes MIN:MAX --rdzv-backend c10d --rdzv-endpoint HOST:PORT train.py`, typed
identically on every node. One node hosts the run's store on PORT and is node 0:
the node at HOST (or the one with is_host=1 in --rdzv-conf; when several
candidates share a machine, the first to bind the port). The others connect
and take node ranks 1, 2, ... in the order they arrive.

The run goes in rounds, as torchrun's agent does; the round's agent (its
Supervisor) alone decides whether a round that ends is followed by another
(`Supervisor.reform`); this module only forms them. The host closes round n when
MAX nodes are in, or when MIN are in and last_call_timeout has passed without
the round filling up; a node that arrives after that waits for the next round.
Each round is one ftrun Supervisor per node with the round's ranks and world
size (its node keys live under the round's prefix). Without --ft, when a round
fails (a worker failed, or a node went away) every surviving node comes back
for round n+1, as long as the restart budget (--max-restarts, counted in
rounds, as torchrun counts them) allows: the survivors re-form with the new
world size, and nodes that started late join there.

With --ft on an elastic run (MIN < MAX) the run does not wait for a re-formation
to grow: a node that comes while a round trains asks node 0 to take it in
(``N/admit/K``); node 0's agent does so while fewer than MAX nodes run, and the
new node's replicas join the quorum and heal from a peer. A lost node's place
goes to the next node waiting. Every node but the host keeps a standby store
for the whole run (its workers vote through it); when the host is lost, the
round's agents move the store there (ftrun.supervisor.failover) and the new
host takes late nodes in from then on.

Without --ft, on rounds of three nodes or more, the store moves when its
node is lost (FTRUN_STORE_MOVES=0: never): every other node keeps a standby
store for the whole run and publishes it in each round; when the store goes
away at the end of a round or while the nodes re-form, the nodes that remain
elect its next host by the rule of ftrun.supervisor.failover (more than half
of the last round's nodes) and form the next round there. So that no second
run forms beside it, the hosting node then closes a round only with at least
half of the last round's nodes.

Wherever the store moved, its new host leaves its address at the original
endpoint when a store of this run answers there (ftrun.supervisor.redirect:
the endpoint's machine restarted with the run's line); a node hosting or
joining at the endpoint reads it and joins the run where it is, instead of
forming a second run there.

Store keys (under ftrun/rdzv/): ``round`` (the round being formed),
``N/arrivals`` (counter: a client's arrival index is its node rank),
``N/size`` (set by the host when round N closes; 0 when it could not form),
``master_addr`` (the host's name for the workers' MASTER_ADDR), ``done`` (the run's
exit status, for nodes still waiting when it ends), ``run`` (the run id) and
``moved`` (where the store went), ``host`` (a moved store's host and generation).
Must never start a worker itself (each round's Supervisor does) and never
decide anything a node could not decide alike from the store's keys.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import queue
import signal
import socket
import time
from typing import Any, Optional, Tuple

from ftrun.config import RunConfig
from ftrun.machine import store_bind_addr, store_listen_addr, this_node_name
from ftrun.protocol import EXIT_SIGNAL_BASE, RDZV, RDZV_MOVED, RDZV_RUN, NodeKeys, rdzv_admit, rdzv_arrivals
from ftrun.supervisor import failover, nodes, redirect
from ftrun.supervisor.env import base_env
from ftrun.supervisor.logs import ConsoleOut
from ftrun.supervisor.spawn import ZygoteSpawner
from ftrun.supervisor.store import RunStore, bind_listener
from ftrun.supervisor.waits import Waits

POLL_S = 0.05
JOIN_FAILED = nodes.JOIN_FAILED


def _key(name: str) -> str:
    return RDZV + name


class _StoreLost(Exception):
    """The run's store went away while this node joined a round."""


class _Moved(Exception):
    """The run's store moved away from this endpoint (ftrun.supervisor.redirect): join it there."""

    def __init__(self, addr: str) -> None:
        super().__init__(addr)
        self.addr = addr


def _check_moved(s: Any) -> None:
    if s.check([RDZV_MOVED]):
        addr = s.get(RDZV_MOVED).decode(errors="replace")
        host, _, port = addr.rpartition(":")
        if host and port.isdigit():  # anything else is not a word of ours: stay
            raise _Moved(addr)


class _Stop(Exception):
    """A signal arrived while no Supervisor was running."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def run_c10d(cfg: RunConfig, console: Optional[ConsoleOut] = None) -> int:
    """Round after round until the run ends; ftrun's exit status."""
    from ftrun.supervisor.restart import Repeats
    from ftrun.supervisor.run import Supervisor

    console = console or ConsoleOut(cfg.quiet)
    repeats = Repeats()  # a script's error that repeats round after round ends the run (restart.py)
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}

    def stop(signum, _frame):
        raise _Stop(signum)

    cfg = dataclasses.replace(cfg, endpoint=f"{cfg.master_addr}:{cfg.master_port}")
    store, host, zygote, standby = None, False, None, None
    beacon = None  # the store this node hosts at the original endpoint, telling where the run went
    code = JOIN_FAILED
    try:
        for s in previous:
            signal.signal(s, stop)
        zygote = _prewarm(cfg)  # its torch import overlaps the supervisor's own (for the store)
        store, host = _open(cfg, console)
        if store is None:
            return JOIN_FAILED
        if not host and (moves_enabled(cfg) or cfg.ft):
            standby = _standby(cfg)
        n, need, expect = 0, 0, None
        last, moving = None, False  # a follower's coordinator of the round that ended: where the store may move
        while True:
            for s in previous:
                signal.signal(s, stop)
            if last is not None and (moving or not last.store_reachable(probes=1)):
                # The store went away with its node, at the end of the round or while the nodes
                # re-formed: agree on its next host with the nodes that remain, then form there.
                moved = _move(cfg, last, store, standby, console)
                if isinstance(moved, int):
                    code = moved
                    return code
                cfg, host, expect = moved
                if host:
                    store, standby = standby, None
                last = None
            zygote = zygote or _prewarm(cfg)
            try:
                formed = (_host_round(cfg, store, n, console, need, expect) if host
                          else _join_round(cfg, store, n, console, standby))
            except _Moved as e:
                # A node at the original endpoint after the store moved: the run goes on elsewhere.
                # A hosting node keeps its store (and the word in it) up for the nodes after it.
                beacon = store if host else beacon
                host = False
                where, _, port = e.addr.rpartition(":")
                cfg = dataclasses.replace(cfg, master_addr=where, master_port=int(port))
                console.note(f"the run's store moved to {e.addr}; joining the run there", style="bold cyan")
                store, _ = _open(cfg, console, join_only=True)
                if store is None:
                    return JOIN_FAILED
                if standby is None and (moves_enabled(cfg) or cfg.ft):
                    standby = _standby(cfg)
                continue
            except _StoreLost as e:
                if last is not None and not last.store_reachable():
                    moving = True
                    continue
                _fail(console, f"lost the run's store at {cfg.master_addr}:{cfg.master_port}: {e}")
                code = nodes.NODE_LOST
                return code
            if isinstance(formed, int):
                code = formed
                return code
            n, rank, size, master, live = formed
            round_cfg = dataclasses.replace(
                cfg, node_rank=rank, nnodes=size, round=n, workers_master_addr=master, nodes_live=live,
                total_restarts=cfg.max_restarts,
                # Without --ft a failure ends the round and every node re-forms (torchrun's restart);
                # with --ft replicas restart inside the round.
                max_restarts=cfg.max_restarts if cfg.ft else 0)
            nodes.use_round(n)
            sup = Supervisor(round_cfg, store=store, zygote=zygote, standby=standby, repeats=repeats)
            zygote = None  # the round's now
            code = sup.run()
            if sup.nodes is not None and sup.nodes.me == sup.nodes.host_node:
                host = True  # the store moved here during the round: nodes still waiting read `done` here
            if not sup.reform:  # the round's agent decided: the run is over
                return code
            # No second run may form beside this one: the next round needs at least half of this
            # round's nodes when the store could have moved to the others (they need more than half).
            need = -(-size // 2) if size >= 3 and moves_enabled(cfg) else 0
            expect = None
            last = sup.nodes if sup.nodes is not None and sup.nodes.may_move_between_rounds() else None
            moving = sup.store_lost
            n += 1
    except _Stop as e:
        console.note(f"received {signal.Signals(e.signum).name}: stopping", style="bold yellow")
        code = EXIT_SIGNAL_BASE + e.signum
        return code
    finally:
        for s in previous:  # the stop is under way: a second signal must not cut the clean-up short
            signal.signal(s, signal.SIG_IGN)
        if zygote is not None:
            zygote.close()
        for s, h in previous.items():
            signal.signal(s, h)
        for hosted in ([store] if host else []) + ([beacon] if beacon is not None else []):
            if hosted is not None and hosted.store is not None:
                try:
                    hosted.set(_key("done"), str(code))
                except Exception:
                    pass


def _prewarm(cfg: RunConfig) -> Optional[ZygoteSpawner]:
    """A zygote importing torch while the nodes gather (it forks the round's workers; each gets its full
    environment with the spawn request, so the layout need not be known yet)."""
    if cfg.no_python or os.environ.get("FTRUN_ZYGOTE", "1") == "0":
        return None
    env = base_env()
    env.update(cfg.env)
    env.update({"FTRUN_RUN_ID": cfg.run_id, "FTRUN_FT": "1" if cfg.ft else "0"})
    return ZygoteSpawner(queue.SimpleQueue(), env, os.getcwd())


def _open(cfg: RunConfig, console: ConsoleOut, join_only: bool = False) -> Tuple[Optional[RunStore], bool]:
    """Host the store at the endpoint's port if this node should, else connect to it."""
    where = f"{cfg.master_addr}:{cfg.master_port}"
    wants = cfg.rdzv_host if cfg.rdzv_host is not None else store_bind_addr(cfg.master_addr) != "0.0.0.0"
    wants = wants and not join_only
    if wants:
        try:
            listener = bind_listener(store_listen_addr(cfg), cfg.master_port)
        except OSError as e:
            if cfg.rdzv_host or e.errno != errno.EADDRINUSE:
                _fail(console, f"cannot host the run's store on port {cfg.master_port} ({e.strerror or e}); "
                               f"free the port or pick another --rdzv-endpoint port")
                return None, False
            # Another ftrun of this run on this machine hosts it already: join it, as torchrun does.
        else:
            store = RunStore(cfg.master_addr, listener.getsockname()[1], listener)
            if not store.wait(60):
                _fail(console, f"could not start the run's store on {where}: {nodes._one_line(store.error)}")
                return None, False
            store.set(_key("master_addr"), this_node_name(cfg.local_addr))
            store.set(RDZV_RUN, cfg.run_id)  # a store that moved away from here leaves its word (redirect)
            return store, True
    # A moved store is up already: one that does not answer soon is gone, not starting.
    store = RunStore(cfg.master_addr, cfg.master_port, None,
                     connect_timeout=min(cfg.join_timeout, 10.0) if join_only else cfg.join_timeout)
    while not store.ready.wait(POLL_S):
        pass
    if store.store is None:
        _fail(console, f"could not reach the run's store at {where}: {nodes._one_line(store.error)}; start ftrun "
                       f"with the same line on the node at {cfg.master_addr}")
        return None, False
    if "read_timeout" in cfg.rdzv_conf:
        import datetime

        store.store.set_timeout(datetime.timedelta(seconds=cfg.read_timeout))
    return store, False


def moves_enabled(cfg: RunConfig) -> bool:
    """c10d without --ft on three nodes or more: the store moves when its node is lost
    (FTRUN_STORE_MOVES=0: it never does, and the host goes on with any --nnodes MIN)."""
    return not cfg.ft and cfg.max_nodes >= 3 and os.environ.get("FTRUN_STORE_MOVES", "1") != "0"


def _standby(cfg: RunConfig) -> RunStore:
    """This node's standby store: where the run's store goes should its host be lost. It listens
    on the address the host reaches this machine by, so the other nodes reach it too."""
    ip = nodes.route_ip(cfg.master_addr)
    listener = bind_listener(ip, 0)
    return RunStore(ip, listener.getsockname()[1], listener)


def _move(cfg: RunConfig, coord: Any, store: RunStore, standby: Optional[RunStore], console: ConsoleOut) -> Any:
    """The run's store went away with its node at the end of `coord`'s round: agree with the nodes that
    remain on its next host (ftrun.supervisor.failover, the rule of the --ft move) and follow it.
    (cfg with the new endpoint, whether this node hosts it now, the nodes that chose it), or
    ftrun's exit status when this node may not go on."""
    t0 = time.monotonic()
    if standby is None or not standby.wait(nodes.NODE_TIMEOUT_S):
        _fail(console, "the run's store went away and this node has no standby store to move it to")
        return nodes.NODE_LOST
    # Nodes that ended the round (every node does when it re-forms) are candidates; silent ones are not.
    lost = set(coord.lost_nodes(ended=False)) | {coord.host_node}
    candidates = [k for k in sorted(coord.live) if k not in lost and k in coord.standby]
    try:
        elected = failover.elect(coord.me, coord.cfg.round + 1, candidates, coord.standby, standby.store,
                                 coord.layout_size, nodes.NODE_TIMEOUT_S, lambda _store: None, lambda: False)
    except failover.NoMajority as e:
        _fail(console, f"the run's store could not move: {e}; stopping so that no second run can form")
        return nodes.NODE_LOST
    addr, _, port = elected.addr.rpartition(":")
    cfg = dataclasses.replace(cfg, master_addr=addr, master_port=int(port))
    mine = elected.host == coord.me
    if mine:
        standby.set(_key("master_addr"), addr)
        redirect.Redirect(cfg.endpoint, cfg.run_id, elected.addr).start()  # for nodes started with the old line
    else:
        store.adopt(elected.store, addr, int(port))
    console.note(f"the run's store moved to {'this node' if mine else 'another node'} at {elected.addr} "
                 f"({len(elected.nodes)} of {coord.layout_size} nodes, agreed in {time.monotonic() - t0:.1f} s); "
                 f"the run re-forms there", style="bold cyan")
    return cfg, mine, len(elected.nodes)


def _fail(console: ConsoleOut, text: str) -> None:
    console.note(f"error: {text}", style="bold red")


def _count(store: RunStore, n: int) -> int:
    return 1 + int(store.store.add(rdzv_arrivals(n), 0))


def _host_round(cfg: RunConfig, store: RunStore, n: int, console: ConsoleOut, need: int = 0,
                expect: Optional[int] = None) -> Any:
    """Close round n: (n, 0, size, master_addr) once it has formed, else an exit status.

    `need`: nodes the round needs besides --nnodes MIN (half of the last round's, when the store
    could have moved away: a second run must never form); `expect`: the nodes that moved the
    store here, whose arrival closes the round at once."""
    s = store.store
    if n > 0:
        store.clear_worker_keys()  # the last round's gloo/NCCL keys must not be read by the next
    s.set(_key("round"), str(n))
    t0 = time.monotonic()
    deadline = t0 + cfg.join_timeout
    last_call: Optional[float] = None
    least = max(cfg.min_nodes, need)
    waits, since = Waits(console), time.time()  # on a terminal: the nodes arriving, while the round forms
    while True:
        try:
            _check_moved(s)
        except BaseException:  # the run's store moved (the caller joins it there): no line left drawn
            waits.close()
            raise
        count = _count(store, n)
        waits.sync({"round": (f"waiting for nodes to form round {n} of run {cfg.run_id}", since, count,
                              cfg.max_nodes)}, time.time())
        now = time.monotonic()
        if count >= least and last_call is None:
            # A first round short of MAX stays open long enough for the word that this run's
            # store moved elsewhere (ftrun.supervisor.redirect): no second run may form here.
            last_call = max(now + cfg.last_call_timeout, t0 + 2 * redirect.EVERY_S + 0.5 if n == 0 else 0.0)
        if (count >= cfg.max_nodes or (last_call is not None and now >= last_call)
                or (expect is not None and count >= max(expect, least))):
            size = min(count, cfg.max_nodes)
            break
        if last_call is None and now > deadline:
            waits.close()
            s.set(_key(f"{n}/size"), "0")
            if need > cfg.min_nodes:
                _fail(console, f"only {count} node{'s' if count != 1 else ''} came back within --rdzv-conf "
                               f"join_timeout={cfg.join_timeout:g}; {need} (half of the last round's) are needed, as the others may "
                               f"have moved the run's store and gone on without this node (FTRUN_STORE_MOVES=0 "
                               f"keeps the store here and lets any --nnodes MIN go on)")
                return nodes.NODE_LOST
            _fail(console, f"only {count} of at least {cfg.min_nodes} nodes joined within --rdzv-conf "
                           f"join_timeout={cfg.join_timeout:g}; start ftrun with the same line on the others")
            return JOIN_FAILED
        time.sleep(POLL_S)
    waits.close()
    s.set(_key(f"{n}/size"), str(size))
    console.note(f"round {n}: {size} node{'s' if size != 1 else ''} formed run {cfg.run_id} at "
                 f"{cfg.master_addr}:{cfg.master_port} in {time.monotonic() - t0:.1f} s; this node is node 0",
                 style="bold blue")
    return n, 0, size, s.get(_key("master_addr")).decode(), None


def _join_round(cfg: RunConfig, store: RunStore, n: int, console: ConsoleOut, standby: Optional[RunStore]) -> Any:
    """Join round n (or the next one still open): (n, rank, size, master_addr, live), else an exit
    status. `live` is None for a node that formed the round, else the nodes it joined (--ft, late,
    publishing its `standby` store as it asks in)."""
    s = store.store
    t0 = time.monotonic()
    try:
        while True:
            # A node that starts late enters the round being formed; with --ft on an elastic run it
            # joins a running round at once, else it waits for the next re-formation.
            current, running = _current_round(s, console)
            if current is None:
                return running  # the run ended: its exit status
            if running and cfg.admits_late and n <= current:
                formed = _join_running(cfg, s, current, None, t0, console, standby)
                if formed is not None:
                    return formed
                continue  # the round ended while this node waited: the next one
            if running and n <= current:
                console.note(f"run {cfg.run_id} is already in round {current}; this node joins at the next "
                             f"re-formation", style="yellow")
            n = max(n, current + 1 if running else current)
            formed = _join_forming(cfg, s, n, t0, console, standby)
            if formed is not None:
                return formed
            n += 1
    except (_Stop, _Moved):
        raise
    except Exception as e:
        raise _StoreLost(nodes._one_line(e)) from None


def _current_round(s: Any, console: ConsoleOut) -> Tuple[Optional[int], Any]:
    """(round being formed or run, whether it is running), or (None, exit status) once the run ended."""
    while True:
        if s.check([_key("done")]):
            code = s.get(_key("done")).decode()
            console.note(f"the run ended (exit {code}) before this node could join it", style="bold yellow")
            return None, int(code)
        _check_moved(s)
        if s.check([_key("round")]):
            current = int(s.get(_key("round")).decode())
            return current, s.check([_key(f"{current}/size")])
        time.sleep(POLL_S)


def _join_forming(cfg: RunConfig, s: Any, n: int, t0: float, console: ConsoleOut,
                  standby: Optional[RunStore] = None) -> Any:
    """Arrive at round n while it forms: the round, an exit status, or None when it formed
    without this node (the caller tries the next)."""
    index = int(s.add(rdzv_arrivals(n), 1))
    console.note(f"round {n}: arrived as node {index}; waiting for the round to form", style="dim")
    while not s.check([_key(f"{n}/size")]):
        _check_moved(s)
        if s.check([_key("done")]):
            code = s.get(_key("done")).decode()
            console.note(f"the run ended (exit {code}) while this node waited to join", style="bold yellow")
            return int(code)
        time.sleep(POLL_S)
    size = int(s.get(_key(f"{n}/size")).decode())
    if size == 0:
        _fail(console, f"round {n} could not form (fewer than {cfg.min_nodes} nodes joined in time)")
        return JOIN_FAILED
    if index < size:
        console.note(f"round {n}: joined run {cfg.run_id} at {cfg.master_addr}:{cfg.master_port} as node "
                     f"{index} of {size} in {time.monotonic() - t0:.1f} s", style="bold blue")
        return n, index, size, s.get(_key("master_addr")).decode(), None
    if cfg.min_nodes == cfg.max_nodes:
        _fail(console, f"the run at {cfg.master_addr}:{cfg.master_port} already has its {size} nodes "
                       f"(--nnodes {cfg.max_nodes}); is this node's line meant for another run?")
        return JOIN_FAILED
    if cfg.admits_late:
        return _join_running(cfg, s, n, index, t0, console, standby)
    console.note(f"round {n} formed without this node ({size} nodes, the most it takes now); waiting for the "
                 f"next re-formation", style="yellow")
    return None


def _join_running(cfg: RunConfig, s: Any, n: int, index: Optional[int], t0: float, console: ConsoleOut,
                  standby: Optional[RunStore] = None) -> Any:
    """--ft on an elastic run: ask node 0 to take this node into running round n, and wait
    until it does (a place is free: fewer than MAX nodes run). The round, an exit status,
    or None when round n ended first (the caller joins the next)."""
    keys = NodeKeys(n)
    while not s.check([keys.layout]):  # node 0 writes it as its round starts
        if int(s.get(_key("round")).decode()) != n or s.check([_key("done")]):
            return None
        time.sleep(POLL_S)
    _, nproc, run_id = s.get(keys.layout).decode().split(" ", 2)
    if (int(nproc), run_id) != (cfg.nproc, cfg.run_id):
        _fail(console, f"the run at {cfg.master_addr}:{cfg.master_port} runs --nproc-per-node {nproc} --run-id "
                       f"{run_id}, this node --nproc-per-node {cfg.nproc} --run-id {cfg.run_id}; every node needs "
                       f"the same line")
        return JOIN_FAILED
    if index is None:
        index = int(s.add(rdzv_arrivals(n), 1))
    # Its keys exist before node 0 reads them (node 0 waits for `who`, written last).
    s.set(keys.beat(index), "0")
    s.set(keys.final(index), "")
    s.set(keys.table(index), "[]")
    if standby is not None:  # the others route its votes there and may move the run's store there
        s.set(keys.standby(index), f"{standby.host}:{standby.port}")
    s.set(keys.who(index), f"{socket.gethostname()} pid {os.getpid()}")
    console.note(f"run {cfg.run_id} is training (round {n}); asking to join it now (--ft: this node's replicas "
                 f"heal from a peer)", style="yellow")
    told = False
    try:
        while not s.check([rdzv_admit(n, index)]):
            if s.check([_key("done")]):
                code = s.get(_key("done")).decode()
                console.note(f"the run ended (exit {code}) while this node waited to join", style="bold yellow")
                return int(code)
            if int(s.get(_key("round")).decode()) != n:
                s.set(keys.final(index), "withdrawn")
                return None
            if not told and time.monotonic() - t0 > 5 * nodes.BEAT_S + 1.0:
                told = True
                console.note(f"waiting for a place: the run has its {cfg.max_nodes} nodes (--nnodes "
                             f"{cfg.min_nodes}:{cfg.max_nodes}); this node joins when one leaves", style="yellow")
            time.sleep(POLL_S)
    except _Stop:
        s.set(keys.final(index), "withdrawn")  # node 0 must not take in a node that left
        raise
    live = tuple(int(k) for k in json.loads(s.get(keys.live)))
    console.note(f"round {n}: joined run {cfg.run_id} at {cfg.master_addr}:{cfg.master_port} as node {index} "
                 f"in {time.monotonic() - t0:.1f} s", style="bold blue")
    return n, index, max(live) + 1, s.get(_key("master_addr")).decode(), live
