"""`ftrun --dry-run`: the launch plan of a resolved RunConfig, as text.

The plan is what a real run would do with the same line: the node layout,
each worker's RANK, LOCAL_RANK and WORLD_SIZE, the environment each worker
gets (from ftrun.supervisor.workers.env, the functions a real run uses), and every
option with its value and where the value came from. Values that only a
running launcher learns (a free port, a c10d node rank) are named as such.
This module must never import torch, and never start, bind, connect to or
write anything: it only formats.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ftrun.config import RunConfig
from ftrun.errors import CLI
from ftrun.machine import is_local_address, this_node_name
from ftrun.options import HOOK_OPTIONS, OPTIONS_LIST, Option
from ftrun.supervisor.workers.env import base_env, common_env, log_dir, worker_env

FREE_PORT = "<a free port, picked at start>"
HOST_FQDN = "<the FQDN of the node hosting the store>"
NODE_STORE = "<this node's own store, picked at start>"
# What varies from worker to worker: shown in the table of workers, not with the shared environment.
PER_WORKER = ("RANK", "LOCAL_RANK", "ROLE_RANK", "FTRUN_REPLICA_ID", "TORCHELASTIC_RESTART_COUNT",
              "TORCHELASTIC_ERROR_FILE", "CUDA_VISIBLE_DEVICES")
# Options that only select the plan, or that a real run accepts for torchrun and does not use.
ACCEPTED = ("monitor_interval", "start_method", "event_log_handler", "duplicate_stdout_filters",
            "duplicate_stderr_filters", "logs_specs", "numa_binding")


def plan_text(cfg: RunConfig, typed: Optional[Dict[str, Any]] = None) -> str:
    """The whole plan, ready to print."""
    hosts = _hosts_store(cfg)
    shown = _as_formed(cfg, hosts)
    lines = ["ftrun: dry run: nothing was started (no store, no worker, no folder).", ""]
    lines += _summary(cfg, shown, hosts)
    lines += ["", "Nodes"] + _indent(_nodes(cfg, shown, hosts))
    lines += ["", "Workers on this node"] + _indent(_workers(cfg, shown, hosts))
    lines += ["", "Environment of every worker on this node (besides your own, passed on as it is)"]
    lines += _indent(_environment(cfg, shown, hosts))
    lines += ["", "Options (value, and where it came from)"] + _indent(_options(cfg))
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- the layout


def _hosts_store(cfg: RunConfig) -> Optional[bool]:
    """Whether this node hosts the run's store: True, False, or None where a c10d join decides."""
    if cfg.rdzv == "local":
        return True
    if cfg.rdzv == "static":
        return cfg.node_rank == 0
    if cfg.rdzv_host is not None:
        return cfg.rdzv_host
    # As the c10d join decides (the endpoint names this machine), looked up without binding.
    return True if is_local_address(cfg.master_addr) else None


def _as_formed(cfg: RunConfig, hosts: Optional[bool]) -> RunConfig:
    """The config as the run's first round would have it: c10d forms with MAX nodes at most, the
    host as node 0 and the others in the order they join."""
    if cfg.rdzv != "c10d":
        return cfg
    return dataclasses.replace(cfg, node_rank=0 if hosts else 1, nnodes=cfg.max_nodes,
                               workers_master_addr=this_node_name(cfg.local_addr) if hosts else None,
                               total_restarts=cfg.max_restarts, max_restarts=cfg.max_restarts if cfg.ft else 0)


def _mode(cfg: RunConfig) -> str:
    if cfg.rdzv == "local":
        return "one node (the run's store on this machine)"
    if cfg.rdzv == "static":
        return f"static: {cfg.nnodes} nodes, this is node {cfg.node_rank} (--node-rank)"
    nodes = f"{cfg.min_nodes} to {cfg.max_nodes} nodes (elastic)" if cfg.min_nodes != cfg.max_nodes \
        else f"{cfg.max_nodes} nodes"
    return f"c10d: {nodes}, the same line on every node; node ranks are assigned at join"


