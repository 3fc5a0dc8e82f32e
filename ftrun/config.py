"""RunConfig: everything a run needs, from the command line, a recipe, PET_* and Slurm, validated.

Every option is declared once in ftrun.options; here the sources are merged
with one precedence (command line > recipe > PET_* > Slurm > defaults), each
value is read by its option, torchrun's launch modes are resolved (one node,
static, c10d) and every check that can be made before a worker starts is made,
as one ConfigError that carries the key it is about: bad values, options that
would do nothing, and what this machine cannot do (folders, addresses, ports,
the script's syntax, worker count, torch's version, a live run of the same id).
This module must never import torch (the CLI and `ftrun validate` use it), and
never write, start or run anything: it only looks.
"""

from __future__ import annotations

import difflib
import importlib.machinery
import os
import re
import secrets
import socket
import stat
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple

from ftrun.errors import ConfigError
from ftrun.hookspec import HookSpec, parse_hook
from ftrun.options import OPTIONS, NPROC_WORDS, OptionError, pet_values
from ftrun.protocol import round_steps_from_env

__all__ = ["OPTIONS", "RunConfig", "build_config", "validate", "closest"]

DEFAULT_MAX_RESTARTS = 0
DEFAULT_MAX_RESTARTS_FT = 3
C10D_DEFAULT_PORT = 29400  # torchrun's port when --rdzv-endpoint names none
CLI = "command line"


@dataclass
class RunConfig:
    """A validated run. Built only by build_config()."""

    script: str
    script_args: Tuple[str, ...] = ()
    module: bool = False
    no_python: bool = False
    nproc: int = 1
    nnodes: int = 1
    min_nodes: int = 1
    max_nodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: Optional[int] = None
    # "local" (one node, store on this machine: torchrun's --standalone and its plain
    # one-node run), "static" (--node-rank per node) or "c10d" (ranks given at join).
    rdzv: str = "local"
    rdzv_host: Optional[bool] = None      # c10d: host the store here (None: if the endpoint is this machine)
    rdzv_conf: Dict[str, str] = field(default_factory=dict)
    last_call_timeout: float = 30.0
    close_timeout: float = 60.0           # honoured only when --rdzv-conf gives it (nodes.py)
    read_timeout: float = 60.0            # c10d: store operations of the nodes that join
    local_addr: Optional[str] = None
    join_timeout: float = 120.0
    max_restarts: int = DEFAULT_MAX_RESTARTS
    ft: bool = False
    min_replicas: int = 1
    replica_size: int = 1
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 500
    checkpoint_keep: int = 2
    hook: Optional[HookSpec] = None
    step_timeout: Optional[float] = None
    metrics_port: Optional[Tuple[str, int]] = None  # --metrics-port: (host, port) of the Prometheus endpoint
    shutdown_timeout: float = 5.0
    log_dir: Optional[str] = None
    quiet: bool = False
    verbose: bool = False
    ranks: Optional[Tuple[int, ...]] = None
    local_ranks_filter: Optional[Tuple[int, ...]] = None
    redirects: Dict[int, int] = field(default_factory=dict)   # local rank (-1: all) -> torchrun Std
    tee: Dict[int, int] = field(default_factory=dict)
    role: str = "default"
    signals_to_handle: Tuple[str, ...] = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    virtual_local_rank: bool = False
    round: int = 0                        # c10d: the rendezvous round (TORCHELASTIC_RESTART_COUNT counts them)
    total_restarts: Optional[int] = None  # c10d: the run's budget, when a round runs with none of its own
    workers_master_addr: Optional[str] = None  # c10d: MASTER_ADDR for the workers (the host's name)
    endpoint: str = ""                    # c10d: the run's --rdzv-endpoint as given, wherever the store moved
    # c10d --ft: this node joined a running round late; the nodes in the run when node 0 took it in
    nodes_live: Optional[Tuple[int, ...]] = None
    run_id: str = ""                      # ftrun's name of the run (status, state folder)
    elastic_run_id: str = "none"          # TORCHELASTIC_RUN_ID, as torchrun sets it
    env: Dict[str, str] = field(default_factory=dict)
    recipe: Optional[str] = None
    sources: Dict[str, str] = field(default_factory=dict, compare=False, repr=False)  # key -> where it came from

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes

    @property
    def admits_late(self) -> bool:
        """--ft on an elastic c10d run: a node that comes while the run trains joins it at once."""
        return self.ft and self.rdzv == "c10d" and self.min_nodes != self.max_nodes


