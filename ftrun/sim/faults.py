"""A simulated run's faults, carried out as its schedule says: kills, kills and pauses at a process's
n-th store call, pauses, slow processes, late starts, a store down or slow, nodes and the
store's host lost. One thread of the scheduler walks the schedule; the store calls on_call()
before each call while a call-counted fault is armed.
Must never decide what the run does about a fault (the simulated supervisor does), nor be
imported by the product.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple


class Faults:
    def __init__(self, world: Any) -> None:  # sim/world.World, which imports this module
        self.w = world
        self.sched, self.sch = world.sched, world.sch
        self.heal_kill: Dict[int, bool] = {}  # rank -> killed as it next sends or receives state
        self.call_kill: Dict[str, int] = {}  # proc -> store calls it makes before it is killed at the next
        self.call_pause: Dict[int, Tuple[int, float]] = {}  # rank -> (store calls before the pause, its length)
        self.feed_bad: Dict[int, bool] = {}  # rank -> a hot spare whose feed wrote a state unlike the feeder's
        # on_call is the store's on_call while a kill-call or pause-call is armed (None: no function
        # call per store call in the common turn).
        self.last_fault_end = max([f.at + f.dur for f in world.sch.faults], default=0.0)

    def on_call(self, proc: str) -> None:
        if not self.call_pause and not self.call_kill:
            self.w.store.on_call = None  # nothing armed any more
            return
        rank = int(proc[1:].split(".")[0]) if proc.startswith("r") else -1
        pause = self.call_pause.get(rank)
        if pause is not None:
            if pause[0] > 0:
                self.call_pause[rank] = (pause[0] - 1, pause[1])
            else:
                del self.call_pause[rank]
                self.sched.pause(proc, self.sched.now + pause[1])
                self.sched.sleep(0.0)  # stopped before its call takes effect
        left = self.call_kill.get(proc)
        if left is None:
            return
        if left > 0:
            self.call_kill[proc] = left - 1
            return
        del self.call_kill[proc]
        self.w.supervisor.kill(int(proc[1:].split(".")[0]))
        self.sched.block()  # the caller dies here: its call never reaches the store

    def run(self) -> None:
        for f in sorted(self.sch.faults, key=lambda f: f.at):
            self.sched.sleep(f.at - self.sched.now)
            m = self.w.supervisor.members.get(f.rank)
            proc = m.proc if m is not None else f"r{f.rank}.?"
            if f.kind == "kill":
                self.w.supervisor.kill(f.rank)
            elif f.kind == "kill-call":
                if m is not None and f.rank not in self.w.supervisor.done:
                    self.call_kill[m.proc] = int(f.x)
                    self.w.store.on_call = self.on_call
            elif f.kind == "feed-bad":
                self.feed_bad[f.rank] = True
            elif f.kind == "heal-kill":
                self.heal_kill[f.rank] = True
            elif f.kind == "pause-call":
                self.call_pause[f.rank] = (int(f.x), f.dur)
                self.w.store.on_call = self.on_call
            elif f.kind == "pause":
                self.sched.pause(proc, self.sched.now + f.dur)
            elif f.kind == "slow":
                self.sched.slow[proc] = f.x
                self.w.supervisor.events.append((self.sched.now + f.dur, "noop", f.rank, -1))
            elif f.kind == "store-down":
                self.w.store.down_until = self.sched.now + f.dur
            elif f.kind == "store-slow":
                self.w.store.extra_latency = f.x
            elif f.kind == "node-lost":
                self.w.supervisor.lose_node(f.rank)
            elif f.kind == "host-lost":
                self.w.supervisor.host_lost()
            elif f.kind == "kill-all":
                for r in sorted(self.w.supervisor.members):
                    self.w.supervisor.kill(r)
        self.sched.sleep(max(0.0, self.last_fault_end - self.sched.now))
        self.sched.slow.clear()
        self.w.store.extra_latency = 0.0
