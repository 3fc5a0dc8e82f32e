"""One round of the c10d rendezvous, formed through the run's store: the host closes it, every
other node arrives at it (or, with --ft on an elastic run, asks into a round that trains).

The host closes round n when MAX nodes are in, or when MIN (and `need`) are in and
last_call_timeout has passed without the round filling up; a node's arrival index
at ``N/arrivals`` is its node rank. A node that comes late waits for the next
round, or asks node 0 to take it in (``N/admit/K``). Each function returns the
round it formed or joined, (n, node rank, size, MASTER_ADDR, live nodes or None),
or ftrun's exit status; the loop over rounds is ftrun.supervisor.nodes.rendezvous's.
Must never start a worker, move the store, or decide anything a node could not
decide alike from the store's keys; every wait goes through ftrun.poll.wait_until and
ends at its next poll once the run's stopping signal has come (stop_if).
"""

from __future__ import annotations

import enum
import json
import math
import os
import socket
import time
from typing import Any, Callable, Optional, Tuple

from ftrun.config import RunConfig
from ftrun.keys import RDZV, RDZV_MOVED, NodeKeys, rdzv_admit, rdzv_arrivals
from ftrun.poll import wait_until
from ftrun.supervisor.accounting.waits import Waits
from ftrun.supervisor.nodes import coordinator as nodes
from ftrun.supervisor.nodes import redirect
from ftrun.supervisor.store import RunStore
from ftrun.supervisor.workers.logs import ConsoleOut
from ftrun.wire import one_line

POLL_S = 0.05
JOIN_FAILED = nodes.JOIN_FAILED


def key(name: str) -> str:
    """The rendezvous key `name` (under ftrun/rdzv/)."""
    return RDZV + name


class RendezvousStoreLost(Exception):
    """The run's store went away while this node joined a round."""


class Moved(Exception):
    """The run's store moved away from this endpoint (ftrun.supervisor.nodes.redirect): join it there."""

    def __init__(self, addr: str) -> None:
        super().__init__(addr)
        self.addr = addr


class Stop(Exception):
    """A stopping signal arrived while no round's Supervisor was running (raised by stop_if)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


Signalled = Callable[[], Optional[int]]  # the run's stopping signal, once one came (loop/signals.py)


def stop_if(signalled: Signalled) -> None:
    """Raise Stop once a stopping signal has come: every wait here polls it."""
    signum = signalled()
    if signum is not None:
        raise Stop(signum)


class Seen(enum.Enum):
    """What a joining node's wait found in the store (every member is true: wait_until returns it)."""

    FORMED = "the round's size is set"
    LAYOUT = "node 0 wrote the running round's layout"
    ADMITTED = "node 0 took this node in"
    ROUND_OVER = "the round ended first"
    RUN_ENDED = "the run ended"


def check_moved(s: Any) -> None:
    """Raise Moved when the store at this endpoint says where the run went."""
    if s.check([RDZV_MOVED]):
        addr = s.get(RDZV_MOVED).decode(errors="replace")
        host, _, port = addr.rpartition(":")
        if host and port.isdigit():  # anything else is not a word of ours: stay
            raise Moved(addr)


def fail(console: ConsoleOut, text: str) -> None:
    console.note(f"error: {text}", style="bold red")


def _count(store: RunStore, n: int) -> int:
    return 1 + int(store.store.add(rdzv_arrivals(n), 0))


def _run_ended(s: Any, console: ConsoleOut, when: str) -> int:
    code = s.get(key("done")).decode()
    console.note(f"the run ended (exit {code}) {when}", style="bold yellow")
    return int(code)