def closest(word: str, choices) -> str:
    """' (did you mean X?)' for the closest known word, or ''."""
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.5)
    return f" (did you mean {match[0]!r}?)" if match else ""


def visible_device_count() -> int:
    """GPUs this node may use, found without importing torch (0 if none)."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        return len([d for d in cvd.split(",") if d.strip() and d.strip() != "-1"])
    gpus = Path("/proc/driver/nvidia/gpus")
    return len(list(gpus.iterdir())) if gpus.is_dir() else 0


def cpu_count() -> int:
    """CPUs this process may use (affinity and cgroup sets respected), as torchrun counts them."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


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


def port_is_free(addr: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM) as s:
        # As the store's own listener does: connections of an earlier run still in
        # TIME_WAIT must not make a free port look taken.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr if addr not in ("localhost",) else "127.0.0.1", port))
        except OSError:
            return False
    return True


def new_run_id() -> str:
    return "ftrun-" + secrets.token_hex(4)


def this_node_name(local_addr: Optional[str] = None) -> str:
    """The address torchrun puts in MASTER_ADDR for a node that hosts the store: --local-addr, else its FQDN."""
    return local_addr or socket.getfqdn()


def _read(key: str, value: Any, source: str) -> Any:
    """One option's value from one source, or the one-line error saying where it came from."""
    opt = OPTIONS[key]
    try:
        return opt.parse(value)
    except OptionError as e:
        if source == CLI:
            raise ConfigError(f"{CLI}: {opt.flag} {e.problem}", key=key, problem=e.problem) from None
        if source.startswith("PET_"):
            raise ConfigError(f"environment: {source}={value!r} {e.problem}; fix it or unset {source}",
                              key=key, problem=e.problem) from None
        raise ConfigError(f"{source}: {key}: {e.problem}", key=key, problem=e.problem) from None


