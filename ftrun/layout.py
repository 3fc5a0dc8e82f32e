"""The node layout: torchrun's launch modes resolved as torchrun resolves them (torch.distributed.run).

From the options picked by ftrun.config: one node (torchrun's --standalone and
its plain one-node run), static (--node-rank per node) or c10d (ranks given at
join); the store's address and port, the run's ids, --nproc-per-node's words
(auto, cpu, gpu) counted on this machine, and the layout Slurm's SLURM_*
variables give, below every other source.
This module must never import torch, and never write, start or run anything.
"""

from __future__ import annotations

import os
import secrets
import uuid
from typing import Any, Callable, Dict, Mapping, Optional

from ftrun.errors import ConfigError
from ftrun.machine import cpu_count, store_bind_addr, this_node_name, visible_device_count
from ftrun.option_readers import NPROC_WORDS
from ftrun.preflight import check_master_addr_is_here

C10D_DEFAULT_PORT = 29400  # torchrun's port when --rdzv-endpoint names none


def resolve_nproc(value: Any, where: str) -> int:
    """torchrun's words for --nproc-per-node, counted without importing torch."""
    if value not in NPROC_WORDS:
        return int(value)
    if value == "cpu":
        return cpu_count()
    if value == "auto":
        return visible_device_count() or cpu_count()
    gpus = visible_device_count() if value == "gpu" else 0
    if not gpus:
        raise ConfigError(f"{where}: --nproc-per-node {value}: no {value.upper()} visible on this machine; "
                          f"give a number, or cpu / auto", key="nproc")
    return gpus


def new_run_id() -> str:
    """A fresh name for a run that was given none."""
    return "ftrun-" + secrets.token_hex(4)