def host_round(cfg: RunConfig, store: RunStore, n: int, console: ConsoleOut, signalled: Signalled, need: int = 0,
               expect: Optional[int] = None) -> Any:
    """Close round n: (n, 0, size, master_addr, None) once it has formed, else an exit status.

    `need`: nodes the round needs besides --nnodes MIN (half of the last round's, when the store
    could have moved away: a second run must never form); `expect`: the nodes that moved the
    store here, whose arrival closes the round at once."""
    s = store.store
    if n > 0:
        store.clear_worker_keys()  # the last round's gloo/NCCL keys must not be read by the next
    s.set(key("round"), str(n))
    t0 = time.monotonic()
    least = max(cfg.min_nodes, need)
    waits, since = Waits(console), time.time()  # on a terminal: the nodes arriving, while the round forms

    def arrived(enough: int) -> Optional[int]:
        """The nodes in, once `enough` are (shown on the terminal as they come)."""
        stop_if(signalled)
        check_moved(s)  # the run's store moved: the caller joins it there
        count = _count(store, n)
        waits.sync({"round": (f"waiting for nodes to form round {n} of run {cfg.run_id}", since, count,
                              cfg.max_nodes)}, time.time())
        return count if count >= enough else None

    try:
        count = wait_until(lambda: arrived(least), t0 + cfg.join_timeout, POLL_S)
        if count is not None:
            # A first round short of MAX stays open long enough for the word that this run's
            # store moved elsewhere (ftrun.supervisor.nodes.redirect): no second run may form here.
            now = time.monotonic()
            last_call = max(now + cfg.last_call_timeout, t0 + 2 * redirect.EVERY_S + 0.5 if n == 0 else 0.0)
            full = cfg.max_nodes if expect is None else min(cfg.max_nodes, max(expect, least))
            count = wait_until(lambda: arrived(full), last_call, POLL_S) or _count(store, n)
    finally:
        waits.close()
    if count is None:
        s.set(key(f"{n}/size"), "0")
        count = _count(store, n)
        if need > cfg.min_nodes:
            fail(console, f"only {count} node{'s' if count != 1 else ''} came back within --rdzv-conf "
                          f"join_timeout={cfg.join_timeout:g}; {need} (half of the last round's) are needed, as the "
                          f"others may have moved the run's store and gone on without this node "
                          f"(FTRUN_STORE_MOVES=0 keeps the store here and lets any --nnodes MIN go on)")
            return nodes.NODE_LOST
        fail(console, f"only {count} of at least {cfg.min_nodes} nodes joined within --rdzv-conf "
                      f"join_timeout={cfg.join_timeout:g}; start ftrun with the same line on the others")
        return JOIN_FAILED
    size = min(count, cfg.max_nodes)
    s.set(key(f"{n}/size"), str(size))
    console.note(f"round {n}: {size} node{'s' if size != 1 else ''} formed run {cfg.run_id} at "
                 f"{cfg.master_addr}:{cfg.master_port} in {time.monotonic() - t0:.1f} s; this node is node 0",
                 style="bold blue")
    return n, 0, size, s.get(key("master_addr")).decode(), None


def join_round(cfg: RunConfig, store: RunStore, n: int, console: ConsoleOut, signalled: Signalled,
               standby: Optional[RunStore]) -> Any:
    """Join round n (or the next one still open): (n, rank, size, master_addr, live), else an exit
    status. `live` is None for a node that formed the round, else the nodes it joined (--ft, late,
    publishing its `standby` store as it asks in)."""
    s = store.store
    t0 = time.monotonic()
    try:
        while True:
            # A node that starts late enters the round being formed; with --ft on an elastic run it
            # joins a running round at once, else it waits for the next re-formation.
            current, running = _current_round(s, console, signalled)
            if current is None:
                return running  # the run ended: its exit status
            if running and cfg.admits_late and n <= current:
                formed = _join_running(cfg, s, current, None, t0, console, signalled, standby)
                if formed is not None:
                    return formed
                continue  # the round ended while this node waited: the next one
            if running and n <= current:
                console.note(f"run {cfg.run_id} is already in round {current}; this node joins at the next "
                             f"re-formation", style="yellow")
            n = max(n, current + 1 if running else current)
            formed = _join_forming(cfg, s, n, t0, console, signalled, standby)
            if formed is not None:
                return formed
            n += 1
    except (Stop, Moved):
        raise
    except Exception as e:
        raise RendezvousStoreLost(one_line(e)) from None


def _current_round(s: Any, console: ConsoleOut, signalled: Signalled) -> Tuple[Optional[int], Any]:
    """(round being formed or run, whether it is running), or (None, exit status) once the run ended."""
    def seen() -> Optional[Tuple[Optional[int], Any]]:
        stop_if(signalled)
        if s.check([key("done")]):
            return None, _run_ended(s, console, "before this node could join it")
        check_moved(s)
        if s.check([key("round")]):
            current = int(s.get(key("round")).decode())
            return current, s.check([key(f"{current}/size")])
        return None

    return wait_until(seen, math.inf, POLL_S)