def build_config(cli: Mapping[str, Any], recipe: Optional[Mapping[str, Any]] = None,
                 recipe_name: Optional[str] = None, check_paths: bool = True,
                 environ: Optional[Mapping[str, str]] = None, check_script: bool = True) -> RunConfig:
    """Merge the sources key by key (command line > recipe > PET_* > Slurm > defaults) and validate.

    `cli` holds only options the user typed (plus `script`/`args` when given),
    as typed; `recipe` is a recipe mapping already checked key by key by
    ftrun.recipe; `environ` defaults to os.environ (PET_* and SLURM_* are read
    from it). check_paths=False skips every check that looks at the machine
    (files, ports, addresses, processes); check_script=False skips only the
    script's (`ftrun validate` of a recipe that names none).
    """
    environ = os.environ if environ is None else environ
    recipe = dict(recipe or {})
    where_recipe = recipe_name or "recipe"
    try:
        pets = pet_values(environ)
    except OptionError as e:
        name = OPTIONS[e.key].pet
        raise ConfigError(f"environment: {name}={environ.get(name)!r} {e.problem}; fix it or unset {name}",
                          key=e.key, problem=e.problem) from None
    slurm = _slurm_layout(cli, recipe, pets, environ)
    sources: Dict[str, str] = {}

    def raw(key: str) -> Tuple[Any, str]:
        if cli.get(key) is not None:
            return cli[key], CLI
        if recipe.get(key) is not None:
            return recipe[key], where_recipe
        if key in pets:
            return pets[key]
        if key in slurm:
            return slurm[key], "Slurm (SLURM_* variables)"
        if key == "shutdown_timeout" and environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
            return environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"], "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
        return None, "default"

    def pick(key: str) -> Any:
        value, source = raw(key)
        sources[key] = source
        if value is None:
            return OPTIONS[key].default
        return _read(key, value, source)

    kw: Dict[str, Any] = {}

    # The script: CLI wins; a recipe may carry one (with args) for `ftrun --recipe X`.
    script, _ = raw("script")
    if not script:
        raise ConfigError("no training script given; usage: ftrun [OPTIONS] SCRIPT [ARGS]... (see ftrun --help)")
    # Arguments given on the command line win; without any, the recipe's args
    # apply unless the command line names a different script than the recipe's.
    recipe_script = recipe.get("script")
    same_script = not (cli.get("script") and recipe_script) or os.path.normpath(str(cli["script"])) == os.path.normpath(str(recipe_script))
    if cli.get("args"):
        args = tuple(str(a) for a in cli["args"])
    elif same_script:
        args = tuple(str(a) for a in (recipe.get("args") or ()))
    else:
        args = ()
    kw["script"] = str(script)
    kw["script_args"] = args

    kw["nproc"] = resolve_nproc(pick("nproc"), sources["nproc"])
    for key in ("max_restarts", "min_replicas", "replica_size", "step_timeout", "shutdown_timeout", "node_rank",
                "master_addr", "master_port", "join_timeout", "ft", "quiet", "verbose", "module", "no_python",
                "log_dir", "ranks", "metrics_port",
                "local_ranks_filter", "role", "signals_to_handle", "virtual_local_rank", "local_addr"):
        kw[key] = pick(key)
    kw["checkpoint_dir"] = pick("checkpoint_dir")
    kw["checkpoint_every"] = pick("checkpoint_every")
    kw["checkpoint_keep"] = pick("checkpoint_keep")
    kw["redirects"] = pick("redirects") or {}
    kw["tee"] = pick("tee") or {}
    if pick("run_path"):
        kw["no_python"] = False  # torchrun: --run-path takes precedence over --no-python
    # Accepted for torchrun; what ftrun does instead is in the reference (docs: Run options).
    for key in ("monitor_interval", "start_method", "event_log_handler", "duplicate_stdout_filters",
                "duplicate_stderr_filters", "logs_specs", "numa_binding"):
        pick(key)
    kw["min_nodes"], kw["max_nodes"] = pick("nnodes")
    kw["nnodes"] = kw["max_nodes"]
    _layout(kw, pick, sources, check_paths)

    # Hook: CLI parameters override the recipe's, key by key.
    hook_raw: Dict[str, Any] = dict(recipe.get("hook") or {})
    hook_cli = dict(cli.get("hook") or {})
    if hook_cli.get("name") and hook_raw.get("name") and hook_cli["name"] != hook_raw["name"]:
        hook_raw = {}  # a different hook on the command line replaces the recipe's whole hook
    hook_raw.update(hook_cli)
    if hook_raw:
        where = CLI if hook_cli else where_recipe
        sources["hook"] = where
        sources.update({f"hook.{k}": CLI if k in hook_cli else where_recipe for k in hook_raw if k != "name"})
        if "name" not in hook_raw:
            flags = ", ".join("--" + k.replace("_", "-") for k in hook_raw)
            raise ConfigError(f"{where}: {flags} given without a hook; add --hook NAME (e.g. --hook powersgd)",
                              key="hook")
        kw["hook"] = parse_hook(hook_raw, where)

    env = {str(k): str(v) for k, v in (recipe.get("env") or {}).items()}
    env.update({str(k): str(v) for k, v in (cli.get("env") or {}).items()})
    kw["env"] = env

    if kw.get("max_restarts") is None:
        kw["max_restarts"] = DEFAULT_MAX_RESTARTS_FT if kw.get("ft") else DEFAULT_MAX_RESTARTS
    kw["recipe"] = recipe_name
    kw["sources"] = sources
    cfg = RunConfig(**kw)
    validate(cfg, check_paths=check_paths, check_script=check_script)
    return cfg


def _layout(kw: Dict[str, Any], pick, sources: Dict[str, str], check_paths: bool = True) -> None:
    """torchrun's launch modes, resolved as torchrun resolves them (torch.distributed.run.run)."""
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
            _check_master_addr_is_here(str(kw["master_addr"]), "--master-addr", sources["master_addr"])
        if check_paths and endpoint is not None and sources.get("rdzv_endpoint") != "default":
            _check_master_addr_is_here(str(endpoint[0]), "--rdzv-endpoint", sources["rdzv_endpoint"])
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
# its peers waited for this long while it did nothing, is hung. FTRUN_HANG_AFTER_S changes it.
DEFAULT_HANG_S = 60.0
HANG_ENV = "FTRUN_HANG_AFTER_S"