def _summary(cfg: RunConfig, shown: RunConfig, hosts: Optional[bool]) -> List[str]:
    target = ([] if cfg.no_python else ["python"]) + (["-m", cfg.script] if cfg.module else [cfg.script])
    if cfg.ft:
        policy = (f"replica restart (--ft): {cfg.max_restarts} restarts per replica, at least {cfg.min_replicas} "
                  f"live replica{'s' if cfg.min_replicas != 1 else ''}")
        if cfg.replica_size > 1:
            policy += f"; a replica is {cfg.replica_size} workers sharding the model"
        if cfg.spares:
            total = cfg.world_size // cfg.replica_size
            s = "s" if cfg.spares != 1 else ""
            where = (f"replica{s} {_span(total - cfg.spares, total - 1)} at the start" if cfg.min_nodes == cfg.max_nodes
                     else f"the highest replica{s} of the nodes there are")
            policy += (f"; {'up to ' if cfg.min_nodes != cfg.max_nodes else ''}{total - cfg.spares} training "
                       f"replica{'s' if total - cfg.spares != 1 else ''} and "
                       f"{cfg.spares} hot spare{s} ({where}), a spare takes a failed replica's place")
        if cfg.checkpoint_dir:
            policy += f"; checkpoints in {cfg.checkpoint_dir} every {cfg.checkpoint_every} steps"
    else:
        policy = f"group restart: {cfg.max_restarts} restart{'s' if cfg.max_restarts != 1 else ''} of every worker"
    rows = [
        ("run", f"{cfg.run_id} (TORCHELASTIC_RUN_ID {cfg.elastic_run_id}"
                + (", a fresh uuid at each start, as torchrun's)" if _is_uuid(cfg.elastic_run_id) else ")")),
        ("runs", shlex.join(target + list(cfg.script_args)) + (" (an executable: --no-python)" if cfg.no_python
                                                              else ", in every worker")),
        ("mode", _mode(cfg)),
        ("store", _store_line(cfg, hosts)),
        ("policy", policy),
        ("hook", cfg.hook.describe() if cfg.hook else "none (DDP's own all-reduce)"),
        ("logs", str(log_dir(shown)) + "/rank<N>/{stdout,stderr}.log"),
    ]
    if cfg.recipe:
        rows.insert(1, ("recipe", cfg.recipe))
    width = max(len(k) for k, _ in rows)
    return [f"{k.ljust(width)}  {v}" for k, v in rows]


def _span(first: int, last: int) -> str:
    return str(first) if first == last else f"{first}-{last}"


def _is_uuid(text: str) -> bool:
    return re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", text) is not None


def _store_line(cfg: RunConfig, hosts: Optional[bool]) -> str:
    port = str(cfg.master_port) if cfg.master_port else FREE_PORT
    if cfg.rdzv == "local":
        return f"hosted by this node at {cfg.master_addr}:{port}"
    where = f"{cfg.master_addr}:{port}"
    if hosts:
        return f"hosted by this node at {where}"
    if hosts is None:
        return f"hosted by the node at {where} (or the one given is_host=1); this node joins it there"
    return f"hosted by node 0 at {where}; this node joins it there"


