"""Where the run's store goes when the node hosting it is lost (--ft, several nodes): the election.

Every node but node 0 hosts a standby TCPStore from the start and publishes
its address in the run's store as it joins, so every node knows every
standby address before anything goes wrong. When the run's store goes away,
each surviving node walks the same list, the run's nodes in rank order
without the lost host, and settles on the first candidate that answers:

- a candidate that is this node: it becomes the host, on its standby store;
- another candidate whose standby store answers: this node writes
  ``failover_node(g, me)`` there and waits for that candidate's word;
- a candidate that does not answer within the node timeout is skipped.

A host forms the new layout once more than half of the run's nodes (itself
included) chose it: at once when every candidate has, else one second after
the majority was reached. It writes the layout into ``failover_formed(g)``
with compare_set, so a node that chose it too late reads a layout without
itself, and stops. No split brain: a node chooses at most one host per
generation, and a host needs more than half of the nodes, so two hosts
cannot both form; the old host, if it was only cut off, keeps the run only
while it sees at least half of the nodes (the agent stops it otherwise), and
half plus more than half is more than all.

It carries out the agreement and says how it ended; the agent decides what
follows. Must never start, stop or signal a worker, and never import torch at
module level (the CLI path imports the supervisor).
"""

from __future__ import annotations

import datetime
import json
import time
from dataclasses import dataclass
from typing import Any, Callable, Container, Dict, Iterable, List, Optional

from ftrun.keys import failover_formed, failover_node

GRACE_S = 1.0  # a host with a majority still waits this long for the other candidates
POLL_S = 0.02


@dataclass
class Elected:
    host: int          # node rank of the new host
    addr: str          # host:port of the run's store from now on
    store: Any         # a TCPStore on it (the host's own server, or a client)
    nodes: List[int]   # the run's nodes from now on


class NoMajority(Exception):
    """The election ended without a host this node may follow: the node must stop."""


def majority(n: int) -> int:
    """Nodes a new host needs out of the run's `n`: more than half."""
    return n // 2 + 1


def keeps_running(alive: int, n: int, strict: bool = False) -> bool:
    """Whether the host's side, `alive` nodes of `n` with the host among them, may go on: at least
    half (a side without the host needs more than half, so both sides can never go on).

    `strict`, on an elastic run: more than half. The others may not know yet of the last node the
    host took in (they read the node list a beat later) and count one node fewer; against that,
    a host with more than half still leaves the others less than half of what they count."""
    return 2 * alive > n if strict else 2 * alive >= n


def candidates(live: Iterable[int], lost: Iterable[int], standby: Container[int]) -> List[int]:
    """The nodes that may host the run's store next, in the order every node tries them (rank
    order): the live ones that are not lost and have a standby store."""
    gone = set(lost)
    return [k for k in sorted(live) if k not in gone and k in standby]


def next_host(candidates: List[int], me: int, answers: Callable[[int], bool]) -> Optional[int]:
    """The candidate this node turns to as the next host (elect's rule): itself if it comes first,
    else the first whose standby store answers (`answers(c)`); None when none does. Every node
    that sees the same candidates answer turns to the same one."""
    for c in candidates:
        if c == me or answers(c):
            return c
    return None


def elect(me: int, gen: int, candidates: List[int], standby: Dict[int, str], own: Any, n: int,
          timeout_s: float, prepare: Callable[[Any], None], stopped: Callable[[], bool]) -> Elected:
    """Agree with the other survivors on the run's next store host (generation `gen`).

    `candidates`: the run's nodes but the lost host, in rank order; `standby`: their standby
    stores' host:port; `own`: this node's standby TCPStore (its server); `n`: the run's nodes,
    the lost included; `prepare(store)` writes this node's keys into the chosen store before it
    says it is there (the others read them as soon as the layout forms). Raises NoMajority."""
    opened: Dict[int, Any] = {}

    def answers(c: int) -> bool:
        opened[c] = _connect(standby[c], timeout_s)
        return opened[c] is not None  # else gone too, or cut off from us: the next candidate

    c = next_host(candidates, me, answers)
    if c is None:
        raise NoMajority("no other node's standby store answered")
    if c == me:
        return _host(me, gen, candidates, standby, own, n, timeout_s, prepare, stopped)
    store = opened[c]
    deadline = time.monotonic() + 3 * timeout_s + 5.0
    try:
        prepare(store)
        store.set(failover_node(gen, me), "1")
        while not store.check([failover_formed(gen)]):
            if time.monotonic() > deadline or stopped():
                raise NoMajority(f"node {c} did not gather a majority of the run's {n} nodes "
                                 f"within {3 * timeout_s + 5.0:g} s")
            time.sleep(POLL_S)
        formed = json.loads(store.get(failover_formed(gen)))
    except NoMajority:
        raise
    except Exception as e:  # this node chose it: it may not choose another in this generation
        raise NoMajority(f"node {c} went away while it gathered the others ({str(e).splitlines()[0][:120]})")
    if me not in formed["nodes"]:
        raise NoMajority(f"node {c} formed the run without this node (it came too late)")
    return Elected(c, standby[c], store, formed["nodes"])


def _host(me: int, gen: int, candidates: List[int], standby: Dict[int, str], own: Any, n: int,
          timeout_s: float, prepare: Callable[[Any], None], stopped: Callable[[], bool]) -> Elected:
    prepare(own)
    own.set(failover_node(gen, me), "1")
    need = majority(n)
    if len(candidates) < need:
        raise NoMajority(f"only {len(candidates)} of the run's {n} nodes may remain; {need} are needed")
    # The others notice the loss within the node timeout, and may spend one more on each
    # candidate before this one that does not answer.
    deadline = time.monotonic() + 3 * timeout_s + 5.0
    since: Optional[float] = None
    while True:
        chose = [k for k in candidates if own.check([failover_node(gen, k)])]
        now = time.monotonic()
        if len(chose) >= need and since is None:
            since = now
        if since is not None and (len(chose) == len(candidates) or now - since >= GRACE_S):
            break
        if now > deadline or stopped():
            raise NoMajority(f"{len(chose)} of the run's {n} nodes reached this node within "
                             f"{3 * timeout_s + 5.0:g} s; {need} are needed")
        time.sleep(POLL_S)
    formed = json.dumps({"host": me, "nodes": chose})
    won = json.loads(own.compare_set(failover_formed(gen), "", formed))
    return Elected(me, standby[me], own, won["nodes"])


def _connect(addr: str, timeout_s: float) -> Any:
    """A client of the standby store at host:port, or None if it does not answer in time."""
    from ftrun.supervisor.store import BoundedStore, wait_reachable

    host, _, port = addr.rpartition(":")
    if wait_reachable(host, int(port), timeout_s) is not None:
        return None
    import torch.distributed as dist

    try:
        store = dist.TCPStore(host, int(port), None, False, datetime.timedelta(seconds=timeout_s))
    except Exception:
        return None
    store.set_timeout(datetime.timedelta(seconds=max(timeout_s, 10.0)))
    return BoundedStore(store, max(timeout_s, 10.0))