def hang_after_s(env: Mapping[str, str]) -> Tuple[float, Optional[str]]:
    """(the default hang rule's limit in seconds, a line saying why the environment's value is
    refused, or None)."""
    raw = env.get(HANG_ENV)
    if raw is None:
        return DEFAULT_HANG_S, None
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if 1.0 <= value <= 86400.0:  # also false for nan
        return value, None
    return DEFAULT_HANG_S, (f"{HANG_ENV}={raw!r} is not a number of seconds from 1 to 86400; fix it or unset "
                            f"{HANG_ENV} (default {DEFAULT_HANG_S:g}; --step-timeout replaces the rule)")


def _fail(key: str, message: str) -> ConfigError:
    """A cross-key problem, blamed on `key` (a recipe error lands on that key's line)."""
    return ConfigError(message, key=key, problem=message)


# A run id names a folder (plus ".nodeK"): ASCII, no path separators, well under NAME_MAX.
RUN_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def validate(cfg: RunConfig, check_paths: bool = True, check_script: bool = True) -> None:
    """Checks that need the whole config, or the machine (files, ports, addresses, processes)."""
    if cfg.module and cfg.no_python:
        raise _fail("module", "-m/--module and --no-python cannot be used together; pick one")
    raw = os.environ.get("FTRUN_NODE_TIMEOUT")
    if raw is not None:
        try:
            ok = 0.5 <= float(raw) <= 3600
        except ValueError:
            ok = False
        if not ok:
            raise ConfigError(f"environment: FTRUN_NODE_TIMEOUT={raw!r} is not a number of seconds between 0.5 and "
                              f"3600; fix it or unset FTRUN_NODE_TIMEOUT (default 3)")
    _, bad_hang = hang_after_s(os.environ)
    if bad_hang:
        raise ConfigError(f"environment: {bad_hang}")
    _, bad_round = round_steps_from_env(os.environ)
    if bad_round and cfg.ft:
        raise ConfigError(f"environment: {bad_round}")
    moves = os.environ.get("FTRUN_STORE_MOVES")
    if moves is not None and moves not in ("0", "1"):
        raise ConfigError(f"environment: FTRUN_STORE_MOVES={moves!r} must be 0 or 1 (1, the default: the run's "
                          f"store moves when its node is lost); fix it or unset FTRUN_STORE_MOVES")
    if not RUN_ID_RE.fullmatch(cfg.run_id):
        shown = cfg.run_id if len(cfg.run_id) <= 40 else cfg.run_id[:40] + f"... ({len(cfg.run_id)} characters)"
        raise _fail("run_id", f"--run-id {shown!r}{_from(cfg.sources.get('run_id', CLI))}: use 1 to 128 ASCII "
                              f"letters, digits, '-', '_' and '.', starting with a letter or digit (it names the "
                              f"run's folder)")
    _check_ignored_options(cfg)
    if cfg.rdzv == "static" and cfg.node_rank >= cfg.nnodes:
        raise _fail("node_rank", f"--node-rank {cfg.node_rank} is out of range for --nnodes {cfg.nnodes}; "
                                      f"use 0..{cfg.nnodes - 1}")
    if cfg.rdzv == "static" and cfg.nnodes > 1 and cfg.master_port is None:
        raise _fail("master_port", f"--nnodes {cfg.nnodes} needs --master-port: the same port on every node, "
                                        f"where node 0's ftrun hosts the run's store (e.g. --master-port 29500), "
                                        f"or --rdzv-backend c10d --rdzv-endpoint HOST:PORT")
    if cfg.rdzv != "local" and not cfg.master_addr.strip():
        raise _fail("master_addr", "--master-addr is empty; give node 0's address (the same on every node)")
    if cfg.ranks is not None:
        # An elastic run has at most max_nodes * nproc ranks.
        bad = [r for r in cfg.ranks if r >= cfg.world_size]
        if bad:
            raise _fail("ranks", f"--ranks {','.join(map(str, bad))}: no such rank; this run has ranks "
                                      f"0..{cfg.world_size - 1}")
    if cfg.local_ranks_filter is not None:
        bad = [r for r in cfg.local_ranks_filter if r >= cfg.nproc]
        if bad:
            raise _fail("local_ranks_filter", f"--local-ranks-filter {','.join(map(str, bad))}: no such local "
                                                   f"rank; this node has local ranks 0..{cfg.nproc - 1}")
    if cfg.ft and cfg.replica_size > 1:
        _check_replica_size(cfg)
    replicas = cfg.world_size // cfg.replica_size
    if cfg.ft and cfg.min_nodes == cfg.max_nodes and cfg.min_replicas > replicas:
        raise _fail("min_replicas", f"--min-replicas {cfg.min_replicas} exceeds the {replicas} replicas "
                                         f"of this run; lower it")
    if not check_paths:
        return
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
            raise _fail(key, f"{'--rdzv-endpoint' if cfg.rdzv == 'c10d' else '--master-addr'} "
                                  f"{cfg.master_addr!r}: cannot resolve it on this machine ({e.strerror or e}); "
                                  f"give node 0's address or host name") from None
    if (cfg.master_port is not None and cfg.rdzv != "c10d" and cfg.node_rank == 0
            and not port_is_free(store_listen_addr(cfg), cfg.master_port)):
        raise _fail("master_port", f"--master-port {cfg.master_port} is already in use; pick another or leave "
                                        f"it out for a free one")
    if cfg.rdzv == "static" and cfg.nnodes == 1 and (cfg.sources.get("master_addr") != "default"
                                                     or cfg.sources.get("rdzv_endpoint") != "default"):
        key = "master_addr" if cfg.sources.get("master_addr") != "default" else "rdzv_endpoint"
        _check_master_addr_is_here(cfg.master_addr, "--master-addr", cfg.sources.get(key, CLI))
    if cfg.metrics_port is not None:
        _check_metrics_port(cfg)
    if cfg.rdzv != "c10d":
        # c10d: node ranks (and so the run's folder here) are known only after the join.
        _check_no_live_twin(cfg)


