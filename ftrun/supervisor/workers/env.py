"""The environment of each worker: torchrun's variables plus ftrun's own.

Values match what torchrun gives for the same layout, so torchrun scripts,
Lightning and Accelerate run unmodified (a test compares the two).
Must never start anything, create anything or import torch (`ftrun --dry-run` shows
what these functions return without starting a run).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Dict, Mapping, Union

from ftrun.config import RunConfig


def common_env(cfg: RunConfig, store_addr: str, store_port: Union[int, str],
               base: Mapping[str, str]) -> Dict[str, str]:
    """Variables every worker of this node shares (also the zygote's environment); a dry run gives
    a text for a port that only the store's start will pick."""
    env = dict(base)
    env.update(cfg.env)
    env.update({
        "WORLD_SIZE": str(cfg.world_size),
        "LOCAL_WORLD_SIZE": str(cfg.nproc),
        "GROUP_RANK": str(cfg.node_rank),
        "GROUP_WORLD_SIZE": str(cfg.nnodes),
        "ROLE_NAME": cfg.role,
        "ROLE_WORLD_SIZE": str(cfg.world_size),
        "MASTER_ADDR": cfg.workers_master_addr or store_addr,
        "MASTER_PORT": str(store_port),
        "TORCHELASTIC_MAX_RESTARTS": str(cfg.max_restarts if cfg.total_restarts is None else cfg.total_restarts),
        "TORCHELASTIC_RUN_ID": cfg.elastic_run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_SIGNALS_TO_HANDLE": ",".join(cfg.signals_to_handle),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": base.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "FTRUN_RUN_ID": cfg.run_id,
        "FTRUN_STORE": f"{store_addr}:{store_port}",
        "FTRUN_FT": "1" if cfg.ft else "0",
        "FTRUN_HOOK": cfg.hook.to_json() if cfg.hook else "",
        "FTRUN_REPLICA_SIZE": str(cfg.replica_size),
    })
    if cfg.spares:  # the replicas that train: WORLD_SIZE // FTRUN_REPLICA_SIZE - FTRUN_SPARES
        env["FTRUN_SPARES"] = str(cfg.spares)
    if cfg.checkpoint_dir:
        # Absolute: a worker (or a script) may change its directory before the first save.
        env["FTRUN_CHECKPOINT_DIR"] = os.path.abspath(cfg.checkpoint_dir)
        env["FTRUN_CHECKPOINT_EVERY"] = str(cfg.checkpoint_every)
        env["FTRUN_CHECKPOINT_KEEP"] = str(cfg.checkpoint_keep)
    # A pod's RANK/WORLD_SIZE/... describe the node, not a worker: every torchrun variable is ours.
    if cfg.step_timeout:
        env["FTRUN_STEP_TIMEOUT"] = str(cfg.step_timeout)
    env.update(_threads(cfg, base))
    return env


def _threads(cfg: RunConfig, base: Mapping[str, str]) -> Dict[str, str]:
    """torchrun's rule: one thread per worker unless the user chose otherwise."""
    if "OMP_NUM_THREADS" not in base and "OMP_NUM_THREADS" not in cfg.env and cfg.nproc > 1:
        return {"OMP_NUM_THREADS": "1"}
    return {}


# The frameworks a zygote imports for an --ft script that uses them: a restarted replica would
# otherwise import one again after its fork (Lightning: about 1.3 s of its 2.2-2.6 s back).
# Lightning's two packages: one alone, since which one FTStrategy extends is told by the one the
# script imported (ftrun.worker.frameworks.lightning), and a file naming both may run either.
LIGHTNING = ("lightning", "pytorch_lightning")
TRAINER = "transformers.trainer"  # the Trainer, which `import transformers` alone leaves unloaded
# The drop-ins' frameworks (ftrun.accelerate, ftrun.fabric) and Accelerate itself: what each needs imported.
DROP_INS = {"accelerate": "accelerate.accelerator", "ftrun.accelerate": "accelerate.accelerator",
            "ftrun.fabric": "lightning.fabric"}


def zygote_env(cfg: RunConfig, common: Mapping[str, str]) -> Dict[str, str]:
    """The zygote's own environment: the workers' common one, plus (--ft) the frameworks the script
    imports anywhere in its file, for the zygote to import before its first fork. Never a
    worker's (each spawn request carries the worker's whole environment)."""
    env = dict(common)
    if cfg.ft and not cfg.module:
        found = _imported(cfg.script)
        names = [p for p in LIGHTNING if p in found] if len(found & set(LIGHTNING)) == 1 else []
        if "transformers" in found:
            names.append(TRAINER)
        for module, name in DROP_INS.items():
            if module in found and name not in names and not (name.startswith("lightning") and "lightning" in names):
                names.append(name)
        if names:
            env["FTRUN_ZYGOTE_PREIMPORT"] = ",".join(names)
    return env


def _imported(script: str) -> set:
    """The top-level packages a script's file imports, and the modules it names (empty when it
    cannot be read or parsed)."""
    import ast

    try:
        tree = ast.parse(Path(script).read_text(errors="replace"))
    except (OSError, SyntaxError, ValueError):
        return set()
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.update((node.module.split(".")[0], node.module))
    return names


def import_env(cfg: RunConfig) -> Dict[str, str]:
    """The environment torch is imported under for the zygote (ftrun.worker.zygote.fork_waiting):
    what OpenMP, OpenBLAS and torch read as they load must be the workers' own setting."""
    env = base_env()
    env.update(cfg.env)
    env.update(_threads(cfg, base_env()))
    env["FTRUN_RUN_ID"] = cfg.run_id
    return env


def worker_env(common: Mapping[str, str], cfg: RunConfig, local_rank: int, restart_count: int) -> Dict[str, str]:
    """The full environment of one worker incarnation."""
    rank = cfg.node_rank * cfg.nproc + local_rank
    env = dict(common)
    env.update({
        # Where torch.distributed.elastic's @record writes a worker's error, as under torchrun.
        "TORCHELASTIC_ERROR_FILE": str(error_file(cfg, rank)),
        # Where a hung worker's Python stacks go when ftrun asks for them: its log folder, not the console.
        "FTRUN_STACKS_FILE": str(stacks_file(cfg, rank)),
        "RANK": str(rank),
        "LOCAL_RANK": "0" if cfg.virtual_local_rank else str(local_rank),
        "ROLE_RANK": str(rank),
        "TORCHELASTIC_RESTART_COUNT": str(restart_count + cfg.round),
        # --ft: replica j is the workers of global ranks jK .. jK+K-1 (K = --replica-size).
        "FTRUN_REPLICA_ID": str(rank // cfg.replica_size),
    })
    if cfg.virtual_local_rank:
        # torchrun's virtual local rank: each worker sees only its own device, as device 0.
        devices = [d.strip() for d in common.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        env["CUDA_VISIBLE_DEVICES"] = devices[local_rank] if local_rank < len(devices) else str(local_rank)
    return env


def log_dir(cfg: RunConfig) -> Path:
    """The folder of the run's per-rank logs (the supervisor creates and writes it; workers' error files go
    there too)."""
    from ftrun.status.state import run_folder_name, runs_root

    if cfg.log_dir:
        return Path(cfg.log_dir)
    return runs_root() / run_folder_name(cfg.run_id, cfg.nnodes, cfg.node_rank) / "logs"


def error_file(cfg: RunConfig, rank: int) -> Path:
    """TORCHELASTIC_ERROR_FILE: a worker's uncaught exception, as torch's @record writes it
    (ftrun.wire.WorkerError; ftrun's bootstrap writes it too when the script does not)."""
    return log_dir(cfg) / f"rank{rank}" / "error.json"


def stacks_file(cfg: RunConfig, rank: int) -> Path:
    """The file a worker dumps its Python stacks into when ftrun finds it hung."""
    return log_dir(cfg) / f"rank{rank}" / "stacks.log"


# The user's environment as ftrun found it: what the supervisor sets for itself afterwards
# (quiet_torch_warnings) must never reach a worker.
_USER_ENV = dict(os.environ)


def base_env() -> Dict[str, str]:
    return dict(_USER_ENV)


def quiet_torch_warnings() -> None:
    """The supervisor's own torch (its store client and server) logs C++ warnings with stack
    frames when a peer goes away; ftrun says that in one line. Errors still show. Only this
    process: base_env() is the environment from before, and the user's own setting wins."""
    if "TORCH_CPP_LOG_LEVEL" in os.environ:
        return
    os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"  # read when torch loads, if it loads later
    if "torch" in sys.modules:  # loaded already (the zygote's import, start_zygote_early): set the level it read
        set_cpp_log_level_error()


def set_cpp_log_level_error() -> None:
    level = _cpp_log_level()
    if level is not None:
        level.value = 2  # c10's ERROR, what TORCH_CPP_LOG_LEVEL=ERROR sets as torch loads


def _cpp_log_level() -> Any:
    """c10's log level, the int TORCH_CPP_LOG_LEVEL sets as torch loads (torch has no call that
    sets it later); None where this torch's libc10 does not export it."""
    import ctypes
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        lib = os.path.join(folder, "lib", "libc10.so")
        try:
            return ctypes.c_int.in_dll(ctypes.CDLL(lib), "FLAGS_caffe2_log_level")
        except (OSError, ValueError):
            continue
    return None
