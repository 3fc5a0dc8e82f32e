"""What the supervisor builds before its loop starts: the checkpoint folder's lock, the workers'
common environment (and the node relay that goes with it), the spawner, the first quorum keeper.

Builders only: each returns what it built, and the loop (ftrun.supervisor.loop.run) keeps it.
Must never start a worker, and never import torch.
"""

from __future__ import annotations

import queue
import sys
from typing import Any, Dict, List, Optional, Tuple

from ftrun.config import RunConfig
from ftrun.keys import NODE_RANKS_ENV, NODE_STORE_ENV
from ftrun.supervisor.ft.keeper.core import FRESH_START
from ftrun.supervisor.loop import folder_lock
from ftrun.supervisor.nodes.node_decisions import node_ranks, routes
from ftrun.supervisor.relay import NodeRelay
from ftrun.supervisor.ft.quorum import QuorumKeeper
from ftrun.supervisor.store import RunStore
from ftrun.supervisor.workers.env import base_env, common_env, zygote_env
from ftrun.supervisor.workers.logs import ConsoleOut
from ftrun.supervisor.workers.spawn import PopenSpawner, ZygoteSpawner


def lock_folder(cfg: RunConfig, console: ConsoleOut) -> Optional[folder_lock.FolderLock]:
    """--ft with --checkpoint-dir, node 0: a second live run on the folder is refused in one line
    (ConfigError: exit 2), before anything starts; partial folders that killed writes left go."""
    if not (cfg.ft and cfg.checkpoint_dir and cfg.node_rank == 0):
        return None
    lock = folder_lock.acquire(cfg.checkpoint_dir, cfg.run_id, lambda m: console.note(m, style="yellow"))
    count, size = folder_lock.remove_partials(cfg.checkpoint_dir)
    if count:
        console.note(f"removed {count} partial checkpoint folder{'s' if count != 1 else ''} that killed "
                     f"writes left in {cfg.checkpoint_dir} ({size / 1e6:.1f} MB)", style="yellow")
    return lock


def workers_common(cfg: RunConfig, store: RunStore, nodes: Any) -> Tuple[Dict[str, str], Optional[NodeRelay]]:
    """The environment every worker of this node gets, and the relay of its votes and reports
    through the node's own store (ftrun.supervisor.relay), where it has one (--ft)."""
    common = common_env(cfg, cfg.master_addr, store.port, base_env())
    common.pop(NODE_STORE_ENV, None)  # ours alone: one the user's shell had means nothing here
    common.pop(NODE_RANKS_ENV, None)
    if not (cfg.ft and nodes is not None and nodes.node_store is not None):
        return common, None
    # This node's own store: its workers vote and report through it, and learn there the run's
    # store's next address, should it move.
    node_store = nodes.node_store
    common[NODE_STORE_ENV] = f"{node_store.host}:{node_store.port}"
    common[NODE_RANKS_ENV] = f"{cfg.node_rank} {cfg.node_rank * cfg.nproc} {cfg.nproc}"
    return common, NodeRelay(cfg.node_rank, node_ranks(cfg, cfg.node_rank), lambda: node_store.store,
                             lambda: store.store)


def spawner(cfg: RunConfig, events: "queue.SimpleQueue", common: Dict[str, str], cwd: str,
            given: Optional[ZygoteSpawner]) -> Any:
    """The spawner: a zygote's (the one the rendezvous started, if any) or Popen's, as
    cfg.use_zygote says."""
    if cfg.use_zygote and given is not None:
        given.events = events  # nothing is posted before the first spawn but "ready"
        return given
    if cfg.use_zygote:
        return ZygoteSpawner(events, zygote_env(cfg, common), cwd)
    return PopenSpawner(events)


def argv(cfg: RunConfig) -> List[str]:
    """A worker's command line (a zygote is given the script's alone)."""
    target = (["-m", cfg.script] if cfg.module else [cfg.script]) + list(cfg.script_args)
    if cfg.use_zygote:
        return target
    if cfg.no_python:
        return [cfg.script] + list(cfg.script_args)
    return [sys.executable, "-m", "ftrun.worker.bootstrap"] + target


def first_quorum(cfg: RunConfig, store: RunStore, nodes: Any, local: List[int], k: int) -> QuorumKeeper:
    """--ft: node 0 keeps the quorum of every rank; other nodes report to it through the store."""
    live = nodes.live if nodes is not None else [0]
    fresh = "resuming from the newest checkpoint, if any" if cfg.checkpoint_dir else FRESH_START
    return QuorumKeeper(store, [r for n in live for r in node_ranks(cfg, n)], local, leader=cfg.node_rank == 0,
                        replica_size=k, routes=routes(cfg, nodes, live), fresh_start=fresh, spares=cfg.spares)
