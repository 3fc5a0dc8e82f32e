"""A c10d run: round after round of the supervisor's loop (ftrun.supervisor.loop.run), each formed by
the rendezvous (ftrun.supervisor.nodes.rendezvous), until a round's agent says the run is over.

The rounds are the loop's outer state: a round's Supervisor alone decides whether another follows
(`Supervisor.reform`); here the next one is formed and the store followed where it moved. The
run's signals have one path through every round (ftrun.supervisor.loop.signals): a round's
Supervisor is handed them while it runs; one that comes between two rounds (while the nodes gather,
or while a round that re-forms ends) is read by the rendezvous's next poll and ends the run.
Must never decide anything of a round itself, and never import torch.
"""

from __future__ import annotations

import dataclasses
import signal
from typing import Optional

from ftrun.config import RunConfig
from ftrun.exits import EXIT_SIGNAL_BASE
from ftrun.supervisor.loop.run import Supervisor
from ftrun.supervisor.loop.signals import RunSignals
from ftrun.supervisor.nodes import coordinator as nodes
from ftrun.supervisor.nodes import rendezvous
from ftrun.supervisor.nodes.rendezvous_rounds import JOIN_FAILED, Moved, RendezvousStoreLost, Stop, fail, host_round, \
    join_round, key, stop_if
from ftrun.supervisor.policy.stopping import forwarded_signals
from ftrun.supervisor.policy.restart import Repeats
from ftrun.supervisor.workers.logs import ConsoleOut


def run_c10d(cfg: RunConfig, console: Optional[ConsoleOut] = None) -> int:
    """Round after round until the run ends; ftrun's exit status."""
    console = console or ConsoleOut(cfg.quiet)
    repeats = Repeats()  # a script's error that repeats round after round ends the run (policy/restart.py)
    signals = RunSignals(forwarded_signals(cfg))
    signals.install()
    signalled = signals.signalled
    cfg = dataclasses.replace(cfg, endpoint=f"{cfg.master_addr}:{cfg.master_port}")
    store, host, zygote, standby = None, False, None, None
    beacon = None  # the store this node hosts at the original endpoint, telling where the run went
    code = JOIN_FAILED
    try:
        zygote = rendezvous.prewarm(cfg)  # its torch import overlaps the supervisor's own (for the store)
        store, host = rendezvous.open_store(cfg, console, signalled)
        if store is None:
            return JOIN_FAILED
        if not host and (rendezvous.moves_enabled(cfg) or cfg.ft):
            standby = rendezvous.standby_store(cfg)
        n, need, expect = 0, 0, None
        last, moving = None, False  # a follower's coordinator of the round that ended: where the store may move
        while True:
            stop_if(signalled)  # one that came while the last round ended, too: no round follows
            if last is not None and (moving or not last.store_reachable(probes=1)):
                # The store went away with its node, at the end of the round or while the nodes
                # re-formed: agree on its next host with the nodes that remain, then form there.
                moved = rendezvous.move_store(cfg, last, store, standby, console, signalled)
                if isinstance(moved, int):
                    code = moved
                    return code
                cfg, host, expect = moved
                if host:
                    store, standby = standby, None
                last = None
            zygote = zygote or rendezvous.prewarm(cfg)
            try:
                formed = (host_round(cfg, store, n, console, signalled, need, expect) if host
                          else join_round(cfg, store, n, console, signalled, standby))
            except Moved as e:
                # A node at the original endpoint after the store moved: the run goes on elsewhere.
                # A hosting node keeps its store (and the word in it) up for the nodes after it.
                beacon = store if host else beacon
                host = False
                where, _, port = e.addr.rpartition(":")
                cfg = dataclasses.replace(cfg, master_addr=where, master_port=int(port))
                console.note(f"the run's store moved to {e.addr}; joining the run there", style="bold cyan")
                store, _ = rendezvous.open_store(cfg, console, signalled, join_only=True)
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
            stop_if(signalled)
            sup = Supervisor(round_cfg, store=store, zygote=zygote, standby=standby, repeats=repeats,
                             signals=signals)
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
        # (A signal now is only recorded: the clean-up is never cut short.)
        if zygote is not None:
            zygote.close()
        for hosted in ([store] if host else []) + ([beacon] if beacon is not None else []):
            if hosted is not None and hosted.store is not None:
                try:
                    hosted.set(key("done"), str(code))
                except Exception:
                    pass
