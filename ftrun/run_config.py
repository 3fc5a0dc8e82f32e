"""RunConfig: a validated run, as one value (built by ftrun.config.build_config only).

Its own module so that the checks that read a run (ftrun.checks, ftrun.preflight,
ftrun.machine) can name its type without importing the module that builds it and
imports them. Must never import torch, read anything or look at the machine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

from ftrun.hookspec import HookSpec

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
    spares: int = 0  # --ft: replicas held back as hot spares (ftrun/supervisor/ft/keeper/spares.py)
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
    # Workers are forked from a zygote that imported torch once (supervisor/workers/spawn.py), not
    # started as new Pythons: decided by build_config alone (FTRUN_ZYGOTE, --no-python); every
    # part that starts or pre-warms workers reads this.
    use_zygote: bool = False

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes

    @property
    def admits_late(self) -> bool:
        """--ft on an elastic c10d run: a node that comes while the run trains joins it at once."""
        return self.ft and self.rdzv == "c10d" and self.min_nodes != self.max_nodes
