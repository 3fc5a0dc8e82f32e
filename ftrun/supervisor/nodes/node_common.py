"""What the modules of a multi-node run share: timings, the node keys of this round, node states,
and the NodeEvent a node module reports to the supervisor's loop.

KEYS is rebound by use_round() (c10d re-forms in rounds): every module reads it as
`node_common.KEYS` at the moment of use, never binds it by name.
Must never act (start, stop, signal, decide) and never import torch.
"""

from __future__ import annotations

import enum
import json
import os
import socket
from dataclasses import dataclass
from typing import List, Optional

from ftrun.exits import EXIT_FAILED, EXIT_REQUEUE, EXIT_USAGE
from ftrun.keys import NodeKeys
from ftrun.wire import FirstFailure

BEAT_S = 0.25
def _node_timeout() -> float:
    try:  # checked with the rest of the input (ftrun.config.validate); never a crash at import
        return min(3600.0, max(0.5, float(os.environ.get("FTRUN_NODE_TIMEOUT", "3"))))
    except ValueError:
        return 3.0


NODE_TIMEOUT_S = _node_timeout()
POLL_S = 0.05
# Exit status for a run that cannot form (duplicate rank, nodes that never
# came, node 0 unreachable): nothing was started, as for bad input.
JOIN_FAILED = EXIT_USAGE
NODE_LOST = EXIT_FAILED
# --ft, node 0 (the run's store and quorum keeper) lost: the other nodes end with this status,
# for schedulers to requeue the job, which resumes from --checkpoint-dir (ftrun.exits).
REQUEUE = EXIT_REQUEUE

KEYS = NodeKeys()
# Fault injection for tests: a late node holds here, taken in but not yet joined (no beat),
# until this file exists (at most a minute).
INJECT_JOIN_HOLD_ENV = "FTRUN_INJECT_JOIN_HOLD"


def use_round(n: int) -> None:
    """Put every node key of this process under rendezvous round n (ftrun.keys.NodeKeys)."""
    global KEYS
    KEYS = NodeKeys(n)


class NodeState(str, enum.Enum):
    RUNNING = "running"   # heartbeating
    ENDED = "ended"       # its ftrun finished and said so (final/K)
    LOST = "lost"         # no heartbeat for NODE_TIMEOUT_S and no final word


@dataclass(frozen=True)
class NodeEvent:
    """What check() saw. kind: "store_gone" (the store's host went away), "node_lost" (node `node`
    went away or ended in failure; `text` says which), "remote_failure" (another node's
    first failure of the current attempt, `failure` as agreed in the store); with --ft on an
    elastic c10d run, "node_waiting" (node 0: late node `node` asks to join the running
    round) and "node_joined" (node 0 took late node `node` in)."""

    kind: str
    text: str = ""
    node: int = -1
    failure: Optional[FirstFailure] = None


class StoreState(str, enum.Enum):
    UP = "up"
    LOST = "lost"         # node 0 (the store) went away



def route_ip(host: str) -> str:
    """This machine's address on the way to `host` (the interface the others reach us on); no packet
    is sent: connecting a UDP socket only picks the route."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return host


def node_list(raw: bytes) -> List[int]:
    try:
        return [int(k) for k in json.loads(raw or b"[]")]
    except (ValueError, TypeError):
        return []

