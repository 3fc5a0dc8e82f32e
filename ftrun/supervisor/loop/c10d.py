"""A c10d run: round after round of the supervisor's loop (ftrun.supervisor.loop.run), each formed by
the rendezvous (ftrun.supervisor.nodes.rendezvous), until a round's agent says the run is over.

The rounds are the loop's outer state: a round's Supervisor alone decides whether another follows
(`Supervisor.reform`); here the next one is formed, the store followed where it moved, and the
signals that arrive between two rounds (while the nodes gather) end the run.
Must never decide anything of a round itself, and never import torch.
"""

from __future__ import annotations

import dataclasses
import signal
from typing import Optional

from ftrun.config import RunConfig
from ftrun.exits import EXIT_SIGNAL_BASE
from ftrun.supervisor.loop.run import Supervisor
from ftrun.supervisor.nodes import coordinator as nodes
from ftrun.supervisor.nodes import rendezvous
from ftrun.supervisor.nodes.rendezvous_rounds import JOIN_FAILED, Moved, RendezvousStoreLost, Stop, fail, host_round, \
    join_round, key
from ftrun.supervisor.policy.restart import Repeats
from ftrun.supervisor.workers.logs import ConsoleOut


def run_c10d(cfg: RunConfig, console: Optional[ConsoleOut] = None) -> int:
    """Round after round until the run ends; ftrun's exit status."""
    console = console or ConsoleOut(cfg.quiet)
    repeats = Repeats()  # a script's error that repeats round after round ends the run (policy/restart.py)
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}

    def stop(signum, _frame):
        raise Stop(signum)

    cfg = dataclasses.replace(cfg, endpoint=f"{cfg.master_addr}:{cfg.master_port}")
    store, host, zygote, standby = None, False, None, None
    beacon = None  # the store this node hosts at the original endpoint, telling where the run went
    code = JOIN_FAILED
    try:
        for s in previous:
            signal.signal(s, stop)
        zygote = rendezvous.prewarm(cfg)  # its torch import overlaps the supervisor's own (for the store)
        store, host = rendezvous.open_store(cfg, console)
        if store is None:
            return JOIN_FAILED
        if not host and (rendezvous.moves_enabled(cfg) or cfg.ft):
            standby = rendezvous.standby_store(cfg)
        n, need, expect = 0, 0, None
        last, moving = None, False  # a follower's coordinator of the round that ended: where the store may move
        while True:
            for s in previous:
                signal.signal(s, stop)
            if last is not None and (moving or not last.store_reachable(probes=1)):
                # The store went away with its node, at the end of the round or while the nodes
                # re-formed: agree on its next host with the nodes that remain, then form there.
                moved = rendezvous.move_store(cfg, last, store, standby, console)
                if isinstance(moved, int):
                    code = moved
                    return code
                cfg, host, expect = moved
                if host:
                    store, standby = standby, None
                last = None
            zygote = zygote or rendezvous.prewarm(cfg)
            try:
                formed = (host_round(cfg, store, n, console, need, expect) if host
                          else join_round(cfg, store, n, console, standby))
            except Moved as e:
                # A node at the original endpoint after the store moved: the run goes on elsewhere.
                # A hosting node keeps its store (and the word in it) up for the nodes after it.
                beacon = store if host else beacon
                host = False
                where, _, port = e.addr.rpartition(":")
                cfg = dataclasses.replace(cfg, master_addr=where, master_port=int(port))
                console.note(f"the run's store moved to {e.addr}; joining the run there", style="bold cyan")
                store, _ = rendezvous.open_store(cfg, console, join_only=True)
                if store is None:
                    return JOIN_FAILED
                if standby is None and (rendezvous.moves_enabled(cfg) or cfg.ft):
                    standby = rendezvous.standby_store(cfg)
                continue
            except RendezvousStoreLost as e:
                if last is not None and not last.store_reachable():
                    moving = True
                    continue
                fail(console, f"lost the run's store at {cfg.master_addr}:{cfg.master_port}: {e}")
                code = nodes.NODE_LOST
                return code
            if isinstance(formed, int):
                code = formed
                return code
            n, rank, size, master, live = formed
            round_cfg = dataclasses.replace(
                cfg, node_rank=rank, nnodes=size, round=n, workers_master_addr=master, nodes_live=live,
                total_restarts=cfg.max_restarts,
                # Without --ft a failure ends the round and every node re-forms (torchrun's restart);
                # with --ft replicas restart inside the round.
                max_restarts=cfg.max_restarts if cfg.ft else 0)
            nodes.use_round(n)
            sup = Supervisor(round_cfg, store=store, zygote=zygote, standby=standby, repeats=repeats)
            zygote = None  # the round's now
            code = sup.run()
            if sup.nodes is not None and sup.nodes.me == sup.nodes.host_node:
                host = True  # the store moved here during the round: nodes still waiting read `done` here
            if not sup.reform:  # the round's agent decided: the run is over
                return code
            # No second run may form beside this one: the next round needs at least half of this
            # round's nodes when the store could have moved to the others (they need more than half).
            need = -(-size // 2) if size >= 3 and rendezvous.moves_enabled(cfg) else 0
            expect = None
            last = sup.nodes if sup.nodes is not None and sup.nodes.may_move_between_rounds() else None
            moving = sup.store_lost
            n += 1
    except Stop as e:
        console.note(f"received {signal.Signals(e.signum).name}: stopping", style="bold yellow")
        code = EXIT_SIGNAL_BASE + e.signum
        return code
    finally:
        for s in previous:  # the stop is under way: a second signal must not cut the clean-up short
            signal.signal(s, signal.SIG_IGN)
        if zygote is not None:
            zygote.close()
        for s, h in previous.items():
            signal.signal(s, h)
        for hosted in ([store] if host else []) + ([beacon] if beacon is not None else []):
            if hosted is not None and hosted.store is not None:
                try:
                    hosted.set(key("done"), str(code))
                except Exception:
                    pass
