"""A worker's settings: the environment ftrun (and torchrun's contract) gives it, read once.

`load()` builds the frozen `Settings` from torchrun's variables and the
FTRUN_* ones (ftrun/envvars.py lists them all) at the worker's start: the
bootstrap calls it before the user's script runs, after a zygote's fork took
the worker's own environment. `current()` is that object; in a process that
never ran the bootstrap (an in-process test, a benchmark) it is read afresh
at each call, so such a process sees the environment it set.

Not in it: where the run's store is after the start. It may move (a lost
node's store, ftrun/worker/ft/member/moves.py), which tells `store_moved()`;
whatever connects to it later asks `run_store()`. The environment keeps what
the worker was started with, as torchrun's does.
Values are parsed as their readers always parsed them: a malformed value a
reader tolerated is tolerated here too (FTRUN_FT_TIMEOUT), and a checkpoint
setting is parsed only with --checkpoint-dir.
Must never write the environment, never import torch, and never import the
supervisor.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Tuple

from ftrun.keys import relayed_node


@dataclass(frozen=True)
class CheckpointSettings:
    """--checkpoint-dir, --checkpoint-every, --checkpoint-keep."""

    root: Path
    every: int
    keep: int

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Optional["CheckpointSettings"]:
        root = env.get("FTRUN_CHECKPOINT_DIR")
        if not root:
            return None
        return cls(Path(root), max(1, int(env.get("FTRUN_CHECKPOINT_EVERY", "500"))),
                   max(1, int(env.get("FTRUN_CHECKPOINT_KEEP", "2"))))


@dataclass(frozen=True)
class Settings:
    # torchrun's contract
    rank: Optional[int]                 # RANK (None: unset, e.g. outside a worker)
    local_rank: int                     # LOCAL_RANK
    world_size: Optional[int]           # WORLD_SIZE
    local_world_size: Optional[int]     # LOCAL_WORLD_SIZE
    restart_count: int                  # TORCHELASTIC_RESTART_COUNT: this worker's incarnation
    error_file: str                     # TORCHELASTIC_ERROR_FILE: where a failure is recorded ("" when unset)
    # ftrun's own
    run_id: str                         # FTRUN_RUN_ID
    store: str                          # FTRUN_STORE at the start (it may move later: run_store())
    ft: bool                            # FTRUN_FT == "1"
    hook: str                           # FTRUN_HOOK: the --hook spec as JSON, "" without --hook
    replica_size: int                   # FTRUN_REPLICA_SIZE: workers per replica, at least 1 (1 when unset)
    spares: int                         # FTRUN_SPARES: replicas held back as hot spares (--spares), 0 when unset
    step_timeout: bool                  # FTRUN_STEP_TIMEOUT is set: count progress that is not a step
    stacks_file: str                    # FTRUN_STACKS_FILE
    relayed: Optional[Tuple[int, int, int, str]]  # FTRUN_NODE_RANKS and FTRUN_NODE_STORE (keys.relayed_node)
    checkpoint: Optional[CheckpointSettings]
    ft_timeout_s: float                 # FTRUN_FT_TIMEOUT, within 0.5..3600 s (else 10)
    hook_log_every: int                 # FTRUN_HOOK_LOG_EVERY (0: only at exit)
    gloo_interfaces: Tuple[str, ...]    # GLOO_SOCKET_IFNAME, split at commas (torch's gloo reads it too)
    # fault injection and knobs for the tests
    checkpoint_inject_delay: str        # FTRUN_CHECKPOINT_INJECT_DELAY, "STEP:SECONDS"
    # a fresh DCP stager for every save, as on a torch whose stager stages only once
    checkpoint_fresh_stager: bool       # FTRUN_CHECKPOINT_FRESH_STAGER
    # benchmarks: "0" leaves out the checksums a save writes (the CRCs of torch's records, off in the
    # writer thread's saves, and the CRC of .metadata) and the checks at load; "alternate" leaves them
    # out of every other save (where step // every is even), to measure in one run what they cost
    checkpoint_verify: str              # FTRUN_CHECKPOINT_VERIFY: "1", "0" or "alternate"
    inject_progress_fail: str           # FTRUN_INJECT_PROGRESS_FAIL, "START:COUNT"
    inject_store: str                   # FTRUN_FT_INJECT_STORE, "RANK:INCARNATION=HOST:PORT"

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "Settings":
        return cls(
            rank=_int_or_none(env.get("RANK")),
            local_rank=_int_or_none(env.get("LOCAL_RANK")) or 0,
            world_size=_int_or_none(env.get("WORLD_SIZE")),
            local_world_size=_int_or_none(env.get("LOCAL_WORLD_SIZE")),
            restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT") or "0"),
            error_file=env.get("TORCHELASTIC_ERROR_FILE", ""),
            run_id=env.get("FTRUN_RUN_ID", ""),
            store=env.get("FTRUN_STORE", ""),
            ft=env.get("FTRUN_FT") == "1",
            hook=env.get("FTRUN_HOOK", ""),
            replica_size=max(1, _int_or_none(env.get("FTRUN_REPLICA_SIZE")) or 1),
            spares=_int_or_none(env.get("FTRUN_SPARES")) or 0,
            step_timeout=bool(env.get("FTRUN_STEP_TIMEOUT")),
            stacks_file=env.get("FTRUN_STACKS_FILE", ""),
            relayed=relayed_node(env),
            checkpoint=CheckpointSettings.from_env(env),
            ft_timeout_s=_ft_timeout(env.get("FTRUN_FT_TIMEOUT", "10")),
            hook_log_every=_log_every(env.get("FTRUN_HOOK_LOG_EVERY", "100")),
            gloo_interfaces=tuple(n for n in env.get("GLOO_SOCKET_IFNAME", "").split(",") if n),
            checkpoint_inject_delay=env.get("FTRUN_CHECKPOINT_INJECT_DELAY", ""),
            checkpoint_fresh_stager=bool(env.get("FTRUN_CHECKPOINT_FRESH_STAGER")),
            checkpoint_verify=env.get("FTRUN_CHECKPOINT_VERIFY", "1"),
            inject_progress_fail=env.get("FTRUN_INJECT_PROGRESS_FAIL", ""),
            inject_store=env.get("FTRUN_FT_INJECT_STORE", ""),
        )

    @property
    def rank_text(self) -> str:
        """The rank for a line of text ("?" when unknown)."""
        return "?" if self.rank is None else str(self.rank)


def _int_or_none(raw: Optional[str]) -> Optional[int]:
    try:
        return int(raw) if raw else None
    except ValueError:
        return None


def _log_every(raw: str) -> int:
    try:
        return int(raw or 0)
    except ValueError:  # a user's setting: a typo must not stop every worker
        return 100


def _ft_timeout(raw: str) -> float:
    try:
        seconds = float(raw)
    except ValueError:
        return 10.0
    return seconds if 0.5 <= seconds <= 3600 else 10.0  # nan fails both tests


_loaded: Optional[Settings] = None


def load() -> Settings:
    """Read the environment into the worker's settings (the bootstrap, at the worker's start)."""
    global _loaded
    _loaded = Settings.from_env()
    return _loaded


def current() -> Settings:
    """The worker's settings: those `load()` read, else the environment as it is now."""
    return _loaded if _loaded is not None else Settings.from_env()


_moved_to: Optional[str] = None  # where the run's store moved to, once it has


def run_store() -> str:
    """host:port of the run's store now (it may have moved since the start; see the docstring)."""
    s = current()
    return _moved_to or _injected_store(s) or s.store


def _injected_store(s: Settings) -> Optional[str]:
    """FTRUN_FT_INJECT_STORE for this worker's incarnation: until it follows a move, it takes that
    store for the run's, as a worker whose connection reached another store at the run's address."""
    who, _, addr = s.inject_store.partition("=")
    return addr if addr and who == f"{s.rank}:{s.restart_count}" else None


def store_moved(addr: str) -> None:
    """The run's store is at `addr` from now on (this process followed it there)."""
    global _moved_to
    _moved_to = addr
