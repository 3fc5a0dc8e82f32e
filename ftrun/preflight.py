"""Preflight: what this machine cannot do for a run whose input is valid, found before anything starts.

torch's version, the script (found, compiles), the worker count the machine can
hold, the folders the run writes, the addresses and ports it needs, and a live
run of the same id. Each check raises one ConfigError naming the problem and
the fix, blamed on the option it is about; the facts come from ftrun.machine.
This module must never import torch (its version is read from its metadata),
and never write, start or run anything: it only looks.
"""

from __future__ import annotations

import os
import re
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ftrun.errors import CLI, ConfigError, blame, from_source
from ftrun.machine import (find_module, folder_problem, is_local_address, max_workers, port_is_free,
                           store_listen_addr)

if TYPE_CHECKING:
    from ftrun.run_config import RunConfig

TORCH_FLOOR = (2, 10)  # TCPStore.list_keys (torch 2.10); queue_push/queue_pop and libuv master_listen_fd: 2.8


def preflight(cfg: RunConfig, check_script: bool = True) -> None:
    """Every check of this machine for a valid `cfg`, in the order a user meets the problems;
    check_script=False skips only the script's (`ftrun validate` of a recipe that names none)."""
    _check_torch()
    if check_script:
        _check_script(cfg)
    _check_nproc_fits(cfg)
    _check_folders(cfg)
    if cfg.rdzv != "local":
        try:
            socket.getaddrinfo(cfg.master_addr, cfg.master_port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as e:
            key = "rdzv_endpoint" if cfg.rdzv == "c10d" else "master_addr"
            raise blame(key, f"{'--rdzv-endpoint' if cfg.rdzv == 'c10d' else '--master-addr'} "
                             f"{cfg.master_addr!r}: cannot resolve it on this machine ({e.strerror or e}); "
                             f"give node 0's address or host name") from None
    if (cfg.master_port is not None and cfg.rdzv != "c10d" and cfg.node_rank == 0
            and not port_is_free(store_listen_addr(cfg), cfg.master_port)):
        raise blame("master_port", f"--master-port {cfg.master_port} is already in use; pick another or leave "
                                   f"it out for a free one")
    if cfg.rdzv == "static" and cfg.nnodes == 1 and (cfg.sources.get("master_addr") != "default"
                                                     or cfg.sources.get("rdzv_endpoint") != "default"):
        key = "master_addr" if cfg.sources.get("master_addr") != "default" else "rdzv_endpoint"
        check_master_addr_is_here(cfg.master_addr, "--master-addr", cfg.sources.get(key, CLI))
    if cfg.metrics_port is not None:
        _check_metrics_port(cfg)
    if cfg.rdzv != "c10d":
        # c10d: node ranks (and so the run's folder here) are known only after the join.
        _check_no_live_twin(cfg)


def _check_torch() -> None:
    """The installed torch is new enough, read from its metadata (importing torch here would cost seconds)."""
    from importlib import metadata

    try:
        version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        raise ConfigError(f"torch is not installed in this Python ({sys.executable}); "
                          f"install torch>={'.'.join(map(str, TORCH_FLOOR))}") from None
    m = re.match(r"(\d+)\.(\d+)", version or "")
    if m and (int(m.group(1)), int(m.group(2))) < TORCH_FLOOR:
        floor = ".".join(map(str, TORCH_FLOOR))
        raise ConfigError(f"torch {version} is too old: ftrun needs torch>={floor} (TCPStore queues and list_keys); "
                          f"upgrade torch")


def _check_script(cfg: RunConfig) -> None:
    """The script exists and compiles, so a typo fails once here, not in every worker on every restart."""
    if cfg.module:
        problem, origin = find_module(cfg.script, os.getcwd())
        if problem:
            raise blame("script", f"-m {cfg.script}: {problem}")
        if origin and origin.endswith(".py"):
            _check_compiles(origin, f"-m {cfg.script}")
        return
    if cfg.no_python:
        import shutil

        if shutil.which(cfg.script) is None and not os.access(cfg.script, os.X_OK):
            raise blame("script", f"--no-python {cfg.script}: not an executable file or a command on PATH")
        return
    p = Path(cfg.script)
    try:
        is_dir = p.is_dir()
        exists = is_dir or p.exists()
    except OSError as e:  # a name too long for the file system, a loop of links
        raise blame("script", f"script {cfg.script[:80]!r}: {e.strerror or e}; check the path") from None
    if not exists:
        raise blame("script", f"script {cfg.script!r} not found; check the path (relative to {os.getcwd()})")
    if is_dir:
        raise blame("script", f"script {cfg.script!r} is a folder; give the .py file (or -m for a package)")
    _check_compiles(cfg.script, "script")


def _check_compiles(path: str, what: str) -> None:
    # compile() only: nothing of the script runs in the launcher.
    try:
        source = Path(path).read_bytes()
    except OSError as e:
        raise blame("script", f"{what} {path}: cannot be read ({e.strerror or e})") from None
    if b"\0" in source:  # a binary: Python would refuse it in every worker
        raise blame("script", f"{what} {path} is not Python source (it holds null bytes); run an executable "
                              f"with --no-python")
    try:
        compile(source, path, "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as e:
        line = getattr(e, "lineno", None) or 1
        msg = getattr(e, "msg", None) or str(e)
        raise blame("script", f"{getattr(e, 'filename', None) or path}:{line}: {type(e).__name__}: {msg}; fix "
                              f"the script (every worker would fail at start, on every restart)") from None


def _check_nproc_fits(cfg: RunConfig) -> None:
    limit, why = max_workers()
    if cfg.nproc > limit:
        raise blame("nproc", f"--nproc {cfg.nproc} is more workers than this machine can run: at most {limit} "
                             f"({why}); lower --nproc")


def _check_folders(cfg: RunConfig) -> None:
    """The folders the run writes: its state (and default logs) under the runs folder, and --log-dir."""
    from ftrun.status.state import runs_root

    root = str(runs_root())
    problem = folder_problem(root)
    if problem:
        where = "FTRUN_HOME" if os.environ.get("FTRUN_HOME") else "ftrun's runs folder"
        raise ConfigError(f"{where} {root} {problem}; set FTRUN_HOME to a folder you can write", key="log_dir")
    if cfg.log_dir:
        problem = folder_problem(cfg.log_dir)
        if problem:
            raise blame("log_dir", f"--log-dir {cfg.log_dir} {problem}; give a folder you can write")
    if cfg.checkpoint_dir:
        problem = folder_problem(cfg.checkpoint_dir)
        if problem:
            raise blame("checkpoint_dir", f"--checkpoint-dir {cfg.checkpoint_dir} {problem}; give a folder you can "
                                          f"write")


def _check_no_live_twin(cfg: RunConfig) -> None:
    """Two live runs with one run id would share their state file and logs: refuse the second."""
    from ftrun.status.state import live_supervisor, run_folder_name, runs_root

    folder = runs_root() / run_folder_name(cfg.run_id, cfg.nnodes, cfg.node_rank)
    pid = live_supervisor(folder / "state.json")
    if pid is not None and pid != os.getpid():
        raise blame("run_id", f"--run-id {cfg.run_id}: a run of that name is already running here (supervisor pid "
                              f"{pid}); give another --run-id, or stop that run first")


def check_master_addr_is_here(host: str, flag: str, source: str) -> None:
    """One node hosts its own store: an address elsewhere would leave the workers waiting for minutes."""
    key = "rdzv_endpoint" if flag == "--rdzv-endpoint" else "master_addr"
    here = is_local_address(host)
    if here is None:
        raise blame(key, f"{flag} {host}{from_source(source)} does not resolve on this machine; this is a "
                         f"one-node run, whose store runs here: drop {flag}, or give --nnodes N for several machines")
    if not here:
        raise blame(key, f"{flag} {host}{from_source(source)} is not an address of this machine, but this is a "
                         f"one-node run, whose store runs here; drop {flag} (or give this machine's address), or give "
                         f"--nnodes N for several machines")


def _check_metrics_port(cfg: RunConfig) -> None:
    """--metrics-port: its address must be this machine's and its port free (a port per node)."""
    host, port = cfg.metrics_port
    shown = f"--metrics-port {host}:{port}{from_source(cfg.sources.get('metrics_port', CLI))}"
    if not is_local_address(host):
        raise blame("metrics_port", f"{shown}: {host} is not an address of this machine; give a port alone "
                                    f"(served on 127.0.0.1) or this machine's address")
    if port and not port_is_free(host, port):
        raise blame("metrics_port", f"{shown}: the port is already in use (another run on this machine, or "
                                    f"another node of this run?); pick another, one per node, or 0 for a free one")
