"""The quorum keeper of --ft: the supervisor decides who takes part, and speaks for the dead.

On several machines the keeper of the node hosting the store (the leader,
node 0 until the store moves) keeps the quorum of every global rank; the
other nodes' keepers only report their replicas' births and deaths to it
through a store queue, and read the epochs it publishes. After the store
moved, a new keeper starts on it: the replicas rejoin saying which step they
hold, and the first epoch heals them all from the one with the newest whole
step.

Members are workers (global ranks). With --replica-size K a replica is the
K workers of ranks jK .. jK+K-1: it is admitted only once all K have asked to
join with the same incarnation, it leaves as a whole when any of them dies
(the supervisor kills the others), and it heals as a whole (all K ranks are
healers, or none).

It publishes an epoch (members, and which of them must heal) whenever
membership changes: when every first replica has asked to join, when a
restarted replica asks to join, and when a member dies. For a member that
died it abstains in the rounds its peers may be waiting on (the two after
the newest decided round), so those rounds close on the survivors' own votes
and they move on without it; a round its vote closes, it decides. On several
nodes, static or elastic, that vote goes through the member's node's store (the votes are
relayed per node, ftrun.supervisor.relay) while the node answers. It
deletes the keys of finished rounds and old epochs, so the store does not
grow with the run. Status figures come back from the replicas' info keys, or
on several nodes from one key per relaying node (node_info_key),
where the node's ftrun copies its replicas' reports.
Must never import torch (it talks to the store through RunStore), and never
touch processes.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Set, Tuple

from ftrun import protocol as keys
from ftrun.protocol import EVENTS, Epoch
from ftrun.supervisor.quorum_collect import KeyCollection
from ftrun.supervisor.quorum_status import Pace, StatusReports
from ftrun.supervisor.quorum_votes import DeadVotes
from ftrun.supervisor.relay import Routes

# How long an epoch that starts from nothing (the first, or one after every replica was lost)
# waits for the replicas being started: one that began alone would train on its own gradients
# until the others caught up, and a resumed run would not be the run it resumes.
FIRST_EPOCH_WAIT_S = 30.0
PACE_EVERY_S = 0.25  # the run's pace is sampled as often as the replicas report


@dataclass(frozen=True)
class KeeperSettings:
    """What the keeper takes from the environment, read once (the simulator passes its own)."""

    round_steps: int = keys.ROUND_STEPS
    round_steps_chosen: bool = False  # the user set the round length: it is kept, not paced
    note: Optional[str] = None  # a line saying why the environment's value was not taken

    @staticmethod
    def from_env(env: Mapping[str, str]) -> "KeeperSettings":
        steps, why = keys.round_steps_from_env(env)
        return KeeperSettings(steps, why is None and keys.ROUND_STEPS_ENV in env, why)


class QuorumKeeper(DeadVotes, KeyCollection, StatusReports):
    """Epochs: who takes part, who heals, from which round; the events that change them."""

    def __init__(self, store, ranks: List[int], local_ranks: Optional[List[int]] = None, leader: bool = True,
                 replica_size: int = 1, routes: Optional[Routes] = None, settings: Optional[KeeperSettings] = None,
                 clock: Callable[[], float] = time.time) -> None:
        # Time comes in: poll(now) is given it, and the events between polls (a death) read `clock`,
        # the same clock the supervisor passes to poll (the simulator passes its virtual one).
        self.clock = clock
        self.store = store  # RunStore; its .store is the TCPStore once ready
        # Several nodes: the nodes whose members vote through their node's store (ftrun.supervisor.relay).
        self.routes = routes
        self._node_added: Dict[Tuple[int, int, int], List[int]] = {}  # (node, epoch, round) -> the keeper's votes there
        self._orphan_seen: Dict[Tuple[int, int, int], float] = {}
        self.k = replica_size
        self.ranks = sorted(ranks)              # every replica of the run (all nodes)
        self.local = set(local_ranks if local_ranks is not None else ranks)
        self.leader = leader
        self.epoch_id = 0
        self.members: Dict[int, int] = {}
        self.rejoined: List[Tuple[int, int]] = []  # (rank, incarnation) booked in place, for the supervisor
        self.healed: Set[Tuple[int, int]] = set()
        self.pending: Dict[int, int] = {}
        self.alive: Dict[int, Optional[int]] = {r: 0 for r in ranks}
        self.info: Dict[int, dict] = {}
        self.pending_since: Optional[float] = None  # the first join of the epoch being formed
        self.ready, self.history = False, []
        settings = settings if settings is not None else KeeperSettings.from_env(os.environ)
        self.round_steps = settings.round_steps
        if settings.note:
            self.history.append(settings.note)
        # A round length the user chose is kept; the default follows the run's pace (Pace).
        self.round_steps_chosen = settings.round_steps_chosen
        self.pace = Pace()
        self._dead_pending: List[Tuple[int, int]] = []
        # Members that died while listed in an epoch, and the rounds abstained for them,
        # kept up to two rounds past the newest decided one on every poll
        # vote, for as long as some live replica may still be in an epoch that lists them.
        self.dead: Dict[Tuple[int, int], Dict[int, Set[int]]] = {}  # -> epoch -> rounds abstained
        self.starts: Dict[int, int] = {}  # epoch -> start round, for epochs the keeper started afresh
        self.voting_since: Dict[int, Tuple[Tuple[object, object], float]] = {}
        self.unstuck: Set[Tuple[int, int, int, int]] = set()
        self._collected_at, self._collected_when = -2, float("-inf")
        self.epochs: Dict[int, Set[Tuple[int, int]]] = {}
        # Per epoch, the rounds below this one had their keys collected: nobody waits on them, and
        # a vote there would start a fresh counter and write a second decision of a decided round.
        self.collected_below: Dict[int, int] = {}
        self.finished_members: Set[Tuple[int, int]] = set()  # incarnations that left the loop (exit 0)
        # When each replica's info last changed (by this keeper's clock): a replica whose
        # reports stopped says nothing true about what it is doing now.
        self.info_seen: Dict[int, float] = {}
        self._info_raw: Dict[int, object] = {}  # the raw text of its own key, or the object its node relayed
        self._relayed_raw: Dict[int, bytes] = {}  # node -> its reports key as last read
        # Since when the others have been waiting for each replica, continuously.
        self.waited_since: Dict[int, float] = {}
        # Started on a store that moved (ftrun.supervisor.failover): its first epoch takes the
        # state from the replica that says it holds the newest whole step (_survivors_source).
        self.moved = False
        # On a moved store, the ranks the first epoch waits for: the last epoch's members. A
        # newcomer still starting joins the epoch after (the others need not wait for its import).
        self.awaited: Optional[Set[int]] = None
        # What a fresh epoch after the first means for the run (said once, in its history line).
        self.fresh_start = "starting again from the first step"
        self.fresh_epochs: Set[int] = set()  # epochs after the first that no holder of the trained state was in
        # A stop signal with --checkpoint-dir (stop()): every epoch from then on is a stop epoch.
        self.stopping = False
        self.epoch_steps, self.repace_after = self.round_steps, float("-inf")  # the newest epoch's (_repace)

    # ------------------------------------------------------------ store
    @property
    def _s(self):
        return self.store.store

    def on_store_ready(self) -> None:
        s = self._s
        if not self.leader:
            self.ready = True
            for r in self.local:
                inc = self.alive.get(r)
                if inc is not None:
                    self._report(r, inc, "spawn")
            for r, k in self._dead_pending:
                self._report(r, k, "died")
            self._dead_pending.clear()
            return
        s.compare_set(keys.TOP, "", "-1")
        for r in self.ranks:
            s.compare_set(keys.join_key(r), "", "-1")
            s.compare_set(keys.healed_key(r), "", "-1")
            s.compare_set(keys.entered_key(r), "", "-1")
            if self._node_of(r) is None:
                s.compare_set(keys.info_key(r), "", "{}")
            if r in self.local:
                inc = self.alive.get(r)
                s.set(keys.inc_key(r), "dead" if inc is None else str(inc))
            else:
                s.compare_set(keys.inc_key(r), "", "0")
        for k in self.routes.nodes if self.routes is not None else []:
            s.compare_set(keys.node_info_key(k), "", "{}")
        # Last: followers read every rank's keys once LATEST exists. Above 0 on a store that
        # moved (ftrun.supervisor.failover): epochs go on counting from the lost store's.
        s.compare_set(keys.LATEST, "", str(self.epoch_id))
        self.ready = True
        for r, k in self._dead_pending:
            self.on_exit(r, k)
        self._dead_pending.clear()

    def add_ranks(self, ranks: List[int], relay: Optional[Tuple[int, str]] = None) -> None:
        """A node joined the running run (elastic c10d): its replicas become ranks of the quorum,
        voting and reporting through its store when it has one (`relay`: its node and store's
        host:port). The leader creates their keys first: every poll reads them all at once."""
        new = [r for r in ranks if r not in self.ranks]
        if relay is not None:
            if self.routes is None:
                self.routes = Routes({})
            self.routes.add(relay[0], relay[1], new)
        if self.leader and self.ready:
            s = self._s
            for r in new:
                s.compare_set(keys.join_key(r), "", "-1")
                s.compare_set(keys.healed_key(r), "", "-1")
                s.compare_set(keys.entered_key(r), "", "-1")
                if relay is None:
                    s.compare_set(keys.info_key(r), "", "{}")
                s.compare_set(keys.inc_key(r), "", "0")
            if relay is not None:
                s.compare_set(keys.node_info_key(relay[0]), "", "{}")
        for r in new:
            self.alive.setdefault(r, 0)
        self.ranks = sorted(self.ranks + new)

    # ------------------------------------------------------------ events from the supervisor
    def _report(self, rank: int, inc: int, what: str) -> None:
        """A follower node tells the leader about its replica. Node 0 may be gone (the nodes'
        watch reports that, and the agent stops): the word is then lost, not raised."""
        try:
            if what == "spawn":
                self._s.set(keys.inc_key(rank), str(inc))
            self._s.queue_push(EVENTS, f"{rank} {inc} {what}")
        except Exception as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
            self.history.append(f"could not tell node 0 that rank {rank} {what if what != 'spawn' else 'started'} "
                                f"({first})")

    def on_spawn(self, rank: int, inc: int) -> None:
        self.alive[rank] = inc
        if self.ready:
            if self.leader:
                self._s.set(keys.inc_key(rank), str(inc))
            else:
                self._report(rank, inc, "spawn")

    def on_exit(self, rank: int, inc: int, finished: bool = False) -> None:
        """A replica incarnation died (or finished): take it out and vote for it where it can't."""
        if self.alive.get(rank) == inc:
            self.alive[rank] = None
        if not self.ready:
            if not finished:
                self._dead_pending.append((rank, inc))
            return
        if not self.leader and rank in self.local:
            self._report(rank, inc, "finished" if finished else "died")
            return
        mates = self._mates(rank)
        for m in mates:  # a replica joins whole: one worker less and it waits for its next incarnation
            self.pending.pop(m, None)
        if self.members.get(rank) == inc:
            if finished:  # it left the loop with the others: it never votes again (_elsewhere)
                del self.members[rank]
                self.finished_members.add((rank, inc))
                return
            # The replica leaves whole: its other workers are being killed and its shard groups
            # are broken, so nobody may wait for any of them.
            leaving = {m: self.members.pop(m) for m in mates if m in self.members}
            if self.members:
                self._publish(f"rank {rank} left" if self.k == 1 else
                              f"replica {rank // self.k} left (rank {rank} of ranks {mates[0]}-{mates[-1]})")
            top = self._top()
            now = self.clock()
            for m, k in leaving.items():
                if m != rank:
                    self._s.set(keys.inc_key(m), "dead")  # peers forming a group with it give up now
                self._fill_votes(m, k, top, now)
        if self.alive.get(rank) is None:
            self._s.set(keys.inc_key(rank), "dead")

    def on_node_lost(self, node: int, ranks: List[int]) -> None:
        """Node `node` is lost (the supervisor's node watch said so), its store and its workers
        `ranks` with it. Its members are voted for in the run's store from now on, and so again
        are the rounds this keeper had voted in through that store for its members that died
        before: those votes may never have been forwarded (their node's last voter died before
        forwarding, found by the simulator), and a round short of them would wait for ever. A
        vote counted twice is decided by its votes (_close_orphaned), as after any double vote."""
        if self.routes is not None:
            self.routes.lose(node)
            for (m, _), filled in self.dead.items():
                if self.routes.node_of(m) == node:
                    filled.clear()
        for rank in ranks:
            inc = self.alive.get(rank)
            if inc is not None:
                self.on_exit(rank, inc)

    def _mates(self, rank: int) -> List[int]:
        """The ranks of `rank`'s replica, itself included."""
        first = rank - rank % self.k
        return list(range(first, first + self.k))

    def _top(self) -> int:
        return int(self._s.get(keys.TOP))

    # ------------------------------------------------------------ polling
    def _drain_events(self) -> None:
        s = self._s
        for _ in range(s.queue_len(EVENTS)):
            rank, inc, what, *nxt = s.queue_pop(EVENTS, False).decode().split()
            rank, inc = int(rank), int(inc)
            if what == "rejoin":
                self._rejoin(rank, inc, int(nxt[0]))
            elif what == "spawn":
                self.alive[rank] = inc
                s.set(keys.inc_key(rank), str(inc))  # after any "died" of the previous incarnation
            else:
                self.on_exit(rank, inc, finished=what == "finished")

    def _follow(self) -> None:
        """A follower reads what the leader decided, for status and hang detection."""
        s = self._s
        latest = int(s.get(keys.LATEST)) if s.check([keys.LATEST]) else 0
        if latest != self.epoch_id and latest > 0:
            epoch = Epoch.from_json(s.get(keys.epoch_key(latest)))
            self.epoch_id = latest
            self.members = dict(epoch.members)
        healed, infos = self._read_with_reports([keys.healed_key(r) for r in self.ranks])
        self._absorb(healed, infos, self.clock())

    def poll(self, now: float) -> None:
        if not self.ready:
            return
        if not self.leader:
            if self._s.check([keys.LATEST]):
                self._follow()
            return
        self._drain_events()
        top = self._top()
        if self.dead:
            self._refill(top, now)
        self._collect(top, now)
        n = len(self.ranks)
        vals, infos = self._read_with_reports([keys.join_key(r) for r in self.ranks]
                                              + [keys.healed_key(r) for r in self.ranks])
        self._absorb(vals[n:], infos, now)
        if now - self.pace.noted_at >= PACE_EVERY_S:  # global_step() reads every report: not at every tick
            self.pace.note(now, self.global_step())
        self._unstick(now, top)
        if self.stopping:  # nobody joins a run that is stopping
            return
        asked: Dict[int, int] = {}
        for r, j in zip(self.ranks, vals[:n]):
            inc = self.alive.get(r)
            if inc is not None and int(j) == inc and r not in self.members and r not in self.pending:
                asked[r] = inc
        for r, inc in asked.items():
            # A replica is admitted whole: every one of its workers asked, as the same incarnation.
            if all(asked.get(m) == inc for m in self._mates(r)):
                self.pending[r] = inc
        if not self.pending:
            self.pending_since = None
            self._repace(now)
            return
        if self.pending_since is None:
            self.pending_since = now
        if self.epoch_id == 0 or not self.members:
            waiting_for = [r for r in self.ranks if self.alive.get(r) is not None and r not in self.pending
                           and (self.awaited is None or r in self.awaited)]
            if waiting_for and now - self.pending_since < FIRST_EPOCH_WAIT_S:
                return
            self._publish("first replicas joined" if self.epoch_id == 0 else
                          f"rank{'s' if len(self.pending) > 1 else ''} {', '.join(map(str, sorted(self.pending)))} joined")
        else:
            self._publish(f"rank{'s' if len(self.pending) > 1 else ''} {', '.join(map(str, sorted(self.pending)))} joined")

    def stop(self) -> Optional[int]:
        """A stop signal: publish a stop epoch (protocol.Epoch.stop), at whose switch every member
        stops and the writer replica saves the step it holds. The writer (a replica holding the
        trained state, on this node where one is) or None: no epoch yet, or nobody holds it."""
        if not self.leader or not self.ready or self.epoch_id == 0 or not self.members:
            return None
        self.stopping = True
        self._publish("a stop signal: the last committed step is saved, then every worker stops")
        writer = Epoch.from_json(self._s.get(keys.epoch_key(self.epoch_id))).writer
        return writer if writer >= 0 else None

    def _paced_steps(self) -> int:
        """Steps per round of an epoch published now: the user's choice, else about ROUND_TARGET_S
        at the run's pace (8 while it is not known: rounds of one step would be paced by their
        own votes, slow where the store is, and never grow)."""
        if self.round_steps_chosen:
            return self.round_steps
        return keys.round_steps_for(self.pace.step_s(), self.round_steps)

    def _repace(self, now: float) -> None:
        """As soon as the pace is known, rounds far from ROUND_TARGET_S (over twice as long: a stop
        signal, taken at a round's top, would wait seconds of 8 slow steps; under a quarter and
        shorter than allowed: the votes cost) get an epoch of the same members with rounds
        re-sized, said nowhere: not only after a failure. Only with every member in the epoch and
        holding the state (nobody heals again), once per pace window (a swinging pace rebuilds
        no groups)."""
        step_s = self.pace.step_s()
        if step_s is None or self.round_steps_chosen or not self.members or now < self.repace_after:
            return
        want, round_s = self._paced_steps(), self.epoch_steps * step_s
        if want == self.epoch_steps or keys.ROUND_TARGET_S / 4 <= round_s <= 2 * keys.ROUND_TARGET_S:
            return
        for r, inc in self.members.items():
            info = self.info.get(r) or {}
            if ((r, inc) not in self.healed or info.get("inc") != inc or info.get("epoch") != self.epoch_id
                    or not self._fresh(r, now)):
                return
        self.repace_after = now + self.pace.WINDOW_S
        self._publish("", quiet=True)

    def _publish(self, why: str, quiet: bool = False) -> None:
        if self.stopping:
            self._publish_stop(why)
            return
        s = self._s
        # Members that have entered an epoch switch by their votes; the others are still joining.
        entered = s.multi_get([keys.entered_key(r) for r in self.members])
        continuing = {r: k for (r, k), e in zip(self.members.items(), entered) if int(e) == k}
        self.members.update(self.pending)
        self.pending.clear()
        self.pending_since = None
        # Read who holds the committed state now, not as of the last poll: a replica
        # that healed a moment ago must not be taken for one that has nothing.
        healed = s.multi_get([keys.healed_key(r) for r in self.members])
        for r, h in zip(self.members, healed):
            if int(h) >= 0:
                self.healed.add((r, int(h)))
        # A replica holds the state only if every one of its workers holds its shard of it.
        holders = [r for r in self.members
                   if all((m, self.members.get(m)) in self.healed for m in self._mates(r))]
        source = self._survivors_source() if self.moved and not holders else None
        self.moved = False
        if source is not None:
            # The store moved: nobody holds the state in this store yet, and every replica holds
            # what it held then. One replica's state, the newest whole step, goes to all.
            holders = self._mates(source * self.k)
            why = (f"the replicas rejoined on the moved store; replica {source} holds the newest step "
                   f"and heals the others")
        fresh = self.epoch_id == 0 or not holders
        self.epoch_id += 1
        members = tuple(sorted(self.members.items()))
        start = -1
        if not continuing:  # rounds are numbered across epochs: start after the newest one decided
            start = self._top() + 1
        steps = self.epoch_steps = self._paced_steps()
        if fresh:
            src = min(self.members) // self.k  # the lowest replica sends its state, shard by shard
            epoch = Epoch(self.epoch_id, members, tuple(sorted(r for r in self.members if r // self.k != src)),
                          True, start, steps)
            if self.epoch_id > 1:
                why += f"; no replica holding the trained state is left: {self.fresh_start}"
                self.fresh_epochs.add(self.epoch_id)
        else:
            epoch = Epoch(self.epoch_id, members, tuple(sorted(r for r in self.members if r not in holders)),
                          False, start, steps)
        self.epochs[self.epoch_id] = set(members)
        self.starts[self.epoch_id] = start
        s.set(keys.epoch_key(self.epoch_id), epoch.to_json())
        s.set(keys.LATEST, str(self.epoch_id))
        n = len(members) // self.k
        shape = f" of {self.k} workers" if self.k > 1 else ""
        rounds = f", rounds of {steps} step{'s' if steps != 1 else ''}" if steps != self.round_steps else ""
        if not quiet:
            self.history.append(f"quorum {self.epoch_id}: {n} replica{'s' if n != 1 else ''}{shape} ({why}){rounds}")

    def _publish_stop(self, why: str) -> None:
        """A stop epoch of the members there are now (nobody joins any more): the writer is the
        lowest replica whose every worker holds the trained state, on this node where one does
        (its workers are the last this node's ftrun stops)."""
        s = self._s
        entered = s.multi_get([keys.entered_key(r) for r in self.members])
        continuing = any(int(e) == k for (r, k), e in zip(self.members.items(), entered))
        healed = s.multi_get([keys.healed_key(r) for r in self.members])
        for r, h in zip(self.members, healed):
            if int(h) >= 0:
                self.healed.add((r, int(h)))
        holders = sorted({r // self.k for r in self.members
                          if all((m, self.members.get(m)) in self.healed for m in self._mates(r))})
        local = [rep for rep in holders if rep * self.k in self.local]
        writer = (local or holders or [-1])[0]
        self.epoch_id += 1
        members = tuple(sorted(self.members.items()))
        start = -1 if continuing else self._top() + 1
        epoch = Epoch(self.epoch_id, members, (), False, start, 1, stop=True, writer=writer)
        self.epochs[self.epoch_id] = set(members)
        self.starts[self.epoch_id] = start
        s.set(keys.epoch_key(self.epoch_id), epoch.to_json())
        s.set(keys.LATEST, str(self.epoch_id))
        saver = f"replica {writer} saves" if writer >= 0 else "no replica holds the trained state: nothing to save"
        self.history.append(f"quorum {self.epoch_id}: stop ({why}; {saver})")

    def _survivors_source(self) -> Optional[int]:
        """After the store moved, replicas rejoin holding what they held then: each says which
        step (keys.survivor_key). The source is the replica whose workers all hold the same
        newest step (a step that some took and others did not, as the old store went down mid-
        round, is a step whose collectives went through: every gradient had every part); the
        others heal from it. None when no replica is whole (every one was healing, or none said)."""
        s = self._s
        said: Dict[int, dict] = {}
        for r in list(self.members):
            if not s.check([keys.survivor_key(r)]):  # a replica started since the move says nothing
                continue
            try:
                d = json.loads(s.get(keys.survivor_key(r)))
            except ValueError:
                d = None
            s.delete_key(keys.survivor_key(r))  # read once: later epochs are ordinary ones
            if isinstance(d, dict) and d.get("inc") == self.members[r] and d.get("in_sync"):
                said[r] = d
        whole = {}
        for rep in sorted({r // self.k for r in said}):
            steps = {int(said[m]["step"]) if m in said else None for m in self._mates(rep * self.k)}
            if len(steps) == 1 and None not in steps:
                whole[rep] = steps.pop()
        if not whole:
            return None
        return max(whole, key=lambda rep: (whole[rep], -rep))

def now() -> float:
    return time.time()
