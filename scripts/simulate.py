#!/usr/bin/env python3
"""Explore the --ft protocol's interleavings: seeded schedules of faults, each run by a
deterministic simulator (ftrun/sim) that drives the real keeper and the real member driver over
an in-memory store, simulated process groups and a virtual clock, with the protocol's
invariants checked after every scheduled turn.

    scripts/simulate.py --schedules 800 --seed 1        # the CI budget (about 8 s)
    scripts/simulate.py --soak --seed 7                 # longer: 20,000 schedules (about 6 minutes of CPU)
    scripts/simulate.py --replay '{"seed": ..., "faults": [...]}'   # one schedule, as printed
    scripts/simulate.py --replica-size 2 --schedules 500  # sharded replicas: K workers each
    scripts/simulate.py --nodes 2 --schedules 500         # two machines: node relays, a lost node
    scripts/simulate.py --round-steps 4 --schedules 500   # rounds of several steps, one vote each
    scripts/simulate.py --max-restarts 1 --schedules 500  # restart budgets: replicas dropped, runs given up
    scripts/simulate.py --joiners --schedules 500         # replicas that join the running run (elastic)
    scripts/simulate.py --stops --schedules 500           # a stop signal mid-run: stop quorums
    scripts/simulate.py --moves --schedules 500           # the store's host lost: the store moves (3 nodes)
    scripts/simulate.py --checkpoints --schedules 500     # checkpoints saved, resumed after every replica died
    scripts/simulate.py --spares --schedules 500          # hot spares held back, promoted when a replica dies
    scripts/simulate.py --guard --schedules 500           # the guard: members compare their states every few steps
    scripts/simulate.py --sub-steps --schedules 500       # optimizers stepped one after another each step (a GAN)

A violation prints the shortest schedule that still fails (faults removed one at a time while
it does), as a line to replay, and the run exits 1. The last line is always
`N schedules, V violations`. --bug NAME runs with a historic bug put back (ftrun/sim/bugs.py),
to show that the simulator finds it; the product never runs that code.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import asdict, replace
from typing import List, Optional

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ftrun.sim.bugs import BASELINE, BUGS  # noqa: E402
from ftrun.sim.invariants import PROGRESS_BOUND_S  # noqa: E402
from ftrun.sim.schedule import UNLIMITED, Fault, Schedule  # noqa: E402
from ftrun.sim.world import run_schedule  # noqa: E402

CI_SCHEDULES = 800
SOAK_SCHEDULES = 20000
KINDS = ["kill"] * 5 + ["kill-call"] * 5 + ["heal-kill"] * 3 + ["pause"] * 3 + ["pause-call"] * 3 + ["slow"] * 2 + ["late"] * 2 + ["store-down"] * 2 + \
        ["store-slow"]


def make_schedule(seed: int, k: int = 1, nodes: int = 1, round_steps: int = 1,
                  max_restarts: Optional[int] = None, joiners: bool = False, stops: bool = False,
                  moves: bool = False, checkpoints: bool = False, spares: bool = False, guard: bool = False,
                  sub_steps: bool = False) -> Schedule:
    """A random schedule: 2-5 replicas (2-3 of K workers with K > 1; 1-2 per node on several
    nodes), 8-20 rounds, 0-6 faults within the run's first 1.5 s, or 3-8 within 0.6 s; a fault's
    rank is any worker. On several nodes a quarter of the schedules lose a node besides. With a
    restart budget (`max_restarts`), --min-replicas is 1 to all the replicas, and one worker is
    killed 1-3 times more within the first 2 s, so that budgets run out. With `joiners`, 1-2
    replicas of a late node join the running run (elastic) at 0.1-2.5 s, and half the schedules
    kill one of them within a second of that. With `stops`, a stop signal reaches ftrun at
    0.05-2.5 s (a stop quorum, its writer's word, then every worker stopped), and half the
    schedules kill a worker 0.03-0.15 s after it. With `moves` (three nodes at least), the node
    hosting the run's store is lost at 0.1-2.5 s, and half the schedules kill a worker of another
    node, or in its next heal, around then. With `checkpoints`, the writer saves every 1-5 steps,
    and half the schedules kill every worker at once at 0.2-2.5 s (a whole-run restart: the next
    quorum's source resumes the newest complete checkpoint). With `spares`, the keeper holds 1 to
    replicas-2 replicas back as hot spares (1 of 2; the highest at the start), and the
    faults aim at them: a held spare killed, a training replica killed and the spare taking its
    place killed as it receives the state (mid-promotion), two training replicas killed at one
    instant, and more failures than spares."""
    rng = random.Random(seed)
    if moves:
        nodes = max(nodes, 3)
    replicas = rng.randint(2, 5) if k == 1 else rng.randint(2, 3)
    if nodes > 1:
        replicas = nodes * rng.randint(1, 2)
    total = rng.randint(8, 20)
    faults: List[Fault] = []
    # A third of the schedules are bursts: many faults within a fraction of a second, the churn
    # of quorums in which joiners and voters race.
    burst = rng.random() < 1 / 3
    lo = rng.uniform(0.0, 1.2) if burst else 0.0
    hi = lo + 0.6 if burst else 1.5
    for _ in range(rng.choice([3, 4, 5, 6, 7, 8] if burst else [0, 1, 2, 2, 3, 3, 4, 5, 6])):
        kind = rng.choice(KINDS)
        at = round(rng.uniform(lo, hi), 3)
        rank = rng.randrange(replicas * k)
        if kind in ("kill", "heal-kill"):
            faults.append(Fault(at, kind, rank))
        elif kind == "kill-call":
            faults.append(Fault(at, kind, rank, x=float(rng.randrange(12))))
        elif kind == "pause-call":
            faults.append(Fault(at, kind, rank, dur=round(rng.uniform(0.3, 3.0), 3), x=float(rng.randrange(16))))
        elif kind == "pause":
            faults.append(Fault(at, kind, rank, dur=round(rng.uniform(0.05, 3.0), 3)))
        elif kind == "slow":
            faults.append(Fault(at, kind, rank, dur=round(rng.uniform(0.1, 2.0), 3), x=float(rng.choice([5, 20, 100]))))
        elif kind == "late":
            faults.append(Fault(0.0, kind, rank, dur=round(rng.uniform(0.05, 2.0), 3)))
        elif kind == "store-down":
            faults.append(Fault(at, kind, dur=round(rng.uniform(0.05, 1.0), 3)))
        else:
            faults.append(Fault(at, kind, dur=round(rng.uniform(0.1, 1.0), 3), x=round(rng.uniform(0.002, 0.02), 4)))
    if nodes > 1 and rng.random() < 0.25 and not moves:  # (with a move too, the run would keep no majority)
        faults.append(Fault(round(rng.uniform(0.0, 1.5), 3), "node-lost", rng.randrange(1, nodes)))
    s = Schedule(seed, replicas, total, faults, k, nodes, round_steps)
    if max_restarts is not None:
        s.max_restarts, s.min_replicas = max_restarts, rng.randint(1, replicas)
        target = rng.randrange(replicas * k)
        faults += [Fault(round(rng.uniform(0.0, 2.0), 3), "kill", target) for _ in range(rng.randint(1, 3))]
    if joiners:
        s.joiners, s.join_at = rng.randint(1, 2), round(rng.uniform(0.1, 2.5), 3)
        if rng.random() < 0.5:
            faults.append(Fault(round(s.join_at + rng.uniform(0.0, 1.0), 3), "kill",
                                rng.randrange(replicas * k, (replicas + s.joiners) * k)))
    if moves:
        at = round(rng.uniform(0.1, 2.5), 3)
        faults.append(Fault(at, "host-lost"))
        if rng.random() < 0.5:  # a survivor dies around the move, or as it heals the others after it
            faults.append(Fault(round(at + rng.uniform(-0.3, 1.5), 3), rng.choice(["kill", "heal-kill"]),
                                rng.randrange(replicas * k // nodes, replicas * k)))
    if checkpoints:
        s.checkpoint_every = rng.choice([1, 2, 3, 5])
        if rng.random() < 0.5:
            faults.append(Fault(round(rng.uniform(0.2, 2.5), 3), "kill-all"))
    if spares:
        s.spares = rng.randint(1, max(1, replicas - 2))
        spare, trains = (replicas - 1) * k + rng.randrange(k), rng.randrange((replicas - s.spares) * k)
        at = round(rng.uniform(0.1, 1.5), 3)
        shape = rng.randrange(4)
        if shape == 0:  # a held spare dies (it only restarts)
            faults.append(Fault(at, "kill", spare))
        elif shape == 1:  # a training replica dies; the spare taking its place dies as it receives the state
            faults += [Fault(at, "kill", trains), Fault(at, "heal-kill", (replicas - s.spares) * k + rng.randrange(k))]
        elif shape == 2:  # two failures in one round
            other = (trains + k) % ((replicas - s.spares) * k)
            faults += [Fault(at, "kill", trains), Fault(at, "kill", other)]
        else:  # more failures than spares: none is left for the last
            faults += [Fault(round(at + 0.2 * i, 3), "kill", rng.randrange((replicas - s.spares) * k))
                       for i in range(s.spares + 1)]
        if rng.random() < 0.3:  # the spare's feed writes a state unlike its feeder's: it must be sent whole
            faults.append(Fault(0.0, "feed-bad", spare))
    if stops:
        s.stop_at = round(rng.uniform(0.05, 2.5), 3)
        if rng.random() < 0.5:  # a worker dies during the stop (the writer, the lowest holder, most often)
            faults.append(Fault(round(s.stop_at + rng.uniform(0.03, 0.15), 3), "kill",
                                0 if rng.random() < 0.5 else rng.randrange(replicas * k)))
    if guard:  # its own draw: the schedule's faults are those the seed gives without the guard
        s.check_every = random.Random(seed * 7 + 3).randint(2, 6)
    if sub_steps:  # likewise
        s.sub_steps = random.Random(seed * 11 + 5).randint(2, 3)
    return s


def schedule_line(s: Schedule) -> str:
    shape = {**({"k": s.k} if s.k > 1 else {}), **({"nodes": s.nodes} if s.nodes > 1 else {}),
             **({"round_steps": s.round_steps} if s.round_steps > 1 else {}),
             **({"max_restarts": s.max_restarts, "min_replicas": s.min_replicas} if s.max_restarts != UNLIMITED
                else {}),
             **({"joiners": s.joiners, "join_at": s.join_at} if s.joiners else {}),
             **({"stop_at": s.stop_at} if s.stop_at >= 0 else {}),
             **({"checkpoint_every": s.checkpoint_every} if s.checkpoint_every else {}),
             **({"spares": s.spares} if s.spares else {}),
             **({"check_every": s.check_every} if s.check_every else {}),
             **({"sub_steps": s.sub_steps} if s.sub_steps else {})}
    return json.dumps({"seed": s.seed, "replicas": s.replicas, **shape, "total": s.total,
                       "faults": [asdict(f) for f in s.faults]}, separators=(",", ":"))


def parse_schedule(text: str) -> Schedule:
    d = json.loads(text)
    return Schedule(int(d["seed"]), int(d["replicas"]), int(d["total"]), [Fault(**f) for f in d["faults"]],
                    int(d.get("k", 1)), int(d.get("nodes", 1)), int(d.get("round_steps", 1)),
                    int(d.get("max_restarts", UNLIMITED)), int(d.get("min_replicas", 1)),
                    int(d.get("joiners", 0)), float(d.get("join_at", 0.0)), float(d.get("stop_at", -1.0)),
                    int(d.get("checkpoint_every", 0)), int(d.get("spares", 0)), int(d.get("check_every", 0)),
                    int(d.get("sub_steps", 0)))


def shrink(s: Schedule, bug, correct=None, budget_s: float = 60.0) -> Schedule:
    """The shortest schedule found that still fails: drop faults one at a time while it fails,
    then fewer rounds. Each try is one deterministic replay. With `correct` (the product's own
    wiring), a smaller schedule counts only if the product's code passes it."""
    t0 = time.monotonic()

    def fails(trial: Schedule) -> bool:
        return run_schedule(trial, bug) is not None and (correct is None or run_schedule(trial, correct) is None)

    changed = True
    while changed and time.monotonic() - t0 < budget_s:
        changed = False
        for i in range(len(s.faults)):
            trial = replace(s, faults=s.faults[:i] + s.faults[i + 1:])
            if fails(trial):
                s, changed = trial, True
                break
    for total in range(2, s.total):
        if time.monotonic() - t0 >= budget_s:
            break
        trial = replace(s, total=total)
        if fails(trial):
            s = trial
            break
    return s


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedules", type=int, default=None, help=f"how many schedules (default {CI_SCHEDULES})")
    ap.add_argument("--seed", type=int, default=1, help="the first schedule's seed (schedule i uses seed*100000+i)")
    ap.add_argument("--soak", action="store_true", help=f"a longer exploration ({SOAK_SCHEDULES} schedules)")
    ap.add_argument("--replay", help="run one schedule, given as the line a violation prints")
    ap.add_argument("--replica-size", type=int, default=1, choices=range(1, 5), metavar="K",
                    help="workers per replica, sharding it (--replica-size of ftrun; default 1)")
    ap.add_argument("--nodes", type=int, default=1, choices=range(1, 5), metavar="N",
                    help="machines, each relaying its workers' votes and reports through its own store (default 1)")
    ap.add_argument("--round-steps", type=int, default=1, choices=range(1, 9), metavar="N",
                    help="steps per round, one vote each N steps (FTRUN_FT_ROUND_STEPS; default 1)")
    ap.add_argument("--max-restarts", type=int, default=None, choices=range(0, 6), metavar="N",
                    help="each replica's restart budget (ftrun's --max-restarts; default: none, every failure "
                         "restarts); --min-replicas is drawn per schedule")
    ap.add_argument("--joiners", action="store_true",
                    help="1-2 replicas join the running run (an elastic late node, admitted by the keeper's add_ranks)")
    ap.add_argument("--stops", action="store_true",
                    help="a stop signal reaches ftrun mid-run: a stop quorum, its writer's word, every worker stopped")
    ap.add_argument("--moves", action="store_true",
                    help="the node hosting the run's store is lost mid-run (three nodes at least): the others move "
                         "the store and the replicas rejoin there")
    ap.add_argument("--checkpoints", action="store_true",
                    help="the writer replica saves every 1-5 steps (--checkpoint-dir); half the schedules kill every "
                         "worker at once, and the run resumes from the newest complete checkpoint")
    ap.add_argument("--guard", action="store_true",
                    help="the guard on (FTRUN_FT_CHECK_STEPS 2 to 6): members compare their states every few steps "
                         "and after every heal, in one more collective at a round's top")
    ap.add_argument("--sub-steps", action="store_true",
                    help="2 or 3 optimizers stepped one after another each step (several ft.Optimizers: a GAN's D "
                         "then G), each with its own collective and vote")
    ap.add_argument("--spares", action="store_true",
                    help="the keeper holds 1 or more replicas back as hot spares (--spares of ftrun); the faults "
                         "aim at them: a spare killed while held or mid-promotion, two failures at once, more "
                         "failures than spares")
    ap.add_argument("--bug", default="none", choices=sorted(BUGS),
                    help="put a historic bug back (tests of the simulator itself)")
    ap.add_argument("--stop-at-first", action="store_true", help="stop at the first violation")
    ap.add_argument("--no-shrink", action="store_true")
    ap.add_argument("--only-bug", action="store_true",
                    help="with --bug: count only violations the product's own code does not show on that schedule")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    bug = BUGS[a.bug]
    baseline = BUGS[BASELINE.get(a.bug, "none")]
    if a.replay:
        schedules = [parse_schedule(a.replay)]
    else:
        n = a.schedules if a.schedules is not None else (SOAK_SCHEDULES if a.soak else CI_SCHEDULES)
        schedules = (make_schedule(a.seed * 100000 + i, a.replica_size, a.nodes, a.round_steps, a.max_restarts, a.joiners, a.stops, a.moves,
                                   a.checkpoints, a.spares, a.guard, a.sub_steps)
                     for i in range(n))
    t0 = time.monotonic()
    runs = violations = 0
    stats: dict = {}
    for s in schedules:
        runs += 1
        found = run_schedule(s, bug, stats)
        if found is None:
            continue
        if a.only_bug and a.bug != "none" and run_schedule(s, baseline) is not None:
            continue  # the code without this bug fails there too: not this bug's doing
        violations += 1
        print(f"violation (schedule seed {s.seed}, {len(s.faults)} faults, {time.monotonic() - t0:.1f} s in): {found}")
        small = s if a.no_shrink else shrink(s, bug, baseline if a.only_bug else None)
        again = run_schedule(small, bug)
        print(f"  shortest failing schedule: {len(small.faults)} fault(s), {small.total} rounds, "
              f"{small.replicas} replicas{f' of {small.k} workers' if small.k > 1 else ''}"
              f"{f' on {small.nodes} nodes' if small.nodes > 1 else ''}: {', '.join(map(str, small.faults)) or 'no faults'}")
        print(f"  it fails with: {again}")
        print(f"  replay: scripts/simulate.py{' --bug ' + a.bug if a.bug != 'none' else ''} "
              f"--replay '{schedule_line(small)}'")
        sys.stdout.flush()
        if a.stop_at_first:
            break
    if not a.quiet:
        print(f"explored in {time.monotonic() - t0:.1f} s; the slowest run that passed finished "
              f"{stats.get('after_last_fault_s', 0.0):.1f} virtual s after its last fault "
              f"(the bound: {PROGRESS_BOUND_S:g} s)")
    print(f"{runs} schedules, {violations} violations")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
