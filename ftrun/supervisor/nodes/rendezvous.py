"""c10d rendezvous: the same command on every node forms one run; node ranks are given at join.

`ftrun --nnodes MIN:MAX --rdzv-backend c10d --rdzv-endpoint HOST:PORT train.py`, typed
identically on every node. One node hosts the run's store on PORT and is node 0:
the node at HOST (or the one with is_host=1 in --rdzv-conf; when several
candidates share a machine, the first to bind the port). The others connect
and take node ranks 1, 2, ... in the order they arrive.

The run goes in rounds, as torchrun's agent does; the round's agent (its
Supervisor) alone decides whether a round that ends is followed by another
(`Supervisor.reform`), and the loop over rounds is the loop's
(ftrun.supervisor.loop.c10d); this module gives it the parts that form them
(each round is formed by ftrun.supervisor.nodes.rendezvous_rounds). The host closes round n when
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
round's agents move the store there (ftrun.supervisor.nodes.failover) and the new
host takes late nodes in from then on.

Without --ft, on rounds of three nodes or more, the store moves when its
node is lost (FTRUN_STORE_MOVES=0: never): every other node keeps a standby
store for the whole run and publishes it in each round; when the store goes
away at the end of a round or while the nodes re-form, the nodes that remain
elect its next host by the rule of ftrun.supervisor.nodes.failover (more than half
of the last round's nodes) and form the next round there. So that no second
run forms beside it, the hosting node then closes a round only with at least
half of the last round's nodes.

Wherever the store moved, its new host leaves its address at the original
endpoint when a store of this run answers there (ftrun.supervisor.nodes.redirect:
the endpoint's machine restarted with the run's line); a node hosting or
joining at the endpoint reads it and joins the run where it is, instead of
forming a second run there.

Store keys (under ftrun/rdzv/): ``round`` (the round being formed),
``N/arrivals`` (counter: a client's arrival index is its node rank),
``N/size`` (set by the host when round N closes; 0 when it could not form),
``master_addr`` (the host's name for the workers' MASTER_ADDR), ``done`` (the run's
exit status, for nodes still waiting when it ends), ``run`` (the run id) and
``moved`` (where the store went), ``host`` (a moved store's host and generation).
Must never start a worker itself (each round's Supervisor does), never import the loop, and never
decide anything a node could not decide alike from the store's keys.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import queue
import time
from typing import Any, Optional, Tuple

from ftrun.config import RunConfig
from ftrun.keys import RDZV_RUN
from ftrun.machine import store_bind_addr, store_listen_addr, this_node_name
from ftrun.supervisor.nodes import failover, coordinator as nodes
from ftrun.supervisor.nodes import redirect
from ftrun.supervisor.nodes.rendezvous_rounds import POLL_S, Signalled, fail, key, stop_if
from ftrun.supervisor.store import RunStore, bind_listener
from ftrun.supervisor.workers.env import base_env, zygote_env
from ftrun.supervisor.workers.logs import ConsoleOut
from ftrun.supervisor.workers.spawn import ZygoteSpawner
from ftrun.wire import one_line


def prewarm(cfg: RunConfig) -> Optional[ZygoteSpawner]:
    """A zygote importing torch while the nodes gather (it forks the round's workers; each gets its full
    environment with the spawn request, so the layout need not be known yet)."""
    if not cfg.use_zygote:
        return None
    env = base_env()
    env.update(cfg.env)
    env.update({"FTRUN_RUN_ID": cfg.run_id, "FTRUN_FT": "1" if cfg.ft else "0"})
    return ZygoteSpawner(queue.SimpleQueue(), zygote_env(cfg, env), os.getcwd())


def open_store(cfg: RunConfig, console: ConsoleOut, signalled: Signalled,
               join_only: bool = False) -> Tuple[Optional[RunStore], bool]:
    """Host the store at the endpoint's port if this node should, else connect to it."""
    where = f"{cfg.master_addr}:{cfg.master_port}"
    wants = cfg.rdzv_host if cfg.rdzv_host is not None else store_bind_addr(cfg.master_addr) != "0.0.0.0"
    wants = wants and not join_only
    if wants:
        try:
            listener = bind_listener(store_listen_addr(cfg), cfg.master_port)
        except OSError as e:
            if cfg.rdzv_host or e.errno != errno.EADDRINUSE:
                fail(console, f"cannot host the run's store on port {cfg.master_port} ({e.strerror or e}); "
                               f"free the port or pick another --rdzv-endpoint port")
                return None, False
            # Another ftrun of this run on this machine hosts it already: join it, as torchrun does.
        else:
            store = RunStore(cfg.master_addr, listener.getsockname()[1], listener)
            if not store.wait(60):
                fail(console, f"could not start the run's store on {where}: {one_line(store.error)}")
                return None, False
            store.set(key("master_addr"), this_node_name(cfg.local_addr))
            store.set(RDZV_RUN, cfg.run_id)  # a store that moved away from here leaves its word (redirect)
            return store, True
    # A moved store is up already: one that does not answer soon is gone, not starting.
    store = RunStore(cfg.master_addr, cfg.master_port, None,
                     connect_timeout=min(cfg.join_timeout, 10.0) if join_only else cfg.join_timeout)
    while not store.ready.wait(POLL_S):
        stop_if(signalled)
    if store.store is None:
        fail(console, f"could not reach the run's store at {where}: {one_line(store.error)}; start ftrun "
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


def standby_store(cfg: RunConfig) -> RunStore:
    """This node's standby store: where the run's store goes should its host be lost. It listens
    on the address the host reaches this machine by, so the other nodes reach it too."""
    ip = nodes.route_ip(cfg.master_addr)
    listener = bind_listener(ip, 0)
    return RunStore(ip, listener.getsockname()[1], listener)


def move_store(cfg: RunConfig, coord: Any, store: RunStore, standby: Optional[RunStore], console: ConsoleOut,
               signalled: Signalled) -> Any:
    """The run's store went away with its node at the end of `coord`'s round: agree with the nodes that
    remain on its next host (ftrun.supervisor.nodes.failover, the rule of the --ft move) and follow it.
    (cfg with the new endpoint, whether this node hosts it now, the nodes that chose it), or
    ftrun's exit status when this node may not go on."""
    t0 = time.monotonic()
    if standby is None or not standby.wait(nodes.NODE_TIMEOUT_S):
        fail(console, "the run's store went away and this node has no standby store to move it to")
        return nodes.NODE_LOST
    # Nodes that ended the round (every node does when it re-forms) are candidates; silent ones are not.
    lost = set(coord.lost_nodes(ended=False)) | {coord.host_node}
    candidates = failover.candidates(coord.live, lost, coord.standby)
    try:
        elected = failover.elect(coord.me, coord.cfg.round + 1, candidates, coord.standby, standby.store,
                                 coord.layout_size, nodes.NODE_TIMEOUT_S, lambda _store: None,
                                 lambda: signalled() is not None)
    except failover.NoMajority as e:
        stop_if(signalled)  # the election was cut short by a signal, not by a lack of nodes
        fail(console, f"the run's store could not move: {e}; stopping so that no second run can form")
        return nodes.NODE_LOST
    addr, _, port = elected.addr.rpartition(":")
    cfg = dataclasses.replace(cfg, master_addr=addr, master_port=int(port))
    mine = elected.host == coord.me
    if mine:
        standby.set(key("master_addr"), addr)
        redirect.Redirect(cfg.endpoint, cfg.run_id, elected.addr).start()  # for nodes started with the old line
    else:
        store.adopt(elected.store, addr, int(port))
    console.note(f"the run's store moved to {'this node' if mine else 'another node'} at {elected.addr} "
                 f"({len(elected.nodes)} of {coord.layout_size} nodes, agreed in {time.monotonic() - t0:.1f} s); "
                 f"the run re-forms there", style="bold cyan")
    return cfg, mine, len(elected.nodes)
