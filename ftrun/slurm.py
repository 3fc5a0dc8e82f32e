"""What a Slurm step tells ftrun about the run's layout: nodes, this node's rank, node 0's host.

Under `srun ftrun --nproc 4 train.py` (one task per node), the number of
nodes, this node's rank and node 0's address come from SLURM_NNODES,
SLURM_NODEID and the first host of SLURM_JOB_NODELIST, and a port all nodes
agree on from the job id. The compact host list (`node[01-03,7],gpu5`) is
expanded here, so no `scontrol` is needed.
This module must never import torch, run a program or read anything but the
environment it is given: the CLI path uses it.
"""

from __future__ import annotations

import os
from typing import Dict, List, Mapping, Optional

# Ports derived from the job id land in [BASE, BASE + SPAN): above the usual
# services, below the kernel's ephemeral range (32768+), as Lightning does.
PORT_BASE = 15000
PORT_SPAN = 10000


class SlurmError(ValueError):
    """A SLURM_* variable that cannot be understood."""


def _split_top(text: str) -> List[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise SlurmError(f"unbalanced ']' in host list {text!r}")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise SlurmError(f"unbalanced '[' in host list {text!r}")
    parts.append("".join(cur))
    return [p for p in (s.strip() for s in parts) if p]


def _expand_range(item: str) -> List[str]:
    """'01-03' -> ['01', '02', '03'] (zero padding kept); '7' -> ['7']."""
    lo, sep, hi = item.partition("-")
    if not lo.isdigit() or (sep and not hi.isdigit()):
        raise SlurmError(f"bad range {item!r} in host list")
    if not sep:
        return [lo]
    width = len(lo)
    a, b = int(lo), int(hi)
    if b < a:
        raise SlurmError(f"bad range {item!r} in host list (end before start)")
    return [str(i).zfill(width) for i in range(a, b + 1)]


def _expand_host(pattern: str) -> List[str]:
    """One host pattern, possibly with several bracket groups: 'r[1-2]n[01,03]'."""
    start = pattern.find("[")
    if start < 0:
        return [pattern]
    end = pattern.find("]", start)
    if end < 0:
        raise SlurmError(f"unbalanced '[' in host list {pattern!r}")
    prefix, body, rest = pattern[:start], pattern[start + 1:end], pattern[end + 1:]
    tails = _expand_host(rest)
    out: List[str] = []
    for item in body.split(","):
        for mid in _expand_range(item.strip()):
            out.extend(prefix + mid + t for t in tails)
    return out


def expand_hostlist(text: str) -> List[str]:
    """Slurm's compact host list, expanded in order: 'node[01-03,7]' -> node01, node02, node03, node7.
    A host named twice counts once, where it first appears (as python-hostlist expands it)."""
    hosts: List[str] = []
    for part in _split_top(text.strip()):
        hosts.extend(_expand_host(part))
    return list(dict.fromkeys(hosts))


def first_host(text: str) -> str:
    """The first host of a compact host list, without expanding the rest."""
    parts = _split_top(text.strip())
    if not parts:
        raise SlurmError("empty host list")
    return _expand_host(parts[0])[0]


def job_port(job_id: str) -> int:
    """A port every node of one job derives alike (and different jobs rarely share)."""
    digits = "".join(ch for ch in job_id if ch.isdigit()) or "0"
    return PORT_BASE + int(digits) % PORT_SPAN


def layout_from_env(env: Optional[Mapping[str, str]] = None) -> Dict[str, object]:
    """nnodes, node_rank, master_addr, master_port (and run_id) from a Slurm step; {} outside Slurm.

    Only what the environment really says is returned; the caller fills in
    what the user did not give. Raises SlurmError for a variable that is set
    but cannot be read.
    """
    env = os.environ if env is None else env
    if "SLURM_JOB_ID" not in env or "SLURM_NNODES" not in env or env.get("FTRUN_NO_SLURM") == "1":
        return {}
    out: Dict[str, object] = {}
    try:
        out["nnodes"] = int(env["SLURM_NNODES"])
        if "SLURM_NODEID" in env:
            out["node_rank"] = int(env["SLURM_NODEID"])
        ntasks = int(env["SLURM_NTASKS"]) if env.get("SLURM_NTASKS") else None
    except ValueError as e:
        raise SlurmError(f"SLURM_NNODES/SLURM_NODEID/SLURM_NTASKS must be whole numbers ({e})") from None
    # Several ftruns on one node would all claim that node's rank: say so now,
    # not after the join timeout.
    if ntasks is not None and ntasks != out["nnodes"]:
        raise SlurmError(f"this Slurm step has {ntasks} tasks on {out['nnodes']} nodes; ftrun starts the workers "
                         f"itself, so run one ftrun per node: srun --ntasks-per-node=1 ftrun ...")
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if nodelist:
        out["master_addr"] = first_host(nodelist)
    job = env["SLURM_JOB_ID"]
    out["master_port"] = job_port(job)
    step = env.get("SLURM_STEP_ID")
    out["run_id"] = f"slurm-{job}" + (f".{step}" if step else "")
    return out
