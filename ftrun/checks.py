"""The checks of bad input that need the whole config: values that clash across options, options
that would do nothing in this run, and ftrun's own environment variables.

validate() runs them on a built RunConfig, then (unless told not to look at the
machine) ftrun.preflight's checks. Each raises one ConfigError naming the problem
and the fix, blamed on the option it is about.
This module must never import torch, and never look at the machine (files, ports,
addresses, processes: that is ftrun.preflight), write, start or run anything.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Mapping, Optional, Tuple

from ftrun.errors import CLI, ConfigError, blame, from_source
from ftrun.pacing import check_s_from_env, check_steps_from_env, round_steps_from_env
from ftrun.preflight import preflight

if TYPE_CHECKING:
    from ftrun.run_config import RunConfig


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


# A run id names a folder (plus ".nodeK"): ASCII, no path separators, well under NAME_MAX.
RUN_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

# What a sharded replica's cross-replica reduce can do: average, optionally in half precision.
# PowerSGD, local SGD and noop are DDP hooks (they need DDP's buckets and its optimizer loop).
SHARDED_HOOKS = ("allreduce", "fp16", "bf16")


def validate(cfg: RunConfig, check_paths: bool = True, check_script: bool = True) -> None:
    """Checks that need the whole config; then, unless check_paths is False, those of the machine
    (ftrun.preflight: files, ports, addresses, processes)."""
    if cfg.module and cfg.no_python:
        raise blame("module", "-m/--module and --no-python cannot be used together; pick one")
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
    for reader in (check_s_from_env, check_steps_from_env):
        _, bad_check = reader(os.environ)
        if bad_check and cfg.ft:
            raise ConfigError(f"environment: {bad_check}")
    moves = os.environ.get("FTRUN_STORE_MOVES")
    if moves is not None and moves not in ("0", "1"):
        raise ConfigError(f"environment: FTRUN_STORE_MOVES={moves!r} must be 0 or 1 (1, the default: the run's "
                          f"store moves when its node is lost); fix it or unset FTRUN_STORE_MOVES")
    if not RUN_ID_RE.fullmatch(cfg.run_id):
        shown = cfg.run_id if len(cfg.run_id) <= 40 else cfg.run_id[:40] + f"... ({len(cfg.run_id)} characters)"
        raise blame("run_id", f"--run-id {shown!r}{from_source(cfg.sources.get('run_id', CLI))}: use 1 to 128 ASCII "
                              f"letters, digits, '-', '_' and '.', starting with a letter or digit (it names the "
                              f"run's folder)")
    _check_ignored_options(cfg)
    if cfg.rdzv == "static" and cfg.node_rank >= cfg.nnodes:
        raise blame("node_rank", f"--node-rank {cfg.node_rank} is out of range for --nnodes {cfg.nnodes}; "
                                 f"use 0..{cfg.nnodes - 1}")
    if cfg.rdzv == "static" and cfg.nnodes > 1 and cfg.master_port is None:
        raise blame("master_port", f"--nnodes {cfg.nnodes} needs --master-port: the same port on every node, "
                                   f"where node 0's ftrun hosts the run's store (e.g. --master-port 29500), "
                                   f"or --rdzv-backend c10d --rdzv-endpoint HOST:PORT")
    if cfg.rdzv != "local" and not cfg.master_addr.strip():
        raise blame("master_addr", "--master-addr is empty; give node 0's address (the same on every node)")
    if cfg.ranks is not None:
        # An elastic run has at most max_nodes * nproc ranks.
        bad = [r for r in cfg.ranks if r >= cfg.world_size]
        if bad:
            raise blame("ranks", f"--ranks {','.join(map(str, bad))}: no such rank; this run has ranks "
                                 f"0..{cfg.world_size - 1}")
    if cfg.local_ranks_filter is not None:
        bad = [r for r in cfg.local_ranks_filter if r >= cfg.nproc]
        if bad:
            raise blame("local_ranks_filter", f"--local-ranks-filter {','.join(map(str, bad))}: no such local "
                                              f"rank; this node has local ranks 0..{cfg.nproc - 1}")
    if cfg.ft and cfg.hook is not None and cfg.hook.name in ("diloco", "localsgd"):
        # Both sync parameters outside the round's collectives (after the script's optimizer step),
        # where a peer's death is no failed round: under --ft a sync is to be the quorum's round.
        raise blame("hook", f"--hook {cfg.hook.name} runs without --ft in this version (under --ft its sync is to "
                            f"be the quorum's round: not built yet); drop --ft, or use --hook powersgd, fp16 or "
                            f"bf16 under --ft")
    if cfg.ft and cfg.replica_size > 1:
        _check_replica_size(cfg)
    replicas = cfg.world_size // cfg.replica_size
    if cfg.ft and cfg.min_nodes == cfg.max_nodes and cfg.min_replicas > replicas:
        raise blame("min_replicas", f"--min-replicas {cfg.min_replicas} exceeds the {replicas} replicas "
                                    f"of this run; lower it")
    if cfg.ft and cfg.spares:
        _check_spares(cfg)
    if check_paths:
        preflight(cfg, check_script)


def _check_spares(cfg: RunConfig) -> None:
    """--spares N: at least one replica trains (on the fewest nodes an elastic run starts with), and
    --min-replicas counts training replicas only."""
    fewest = cfg.min_nodes * cfg.nproc // cfg.replica_size
    if cfg.spares >= fewest:
        shape = f" of {cfg.replica_size} workers" if cfg.replica_size > 1 else ""
        raise blame("spares", f"--spares {cfg.spares} leaves no training replica: this run has {fewest} "
                              f"replica{'s' if fewest != 1 else ''}{shape}; use --spares {fewest - 1} or fewer")
    if cfg.min_replicas > fewest - cfg.spares:
        raise blame("min_replicas", f"--min-replicas {cfg.min_replicas} exceeds the {fewest - cfg.spares} training "
                                    f"replicas of this run ({fewest} less --spares {cfg.spares}); lower one of them")


def _check_replica_size(cfg: RunConfig) -> None:
    """--replica-size K > 1: K workers of one node shard each replica, so K divides the node's workers."""
    k = cfg.replica_size
    if cfg.nproc % k:
        spans = k % cfg.nproc == 0
        raise blame("replica_size", f"--replica-size {k} does not divide the {cfg.nproc} workers of a node"
                    + ("; a replica spanning several nodes is not supported yet: use one replica per node "
                       f"(--replica-size {cfg.nproc}) or smaller" if spans else
                       f"; pick a divisor of {cfg.nproc} (replicas never span nodes)"))
    if cfg.hook is not None and cfg.hook.name not in SHARDED_HOOKS:
        raise blame("hook", f"--hook {cfg.hook.name} needs DDP's buckets, but a replica of {k} workers shards the "
                            f"model (FSDP2); use --hook {', '.join(SHARDED_HOOKS)} (optionally --wrap fp16|bf16), "
                            f"or --replica-size 1")