def _join_forming(cfg: RunConfig, s: Any, n: int, t0: float, console: ConsoleOut, signalled: Signalled,
                  standby: Optional[RunStore] = None) -> Any:
    """Arrive at round n while it forms: the round, an exit status, or None when it formed
    without this node (the caller tries the next)."""
    index = int(s.add(rdzv_arrivals(n), 1))
    console.note(f"round {n}: arrived as node {index}; waiting for the round to form", style="dim")

    def formed() -> Optional[Seen]:
        stop_if(signalled)
        if s.check([key(f"{n}/size")]):
            return Seen.FORMED
        check_moved(s)
        return Seen.RUN_ENDED if s.check([key("done")]) else None

    if wait_until(formed, math.inf, POLL_S) is Seen.RUN_ENDED:
        return _run_ended(s, console, "while this node waited to join")
    size = int(s.get(key(f"{n}/size")).decode())
    if size == 0:
        fail(console, f"round {n} could not form (fewer than {cfg.min_nodes} nodes joined in time)")
        return JOIN_FAILED
    if index < size:
        console.note(f"round {n}: joined run {cfg.run_id} at {cfg.master_addr}:{cfg.master_port} as node "
                     f"{index} of {size} in {time.monotonic() - t0:.1f} s", style="bold blue")
        return n, index, size, s.get(key("master_addr")).decode(), None
    if cfg.min_nodes == cfg.max_nodes:
        fail(console, f"the run at {cfg.master_addr}:{cfg.master_port} already has its {size} nodes "
                      f"(--nnodes {cfg.max_nodes}); is this node's line meant for another run?")
        return JOIN_FAILED
    if cfg.admits_late:
        return _join_running(cfg, s, n, index, t0, console, signalled, standby)
    console.note(f"round {n} formed without this node ({size} nodes, the most it takes now); waiting for the "
                 f"next re-formation", style="yellow")
    return None


def _join_running(cfg: RunConfig, s: Any, n: int, index: Optional[int], t0: float, console: ConsoleOut,
                  signalled: Signalled, standby: Optional[RunStore] = None) -> Any:
    """--ft on an elastic run: ask node 0 to take this node into running round n, and wait
    until it does (a place is free: fewer than MAX nodes run). The round, an exit status,
    or None when round n ended first (the caller joins the next)."""
    keys = NodeKeys(n)

    def layout() -> Optional[Seen]:  # node 0 writes it as its round starts
        stop_if(signalled)
        if s.check([keys.layout]):
            return Seen.LAYOUT
        if int(s.get(key("round")).decode()) != n or s.check([key("done")]):
            return Seen.ROUND_OVER
        return None

    if wait_until(layout, math.inf, POLL_S) is not Seen.LAYOUT:
        return None
    _, nproc, run_id = s.get(keys.layout).decode().split(" ", 2)
    if (int(nproc), run_id) != (cfg.nproc, cfg.run_id):
        fail(console, f"the run at {cfg.master_addr}:{cfg.master_port} runs --nproc-per-node {nproc} --run-id "
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
    told = []

    def admitted() -> Optional[Seen]:
        stop_if(signalled)
        if s.check([rdzv_admit(n, index)]):
            return Seen.ADMITTED
        if s.check([key("done")]):
            return Seen.RUN_ENDED
        if int(s.get(key("round")).decode()) != n:
            return Seen.ROUND_OVER
        if not told and time.monotonic() - t0 > 5 * nodes.BEAT_S + 1.0:
            told.append(True)
            console.note(f"waiting for a place: the run has its {cfg.max_nodes} nodes (--nnodes "
                         f"{cfg.min_nodes}:{cfg.max_nodes}); this node joins when one leaves", style="yellow")
        return None

    try:
        seen = wait_until(admitted, math.inf, POLL_S)
        if seen is Seen.RUN_ENDED:
            return _run_ended(s, console, "while this node waited to join")
        if seen is Seen.ROUND_OVER:
            s.set(keys.final(index), "withdrawn")
            return None
    except Stop:
        s.set(keys.final(index), "withdrawn")  # node 0 must not take in a node that left
        raise
    live = tuple(int(k) for k in json.loads(s.get(keys.live)))
    console.note(f"round {n}: joined run {cfg.run_id} at {cfg.master_addr}:{cfg.master_port} as node {index} "
                 f"in {time.monotonic() - t0:.1f} s", style="bold blue")
    return n, index, max(live) + 1, s.get(key("master_addr")).decode(), live