def resolve_layout(kw: Dict[str, Any], pick: Callable[[str], Any], sources: Dict[str, str],
                   check_paths: bool = True) -> None:
    """torchrun's launch modes, resolved as torchrun resolves them (torch.distributed.run.run), into `kw`
    (RunConfig's fields so far); `pick(key)` reads an option from its sources, and records where from in
    `sources`."""
    backend = pick("rdzv_backend")
    endpoint = pick("rdzv_endpoint")
    given_id = pick("run_id")
    conf = pick("rdzv_conf") or {}
    kw["rdzv_conf"] = conf
    standalone = pick("standalone")
    if standalone:
        if kw["max_nodes"] > 1:
            raise ConfigError(f"--standalone runs on one node, but --nnodes is {kw['max_nodes']}; for several nodes "
                              f"use --rdzv-backend c10d --rdzv-endpoint HOST:PORT", key="standalone")
        backend, endpoint = "c10d", ("localhost", 0)
    if "join_timeout" in conf and sources.get("join_timeout") == "default":
        kw["join_timeout"] = float(conf["join_timeout"])
    for name in ("last_call_timeout", "close_timeout", "read_timeout"):
        if name in conf:
            kw[name] = float(conf[name])
    if "is_host" in conf:
        kw["rdzv_host"] = conf["is_host"].strip().lower() in ("1", "true", "yes", "on")
    # TORCHELASTIC_RUN_ID: torchrun gives a fresh uuid where it turns the run into a
    # one-node c10d run itself (--standalone, or one node without --master-port), else --rdzv-id.
    elastic_id = given_id or "none"
    if backend == "static":
        if kw["min_nodes"] != kw["max_nodes"]:
            raise ConfigError(f"--nnodes {kw['min_nodes']}:{kw['max_nodes']} is elastic and needs ranks assigned at "
                              f"join: add --rdzv-backend c10d --rdzv-endpoint HOST:PORT", key="nnodes")
        if endpoint is not None:
            # torchrun: a static endpoint stands for --master-addr/--master-port
            kw["master_addr"], kw["master_port"] = endpoint[0], endpoint[1] or kw["master_port"]
        if kw["max_nodes"] == 1 and kw["master_port"] is None:
            kw["rdzv"] = "local"  # torchrun's plain one-node run is a c10d run on localhost:0
            elastic_id = str(uuid.uuid4())
        else:
            kw["rdzv"] = "static"
    else:
        if endpoint is None:
            raise ConfigError("--rdzv-backend c10d needs --rdzv-endpoint HOST:PORT: the address of the node that "
                              "hosts the run's store, the same on every node (or --standalone on one node)",
                              key="rdzv_endpoint")
        host, port = endpoint[0], C10D_DEFAULT_PORT if endpoint[1] is None else endpoint[1]
        if standalone:
            elastic_id = str(uuid.uuid4())
        if kw["max_nodes"] == 1:
            kw["rdzv"] = "local"
            kw["master_port"] = port or None
        else:
            if port == 0:
                raise ConfigError(f"--rdzv-endpoint {host}:0 picks a free port, which only works on one node; give "
                                  f"every node the same port, e.g. {host}:{C10D_DEFAULT_PORT}", key="rdzv_endpoint")
            kw["rdzv"] = "c10d"
            kw["master_addr"], kw["master_port"] = host, port
    if kw["rdzv"] == "local":
        # One node: torchrun ignores these; a value given for them is a mistake that would
        # otherwise pass unnoticed (or, for an address elsewhere, hang the workers).
        if sources.get("node_rank") != "default" and kw["node_rank"] != 0:
            raise ConfigError(f"--node-rank {kw['node_rank']} on a one-node run (--nnodes 1): the only node is "
                              f"node 0; drop --node-rank or give --nnodes N", key="node_rank")
        if check_paths and sources.get("master_addr") != "default":
            check_master_addr_is_here(str(kw["master_addr"]), "--master-addr", sources["master_addr"])
        if check_paths and endpoint is not None and sources.get("rdzv_endpoint") != "default":
            check_master_addr_is_here(str(endpoint[0]), "--rdzv-endpoint", sources["rdzv_endpoint"])
        kw["node_rank"] = 0
        kw["nnodes"] = kw["min_nodes"] = kw["max_nodes"] = 1
        # torchrun's workers meet at the FQDN of the node (its MASTER_ADDR); the store listens there.
        kw["master_addr"] = local_master_addr(kw.get("local_addr"))
    kw["elastic_run_id"] = elastic_id
    # ftrun's own name of the run: given, else one every node derives alike, else a fresh one.
    if given_id:
        kw["run_id"] = given_id
    elif kw["rdzv"] != "local" and kw["max_nodes"] > 1 and kw["master_port"]:
        kw["run_id"] = f"ftrun-port{kw['master_port']}"
    else:
        kw["run_id"] = os.environ.get("FTRUN_RUN_ID_DEFAULT") or new_run_id()


def local_master_addr(local_addr: Optional[str]) -> str:
    """MASTER_ADDR of a one-node run: torchrun's (this node's FQDN) when this machine can listen there."""
    name = this_node_name(local_addr)
    return name if store_bind_addr(name) != "0.0.0.0" else "localhost"


# The default hang rule's limit (no --step-timeout): a worker stopped this long, or under --ft one


def slurm_layout(cli: Mapping[str, Any], recipe: Mapping[str, Any], pets: Mapping[str, Any],
                  environ: Mapping[str, str]) -> Dict[str, Any]:
    """Layout defaults from SLURM_* variables, below every other source.

    An explicit nnodes of 1 means a one-node run even inside an allocation,
    a one-node Slurm step stays a plain local run, and a c10d run takes
    nothing from Slurm but the node count (its ranks are assigned at join)."""
    from ftrun.slurm import SlurmError, layout_from_env

    def given(key: str) -> Any:
        for src in (cli, recipe):
            if src.get(key) is not None:
                return src[key]
        return pets[key][0] if key in pets else None

    nn = given("nnodes")
    if nn is not None and str(nn).strip() in ("1", "1:1"):
        return {}
    if given("standalone"):
        return {}
    try:
        layout = layout_from_env(environ)
    except SlurmError as e:
        raise ConfigError(f"Slurm: {e}") from None
    if layout.get("nnodes", 1) == 1 and nn is None:
        return {}
    if str(given("rdzv_backend") or "static").strip() == "c10d":
        return {k: v for k, v in layout.items() if k in ("nnodes",)}
    return layout