def _check_ignored_options(cfg: RunConfig) -> None:
    """Options that would do nothing in this run: say so instead of ignoring them."""
    given = lambda key: cfg.sources.get(key, "default") != "default"  # noqa: E731
    if cfg.no_python and cfg.hook is not None:
        raise blame("hook", f"--hook {cfg.hook.name} does nothing with --no-python: hooks are put into the DDP "
                            f"model by ftrun's Python bootstrap; run a Python script, or drop --hook")
    if cfg.no_python and cfg.step_timeout:
        raise blame("step_timeout", "--step-timeout does nothing with --no-python: optimizer steps are counted by "
                                    "ftrun's Python bootstrap; run a Python script, or drop --step-timeout")
    if given("replica_size") and not cfg.ft:
        raise blame("replica_size", f"--replica-size {cfg.replica_size} applies only to --ft runs (a replica is a "
                                    f"unit that fails, restarts and heals alone); add --ft, or drop --replica-size")
    if given("checkpoint_dir") and not cfg.ft:
        raise blame("checkpoint_dir", f"--checkpoint-dir {cfg.checkpoint_dir} applies only to --ft runs (it keeps "
                                      f"the replicas' state when every replica is lost); add --ft, or drop "
                                      f"--checkpoint-dir")
    for key in ("checkpoint_every", "checkpoint_keep"):
        if given(key) and not cfg.checkpoint_dir:
            flag = "--" + key.replace("_", "-")
            raise blame(key, f"{flag} {getattr(cfg, key)} does nothing without --checkpoint-dir DIR; add it, or "
                             f"drop {flag}")
    if cfg.checkpoint_dir is not None and not cfg.checkpoint_dir.strip():
        raise blame("checkpoint_dir", "--checkpoint-dir is empty; give a folder")
    if given("spares") and cfg.spares and not cfg.ft:
        raise blame("spares", f"--spares {cfg.spares} applies only to --ft runs (a spare takes a failed replica's "
                              f"place); add --ft, or drop --spares")
    if given("min_replicas") and not cfg.ft:
        raise blame("min_replicas", f"--min-replicas {cfg.min_replicas} applies only to --ft runs; add --ft, or "
                                    f"drop --min-replicas")
    if cfg.quiet and cfg.verbose and cfg.sources.get("verbose") != "FTRUN_VERBOSE":  # the variable: --quiet wins
        raise blame("verbose", "--verbose adds ftrun's per-rank lines to the workers' console output, but --quiet "
                               "shows none of it; drop one of them")
    if cfg.quiet:
        for key, flag in (("ranks", "--ranks"), ("local_ranks_filter", "--local-ranks-filter"), ("tee", "--tee")):
            if given(key) and getattr(cfg, key):
                raise blame(key, f"{flag} picks workers' console output, but --quiet shows none; drop one of them")
    for key, flag in (("redirects", "--redirects"), ("tee", "--tee")):
        bad = sorted(r for r in getattr(cfg, key) if r >= cfg.nproc)
        if bad:
            raise blame(key, f"{flag} names local rank {','.join(map(str, bad))}, which this node does not have; "
                             f"it has local ranks 0..{cfg.nproc - 1}")