def _check_metrics_port(cfg: RunConfig) -> None:
    """--metrics-port: its address must be this machine's and its port free (a port per node)."""
    host, port = cfg.metrics_port
    shown = f"--metrics-port {host}:{port}{_from(cfg.sources.get('metrics_port', CLI))}"
    if not is_local_address(host):
        raise _fail("metrics_port", f"{shown}: {host} is not an address of this machine; give a port alone "
                                    f"(served on 127.0.0.1) or this machine's address")
    if port and not port_is_free(host, port):
        raise _fail("metrics_port", f"{shown}: the port is already in use (another run on this machine, or "
                                    f"another node of this run?); pick another, one per node, or 0 for a free one")


def python_path_for(cwd: str) -> list:
    """The module search path `python -m` would have in `cwd`: cwd first, then PYTHONPATH, then the installation's."""
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    # sys.path[0] is the supervisor's own script folder (e.g. .venv/bin), not the user's.
    rest = [p for p in sys.path[1:] if p not in extra]
    return [cwd] + extra + rest


def find_module(name: str, cwd: str) -> Tuple[Optional[str], Optional[str]]:
    """(why `python -m name` would fail in `cwd` or None, the file it would run or None).

    Imports nothing (no package __init__ runs)."""
    parts = name.split(".")
    if not all(p.isidentifier() for p in parts):
        return f"{name!r} is not a module name (python -m takes a dotted name such as pkg.train, not a path)", None
    path = python_path_for(cwd)
    spec = None
    for i, part in enumerate(parts):
        full = ".".join(parts[: i + 1])
        spec = importlib.machinery.PathFinder.find_spec(full, path)
        if spec is None:
            if i == 0 and part in sys.builtin_module_names:
                return None, None
            where = "the Python path" if i == 0 else f"package {'.'.join(parts[:i])!r}"
            return (f"no module named {full!r} in {where} (searched from {cwd}, as python -m would); "
                    f"check the name, run from the project's root, or install it"), None
        if i < len(parts) - 1:
            if spec.submodule_search_locations is None:
                return f"{full!r} is a module, not a package, so it has no {parts[i + 1]!r}", None
            path = list(spec.submodule_search_locations)
    if spec is not None and spec.submodule_search_locations is not None:
        main = importlib.machinery.PathFinder.find_spec(name + ".__main__", list(spec.submodule_search_locations))
        if main is None:
            return (f"{name!r} is a package without a __main__ module, so python -m cannot run it; "
                    f"name a module inside it (e.g. -m {name}.train) or add {name.replace('.', '/')}/__main__.py"), None
        return None, main.origin
    return None, spec.origin if spec is not None else None