def _nodes(cfg: RunConfig, shown: RunConfig, hosts: Optional[bool]) -> List[str]:
    k = cfg.replica_size
    rows = [("node", "workers", "global ranks", "replicas" if cfg.ft else "", "")]
    for node in range(shown.nnodes):
        first = node * cfg.nproc
        last = first + cfg.nproc - 1
        note = []
        if node == shown.node_rank:
            note.append("this node")
        if node == 0:
            note.append("hosts the run's store")
        if cfg.rdzv == "c10d" and node >= cfg.min_nodes:
            note.append(f"if it joins (the run starts with {cfg.min_nodes} or more)")
        if cfg.ft and cfg.spares and cfg.min_nodes == cfg.max_nodes:  # the highest replicas wait as spares
            spares = [r for r in range(first // k, last // k + 1) if r >= shown.nnodes * cfg.nproc // k - cfg.spares]
            if spares:
                note.append(f"replica{'s' if len(spares) > 1 else ''} {_span(spares[0], spares[-1])} "
                            f"start{'s' if len(spares) == 1 else ''} as {'spares' if len(spares) > 1 else 'a spare'}")
        replicas = f"{first // k}-{last // k}" if cfg.ft and last // k != first // k else (
            str(first // k) if cfg.ft else "")
        rows.append((str(node), str(cfg.nproc), f"{first}-{last}" if last != first else str(first), replicas,
                     ", ".join(note)))
    out = _table(rows)
    if cfg.rdzv == "c10d":
        out.append(f"(shown as formed with {shown.nnodes} nodes, this one as node {shown.node_rank}: the node at "
                   f"the endpoint is node 0, the others get 1, 2, ... in the order they join)")
    return out


def _workers(cfg: RunConfig, shown: RunConfig, hosts: Optional[bool]) -> List[str]:
    common = _common(cfg, shown, hosts)
    rows = [("local rank",) + PER_WORKER[:5]]
    for local in range(cfg.nproc):
        env = worker_env(common, shown, local, 0)
        rows.append((str(local),) + tuple(env.get(name, "") for name in PER_WORKER[:5]))
    out = _table(rows)
    out.append(f"WORLD_SIZE={common['WORLD_SIZE']} LOCAL_WORLD_SIZE={common['LOCAL_WORLD_SIZE']} "
               f"GROUP_RANK={common['GROUP_RANK']} GROUP_WORLD_SIZE={common['GROUP_WORLD_SIZE']}"
               + (" (c10d: as formed above)" if cfg.rdzv == "c10d" else ""))
    env0 = worker_env(common, shown, 0, 0)
    first = f"rank{env0['RANK']}"
    out.append(f"TORCHELASTIC_ERROR_FILE={env0['TORCHELASTIC_ERROR_FILE'].replace(first, 'rank<RANK>')}")
    yours = [f"{name}={value!r}" for name, value in sorted(base_env().items())
             if name in PER_WORKER and name in env0 and env0[name] != value]
    if yours:
        out.append(f"(your {', '.join(yours)} never reach a worker: each gets its own)")
    if "CUDA_VISIBLE_DEVICES" in env0 and cfg.virtual_local_rank:
        out.append("CUDA_VISIBLE_DEVICES: each worker's own device (--virtual-local-rank)")
    return out


# ---------------------------------------------------------------- the environment


def _common(cfg: RunConfig, shown: RunConfig, hosts: Optional[bool]) -> Dict[str, str]:
    port: Any = cfg.master_port if cfg.master_port else FREE_PORT
    env = common_env(shown, cfg.master_addr, port, base_env())
    for name in ("FTRUN_NODE_STORE", "FTRUN_NODE_RANKS"):
        env.pop(name, None)  # ftrun's alone, as in a real run: one from your shell means nothing here
    if cfg.rdzv == "c10d" and not hosts:
        env["MASTER_ADDR"] = HOST_FQDN
    if cfg.ft and shown.nnodes > 1 and not hosts:
        # Every node but the store's host votes and reports through a store of its own (ftrun.supervisor.loop.run).
        env["FTRUN_NODE_STORE"] = NODE_STORE
        env["FTRUN_NODE_RANKS"] = f"{shown.node_rank} {shown.node_rank * cfg.nproc} {cfg.nproc}"
    return env


def _environment(cfg: RunConfig, shown: RunConfig, hosts: Optional[bool]) -> List[str]:
    common = _common(cfg, shown, hosts)
    user = base_env()
    out = []
    for name in sorted(common):
        value = common[name]
        if name in cfg.env or name in PER_WORKER or (user.get(name) == value and not _ours(name)):
            continue  # the recipe's are below, the per-worker ones above; the rest of yours passes on as it is
        note = f"   (replaces your {user[name]!r})" if name in user and user[name] != value else ""
        out.append(f"{name}={value}{note}")
    for name, value in sorted(cfg.env.items()):
        out.append(f"{name}={value}   (recipe env:)")
    for name in sorted(user):
        if name.startswith("PET_"):
            out.append(f"{name}={user[name]}   (yours, read by ftrun as an option)")
    return out


def _ours(name: str) -> bool:
    """A variable ftrun sets in every worker (torchrun's or its own), whatever your shell had."""
    from ftrun.envvars import BY_NAME, TORCHRUN, WORKER

    var = BY_NAME.get(name)
    return var is not None and var.kind in (TORCHRUN, WORKER)


# ---------------------------------------------------------------- options


def _options(cfg: RunConfig) -> List[str]:
    rows = [("option", "value", "from")]
    for opt in OPTIONS_LIST:
        if not opt.flags or opt.key == "dry_run":
            continue
        source = cfg.sources.get(opt.key, "default")
        rows.append((opt.flag, _value(cfg, opt, source), source))
    if cfg.hook is not None:
        for key, value in sorted(cfg.hook.effective_params().items()):
            opt = HOOK_OPTIONS.get(key)
            if opt is not None:
                rows.append((opt.flag, _show(value), cfg.sources.get(f"hook.{key}", "default")))
        if cfg.hook.wrap:
            rows.append(("--wrap", cfg.hook.wrap, cfg.sources.get("hook.wrap", cfg.sources.get("hook", CLI))))
    return _table(rows)


def _value(cfg: RunConfig, opt: Option, source: str) -> str:
    key = opt.key
    if key in ACCEPTED:
        return "accepted, not used" if source != "default" else "-"
    if key == "nnodes":
        return f"{cfg.min_nodes}:{cfg.max_nodes}" if cfg.min_nodes != cfg.max_nodes else str(cfg.nnodes)
    if key == "rdzv_backend":
        return "c10d" if cfg.rdzv == "c10d" else ("static" if cfg.rdzv == "static" else "static (one node)")
    if key == "rdzv_endpoint":
        return f"{cfg.master_addr}:{cfg.master_port}" if cfg.rdzv == "c10d" else "-"
    if key == "rdzv_conf":
        return ",".join(f"{k}={v}" for k, v in cfg.rdzv_conf.items()) or "-"
    if key == "standalone":
        return _show(source != "default")
    if key == "run_path":
        return _show(source != "default" and not cfg.no_python)
    if key == "hook":
        return cfg.hook.name if cfg.hook else "-"
    if key == "run_id" and source == "default":
        return f"{cfg.run_id} (generated: a real run makes its own)" if cfg.rdzv == "local" else cfg.run_id
    if key == "step_timeout" and not cfg.step_timeout:
        return "off" if cfg.step_timeout == 0 else "- (the default rule: 60 s stopped, or idle while waited for)"
    if key == "master_port":
        return str(cfg.master_port) if cfg.master_port else FREE_PORT
    if key in ("redirects", "tee"):
        value = getattr(cfg, key)
        return ",".join(f"{'all' if r < 0 else r}:{s}" for r, s in sorted(value.items())) or "-"
    return _show(getattr(cfg, key, None))


def _show(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (tuple, list)):
        return ",".join(str(v) for v in value) or "-"
    return str(value)


# ---------------------------------------------------------------- text


def _table(rows: Sequence[Tuple[str, ...]]) -> List[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _indent(lines: List[str]) -> List[str]:
    return ["  " + line for line in lines]
