"""RunConfig: everything a run needs, from a recipe and the command line, validated.

The CLI hands over only the options the user actually typed; a recipe (YAML)
supplies the rest; defaults fill the gaps. Every check that can be made before
a worker starts is made here and reported as one ConfigError line.
This module must never import torch (the CLI and `ftrun validate` use it).
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import secrets
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple

from ftrun.errors import ConfigError
from ftrun.hookspec import HookSpec, parse_hook


@dataclass(frozen=True)
class Option:
    """One run option as a recipe key: its type, bounds and one-line help."""

    key: str
    kind: type
    default: Any
    help: str
    minimum: Optional[float] = None


# The recipe keys, which are also RunConfig's fields. `hook`, `env`, `script`
# and `args` are structured and checked by their own code below.
OPTIONS: Dict[str, Option] = {
    o.key: o
    for o in (
        Option("nproc", int, 1, "workers on this node (or 'auto')", 1),
        Option("max_restarts", int, None, "restart budget (per replica with ft, per group without)", 0),
        Option("ft", bool, False, "replica fault tolerance: only the failed replica restarts"),
        Option("min_replicas", int, 1, "with ft: fewest live replicas that keep training", 1),
        Option("step_timeout", float, None, "seconds without an optimizer step before a replica is hung", 0),
        Option("shutdown_timeout", float, 5.0, "grace between SIGTERM and SIGKILL, seconds", 0),
        Option("log_dir", str, None, "folder for per-rank log files"),
        Option("quiet", bool, False, "print only the supervisor's own lines"),
        Option("ranks", str, None, "ranks whose lines go to the console, e.g. '0,1'"),
        Option("module", bool, False, "run the script as a module (python -m)"),
        Option("no_python", bool, False, "run the script as an executable, not with python"),
        Option("nnodes", int, 1, "number of machines", 1),
        Option("node_rank", int, 0, "this machine's rank among nnodes", 0),
        Option("master_addr", str, "127.0.0.1", "address of node 0 (hosts the run's store)"),
        Option("master_port", int, None, "port of the run's store (default: a free one)", 1),
        Option("join_timeout", float, 120.0, "seconds to wait for every node to join", 0),
        Option("run_id", str, None, "name of the run"),
        Option("hook", dict, None, "DDP communication hook: {name: ..., <params>, wrap: ...}"),
        Option("env", dict, None, "extra environment variables for the workers"),
        Option("script", str, None, "training script (CLI SCRIPT wins)"),
        Option("args", list, None, "script arguments (CLI arguments win)"),
        Option("description", str, None, "one line saying what the recipe is for"),
    )
}

DEFAULT_MAX_RESTARTS = 0
DEFAULT_MAX_RESTARTS_FT = 3


@dataclass
class RunConfig:
    """A validated run. Built only by build_config()."""

    script: str
    script_args: Tuple[str, ...] = ()
    module: bool = False
    no_python: bool = False
    nproc: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: Optional[int] = None
    join_timeout: float = 120.0
    max_restarts: int = DEFAULT_MAX_RESTARTS
    ft: bool = False
    min_replicas: int = 1
    hook: Optional[HookSpec] = None
    step_timeout: Optional[float] = None
    shutdown_timeout: float = 5.0
    log_dir: Optional[str] = None
    quiet: bool = False
    ranks: Optional[Tuple[int, ...]] = None
    run_id: str = ""
    env: Dict[str, str] = field(default_factory=dict)
    recipe: Optional[str] = None

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes


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


def parse_nproc(value: Any, where: str) -> int:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return visible_device_count() or (os.cpu_count() or 1)
    if isinstance(value, bool):
        raise ConfigError(f"{where}: nproc must be a whole number >= 1 or 'auto', not {value!r}")
    try:
        n = int(value)
        if str(n) != str(value).strip() and not isinstance(value, int):
            raise ValueError
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: --nproc must be a whole number >= 1 or 'auto', not {value!r}") from None
    if n < 1:
        raise ConfigError(f"{where}: --nproc must be at least 1, not {n}")
    return n


def parse_ranks(value: Any, where: str) -> Optional[Tuple[int, ...]]:
    if value is None:
        return None
    items = value if isinstance(value, (list, tuple)) else str(value).split(",")
    try:
        ranks = tuple(sorted({int(str(r).strip()) for r in items if str(r).strip()}))
    except ValueError:
        raise ConfigError(f"{where}: --ranks takes a comma-separated list of ranks such as 0,1, not {value!r}") from None
    if any(r < 0 for r in ranks):
        raise ConfigError(f"{where}: --ranks must list ranks >= 0, not {value!r}")
    return ranks


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


def _check_number(key: str, value: Any, where: str) -> Any:
    opt = OPTIONS[key]
    flag = "--" + key.replace("_", "-")
    if opt.kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: {key} must be true or false, not {value!r}")
        return value
    if opt.kind in (int, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (opt.kind is int and isinstance(value, float)):
            kind = "a whole number" if opt.kind is int else "a number"
            raise ConfigError(f"{where}: {flag} must be {kind}, not {value!r}")
        if opt.minimum is not None and value < opt.minimum:
            raise ConfigError(f"{where}: {flag} must be >= {opt.minimum:g}, not {value}")
        return opt.kind(value)
    if opt.kind is str:
        if not isinstance(value, (str, int)) or isinstance(value, bool):
            raise ConfigError(f"{where}: {key} must be a string, not {value!r}")
        return str(value)
    return value


def build_config(cli: Mapping[str, Any], recipe: Optional[Mapping[str, Any]] = None,
                 recipe_name: Optional[str] = None, check_paths: bool = True) -> RunConfig:
    """Merge recipe values under CLI values (key by key) and validate the result.

    `cli` holds only options the user typed (plus `script`/`args` when given);
    `recipe` is an already-loaded recipe mapping (ftrun.recipe checks its
    shape and types with line numbers before this is called).
    """
    recipe = dict(recipe or {})
    where_cli = "command line"
    where_recipe = recipe_name or "recipe"

    slurm = _slurm_layout(cli, recipe)

    def pick(key: str) -> Tuple[Any, str]:
        if key in cli and cli[key] is not None:
            return cli[key], where_cli
        if key in recipe and recipe[key] is not None:
            return recipe[key], where_recipe
        if key in slurm:
            return slurm[key], "Slurm (SLURM_* variables)"
        return None, "default"

    cfg_kwargs: Dict[str, Any] = {}

    # The script: CLI wins; a recipe may carry one (with args) for `ftrun --recipe X`.
    script, _ = pick("script")
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
    cfg_kwargs["script"] = str(script)
    cfg_kwargs["script_args"] = args

    nproc, where = pick("nproc")
    cfg_kwargs["nproc"] = parse_nproc(1 if nproc is None else nproc, where)

    for key in ("max_restarts", "min_replicas", "step_timeout", "shutdown_timeout", "nnodes", "node_rank",
                "master_port", "join_timeout", "ft", "quiet", "module", "no_python"):
        value, where = pick(key)
        if value is not None:
            cfg_kwargs[key] = _check_number(key, value, where)

    for key in ("log_dir", "master_addr", "run_id"):
        value, where = pick(key)
        if value is not None:
            cfg_kwargs[key] = _check_number(key, value, where)

    value, where = pick("ranks")
    cfg_kwargs["ranks"] = parse_ranks(value, where)

    # Hook: CLI parameters override the recipe's, key by key.
    hook_raw: Dict[str, Any] = dict(recipe.get("hook") or {})
    hook_cli = dict(cli.get("hook") or {})
    if hook_cli.get("name") and hook_raw.get("name") and hook_cli["name"] != hook_raw["name"]:
        hook_raw = {}  # a different hook on the command line replaces the recipe's whole hook
    hook_raw.update(hook_cli)
    if hook_raw:
        where = where_cli if hook_cli else where_recipe
        if "name" not in hook_raw:
            flags = ", ".join("--" + k.replace("_", "-") for k in hook_raw)
            raise ConfigError(f"{where}: {flags} given without a hook; add --hook NAME (e.g. --hook powersgd)")
        cfg_kwargs["hook"] = parse_hook(hook_raw, where)

    env = {str(k): str(v) for k, v in (recipe.get("env") or {}).items()}
    env.update({str(k): str(v) for k, v in (cli.get("env") or {}).items()})
    cfg_kwargs["env"] = env

    if cfg_kwargs.get("max_restarts") is None:
        cfg_kwargs["max_restarts"] = DEFAULT_MAX_RESTARTS_FT if cfg_kwargs.get("ft") else DEFAULT_MAX_RESTARTS
    if not cfg_kwargs.get("run_id") and cfg_kwargs.get("nnodes", 1) > 1 and cfg_kwargs.get("master_port"):
        # Every node must give its workers the same TORCHELASTIC_RUN_ID, and a
        # random id would differ per node: derive it from what they share.
        cfg_kwargs["run_id"] = f"ftrun-port{cfg_kwargs['master_port']}"
    cfg_kwargs["run_id"] = cfg_kwargs.get("run_id") or os.environ.get("FTRUN_RUN_ID_DEFAULT") or new_run_id()
    cfg_kwargs["recipe"] = recipe_name
    cfg = RunConfig(**cfg_kwargs)
    validate(cfg, check_paths=check_paths)
    return cfg


def validate(cfg: RunConfig, check_paths: bool = True) -> None:
    """Checks that need the whole config, or the machine (files, ports)."""
    if cfg.module and cfg.no_python:
        raise ConfigError("-m/--module and --no-python cannot be used together; pick one")
    if not cfg.run_id.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise ConfigError(f"--run-id {cfg.run_id!r}: use letters, digits, '-', '_' and '.' only")
    if cfg.node_rank >= cfg.nnodes:
        raise ConfigError(f"--node-rank {cfg.node_rank} is out of range for --nnodes {cfg.nnodes}; use 0..{cfg.nnodes - 1}")
    if cfg.nnodes > 1 and cfg.master_port is None:
        raise ConfigError(f"--nnodes {cfg.nnodes} needs --master-port: the same port on every node, where node 0's "
                          f"ftrun hosts the run's store (e.g. --master-port 29500)")
    if cfg.master_port is not None and cfg.master_port > 65535:
        raise ConfigError(f"--master-port {cfg.master_port} is not a TCP port; use 1..65535")
    if cfg.nnodes > 1 and not cfg.master_addr.strip():
        raise ConfigError("--master-addr is empty; give node 0's address (the same on every node)")
    if cfg.ranks is not None:
        bad = [r for r in cfg.ranks if r >= cfg.world_size]
        if bad:
            raise ConfigError(f"--ranks {','.join(map(str, bad))}: no such rank; this run has ranks 0..{cfg.world_size - 1}")
    if cfg.ft and cfg.min_replicas > cfg.world_size:
        raise ConfigError(f"--min-replicas {cfg.min_replicas} exceeds the {cfg.world_size} replicas of this run; lower it")
    if not check_paths:
        return
    if cfg.module:
        try:
            found = importlib.util.find_spec(cfg.script)
        except (ImportError, ValueError):
            found = None
        if found is None:
            raise ConfigError(f"-m {cfg.script}: no module named {cfg.script!r} on the Python path; check the name or install it")
    elif cfg.no_python:
        import shutil

        if shutil.which(cfg.script) is None and not os.access(cfg.script, os.X_OK):
            raise ConfigError(f"--no-python {cfg.script}: not an executable file or a command on PATH")
    else:
        p = Path(cfg.script)
        if not p.exists():
            raise ConfigError(f"script {cfg.script!r} not found; check the path (relative to {os.getcwd()})")
        if p.is_dir():
            raise ConfigError(f"script {cfg.script!r} is a folder; give the .py file (or -m for a package)")
    if cfg.nnodes > 1:
        try:
            socket.getaddrinfo(cfg.master_addr, cfg.master_port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as e:
            raise ConfigError(f"--master-addr {cfg.master_addr!r}: cannot resolve it on this machine ({e.strerror or e}); "
                              f"give node 0's address or host name") from None
    if cfg.master_port is not None and cfg.node_rank == 0 and not port_is_free(store_listen_addr(cfg), cfg.master_port):
        raise ConfigError(f"--master-port {cfg.master_port} is already in use; pick another or leave it out for a free one")


def store_listen_addr(cfg: RunConfig) -> str:
    """Where node 0's store listens: loopback for one node; master_addr's interface for several."""
    if cfg.nnodes == 1:
        return "127.0.0.1"
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


def _slurm_layout(cli: Mapping[str, Any], recipe: Mapping[str, Any]) -> Dict[str, Any]:
    """Layout defaults from SLURM_* variables, for the keys the user did not give.

    An explicit nnodes of 1 means a one-node run even inside an allocation,
    and a one-node Slurm step stays a plain local run (loopback store)."""
    from ftrun.slurm import SlurmError, layout_from_env

    given = cli.get("nnodes") if cli.get("nnodes") is not None else recipe.get("nnodes")
    if given == 1:
        return {}
    try:
        layout = layout_from_env()
    except SlurmError as e:
        raise ConfigError(f"Slurm: {e}") from None
    if layout.get("nnodes", 1) == 1 and given is None:
        return {}
    return layout