def store_listen_addr(cfg: RunConfig) -> str:
    """Where the store listens: where MASTER_ADDR points (one node), master_addr's interface (static)."""
    if cfg.rdzv == "c10d":
        return "0.0.0.0"  # as torchrun's store: reachable at this node's FQDN as well as at the endpoint
    return store_bind_addr(cfg.master_addr)


def store_bind_addr(master_addr: str) -> str:
    """The local address the store binds for `master_addr`: that address when it is one of this
    machine's (so the store is reachable there and nowhere else), else every interface
    (master_addr names a NAT or load-balancer address, or a name that resolves elsewhere)."""
    try:
        infos = socket.getaddrinfo(master_addr, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return "0.0.0.0"
    for family, _, _, _, sockaddr in infos:
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        addr = sockaddr[0]
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((addr, 0))
            return addr
        except OSError:
            continue
    return "0.0.0.0"


def _slurm_layout(cli: Mapping[str, Any], recipe: Mapping[str, Any], pets: Mapping[str, Any],
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


# --------------------------------------------------------------------------- checks of the machine
# Each raises one ConfigError naming the problem and the fix; none writes, starts or imports torch.

TORCH_FLOOR = (2, 10)  # TCPStore.list_keys (torch 2.10); queue_push/queue_pop and libuv master_listen_fd: 2.8
WORKERS_PER_CPU = 8                # more workers than this per usable core is oversubscription, not training
WORKER_MEMORY_BYTES = 100 << 20    # the least a worker needs beyond what it shares with its zygote


# What a sharded replica's cross-replica reduce can do: average, optionally in half precision.
# PowerSGD, local SGD and noop are DDP hooks (they need DDP's buckets and its optimizer loop).
SHARDED_HOOKS = ("allreduce", "fp16", "bf16")


def _check_replica_size(cfg: RunConfig) -> None:
    """--replica-size K > 1: K workers of one node shard each replica, so K divides the node's workers."""
    k = cfg.replica_size
    if cfg.nproc % k:
        spans = k % cfg.nproc == 0
        raise _fail("replica_size", f"--replica-size {k} does not divide the {cfg.nproc} workers of a node"
                    + ("; a replica spanning several nodes is not supported yet: use one replica per node "
                       f"(--replica-size {cfg.nproc}) or smaller" if spans else
                       f"; pick a divisor of {cfg.nproc} (replicas never span nodes)"))
    if cfg.hook is not None and cfg.hook.name not in SHARDED_HOOKS:
        raise _fail("hook", f"--hook {cfg.hook.name} needs DDP's buckets, but a replica of {k} workers shards the "
                            f"model (FSDP2); use --hook {', '.join(SHARDED_HOOKS)} (optionally --wrap fp16|bf16), "
                            f"or --replica-size 1")


def _check_ignored_options(cfg: RunConfig) -> None:
    """Options that would do nothing in this run: say so instead of ignoring them."""
    given = lambda key: cfg.sources.get(key, "default") != "default"  # noqa: E731
    if cfg.no_python and cfg.hook is not None:
        raise _fail("hook", f"--hook {cfg.hook.name} does nothing with --no-python: hooks are put into the DDP "
                            f"model by ftrun's Python bootstrap; run a Python script, or drop --hook")
    if cfg.no_python and cfg.step_timeout:
        raise _fail("step_timeout", "--step-timeout does nothing with --no-python: optimizer steps are counted by "
                                    "ftrun's Python bootstrap; run a Python script, or drop --step-timeout")
    if given("replica_size") and not cfg.ft:
        raise _fail("replica_size", f"--replica-size {cfg.replica_size} applies only to --ft runs (a replica is a "
                                    f"unit that fails, restarts and heals alone); add --ft, or drop --replica-size")
    if given("checkpoint_dir") and not cfg.ft:
        raise _fail("checkpoint_dir", f"--checkpoint-dir {cfg.checkpoint_dir} applies only to --ft runs (it keeps "
                                      f"the replicas' state when every replica is lost); add --ft, or drop "
                                      f"--checkpoint-dir")
    for key in ("checkpoint_every", "checkpoint_keep"):
        if given(key) and not cfg.checkpoint_dir:
            flag = "--" + key.replace("_", "-")
            raise _fail(key, f"{flag} {getattr(cfg, key)} does nothing without --checkpoint-dir DIR; add it, or "
                             f"drop {flag}")
    if cfg.checkpoint_dir is not None and not cfg.checkpoint_dir.strip():
        raise _fail("checkpoint_dir", "--checkpoint-dir is empty; give a folder")
    if given("min_replicas") and not cfg.ft:
        raise _fail("min_replicas", f"--min-replicas {cfg.min_replicas} applies only to --ft runs; add --ft, or "
                                    f"drop --min-replicas")
    if cfg.quiet and cfg.verbose and cfg.sources.get("verbose") != "FTRUN_VERBOSE":  # the variable: --quiet wins
        raise _fail("verbose", "--verbose adds ftrun's per-rank lines to the workers' console output, but --quiet "
                               "shows none of it; drop one of them")
    if cfg.quiet:
        for key, flag in (("ranks", "--ranks"), ("local_ranks_filter", "--local-ranks-filter"), ("tee", "--tee")):
            if given(key) and getattr(cfg, key):
                raise _fail(key, f"{flag} picks workers' console output, but --quiet shows none; drop one of them")
    for key, flag in (("redirects", "--redirects"), ("tee", "--tee")):
        bad = sorted(r for r in getattr(cfg, key) if r >= cfg.nproc)
        if bad:
            raise _fail(key, f"{flag} names local rank {','.join(map(str, bad))}, which this node does not have; "
                             f"it has local ranks 0..{cfg.nproc - 1}")


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
            raise _fail("script", f"-m {cfg.script}: {problem}")
        if origin and origin.endswith(".py"):
            _check_compiles(origin, f"-m {cfg.script}")
        return
    if cfg.no_python:
        import shutil

        if shutil.which(cfg.script) is None and not os.access(cfg.script, os.X_OK):
            raise _fail("script", f"--no-python {cfg.script}: not an executable file or a command on PATH")
        return
    p = Path(cfg.script)
    try:
        is_dir = p.is_dir()
        exists = is_dir or p.exists()
    except OSError as e:  # a name too long for the file system, a loop of links
        raise _fail("script", f"script {cfg.script[:80]!r}: {e.strerror or e}; check the path") from None
    if not exists:
        raise _fail("script", f"script {cfg.script!r} not found; check the path (relative to {os.getcwd()})")
    if is_dir:
        raise _fail("script", f"script {cfg.script!r} is a folder; give the .py file (or -m for a package)")
    _check_compiles(cfg.script, "script")


def _check_compiles(path: str, what: str) -> None:
    # compile() only: nothing of the script runs in the launcher.
    try:
        source = Path(path).read_bytes()
    except OSError as e:
        raise _fail("script", f"{what} {path}: cannot be read ({e.strerror or e})") from None
    if b"\0" in source:  # a binary: Python would refuse it in every worker
        raise _fail("script", f"{what} {path} is not Python source (it holds null bytes); run an executable "
                              f"with --no-python")
    try:
        compile(source, path, "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as e:
        line = getattr(e, "lineno", None) or 1
        msg = getattr(e, "msg", None) or str(e)
        raise _fail("script", f"{getattr(e, 'filename', None) or path}:{line}: {type(e).__name__}: {msg}; fix "
                              f"the script (every worker would fail at start, on every restart)") from None


def max_workers() -> Tuple[int, str]:
    """How many workers this machine can run, and the rule that sets it."""
    import psutil

    cpus = cpu_count()
    limits = [(WORKERS_PER_CPU * cpus, f"{WORKERS_PER_CPU} per usable CPU core, {cpus} here")]
    avail = psutil.virtual_memory().available
    limits.append((int(avail // WORKER_MEMORY_BYTES),
                   f"{WORKER_MEMORY_BYTES >> 20} MiB each, {avail / (1 << 30):.1f} GiB of memory available"))
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    # RLIMIT_NPROC does not bind root; unlimited needs no count.
    if os.geteuid() != 0 and soft != resource.RLIM_INFINITY:
        uid = os.getuid()
        mine = sum(1 for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real == uid)
        # the supervisor and its zygote count too
        limits.append((max(0, soft - mine - 2), f"ulimit -u {soft}, {mine} processes of yours running"))
    return min(limits)


def _check_nproc_fits(cfg: RunConfig) -> None:
    limit, why = max_workers()
    if cfg.nproc > limit:
        raise _fail("nproc", f"--nproc {cfg.nproc} is more workers than this machine can run: at most {limit} "
                             f"({why}); lower --nproc")


def folder_problem(path: str) -> Optional[str]:
    """Why ftrun could not create and write folder `path`, or None. Looks only; creates nothing."""
    target = os.path.abspath(path)
    if any(len(part.encode()) > 255 for part in target.split(os.sep)):
        return "has a name longer than 255 bytes, which no Linux file system takes"
    p = target
    while True:
        try:
            st = os.stat(p)
        except (FileNotFoundError, NotADirectoryError):
            parent = os.path.dirname(p)
            if parent == p:
                return "cannot be created"
            p = parent
            continue
        except OSError as e:
            return f"cannot be used ({e.strerror or e})"
        break
    if not stat.S_ISDIR(st.st_mode):
        return "is a file, not a folder" if p == target else f"cannot be created: {p} is a file"
    if not os.access(p, os.W_OK | os.X_OK):
        err = "read-only file system" if _read_only(p) else "no permission"
        return (f"is not writable ({err})" if p == target else f"cannot be created in {p} ({err})")
    return None


def _read_only(path: str) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


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
            raise _fail("log_dir", f"--log-dir {cfg.log_dir} {problem}; give a folder you can write")
    if cfg.checkpoint_dir:
        problem = folder_problem(cfg.checkpoint_dir)
        if problem:
            raise _fail("checkpoint_dir", f"--checkpoint-dir {cfg.checkpoint_dir} {problem}; give a folder you can "
                                          f"write")


def _check_no_live_twin(cfg: RunConfig) -> None:
    """Two live runs with one run id would share their state file and logs: refuse the second."""
    from ftrun.status.state import live_supervisor, run_folder_name, runs_root

    folder = runs_root() / run_folder_name(cfg.run_id, cfg.nnodes, cfg.node_rank)
    pid = live_supervisor(folder / "state.json")
    if pid is not None and pid != os.getpid():
        raise _fail("run_id", f"--run-id {cfg.run_id}: a run of that name is already running here (supervisor pid "
                              f"{pid}); give another --run-id, or stop that run first")


def is_local_address(host: str) -> Optional[bool]:
    """True if `host` resolves to an address of this machine (loopback, any, or one of its interfaces),
    False if it resolves elsewhere, None if it does not resolve."""
    import ipaddress

    import psutil

    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError, OSError):
        return None
    mine = {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs
            if a.family in (socket.AF_INET, socket.AF_INET6)}
    for family, _, _, _, sockaddr in infos:
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        addr = str(sockaddr[0]).split("%")[0]
        ip = ipaddress.ip_address(addr)
        if ip.is_loopback or ip.is_unspecified or addr in mine:
            return True
    return False


def _from(source: str) -> str:
    """' (from PET_MASTER_ADDR)' for a value that did not come from the command line."""
    return "" if source in (CLI, "default") else f" (from {source})"


def _check_master_addr_is_here(host: str, flag: str, source: str) -> None:
    """One node hosts its own store: an address elsewhere would leave the workers waiting for minutes."""
    key = "rdzv_endpoint" if flag == "--rdzv-endpoint" else "master_addr"
    here = is_local_address(host)
    if here is None:
        raise _fail(key, f"{flag} {host}{_from(source)} does not resolve on this machine; this is a one-node run, "
                         f"whose store runs here: drop {flag}, or give --nnodes N for several machines")
    if not here:
        raise _fail(key, f"{flag} {host}{_from(source)} is not an address of this machine, but this is a one-node "
                         f"run, whose store runs here; drop {flag} (or give this machine's address), or give "
                         f"--nnodes N for several machines")
