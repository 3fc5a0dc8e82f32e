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
from collections import deque
from dataclasses import dataclass
from typing import Callable, Deque, Dict, List, Mapping, Optional, Set, Tuple

from ftrun import protocol as keys
from ftrun.protocol import EVENTS, Epoch
from ftrun.supervisor.relay import Routes

# How long an epoch that starts from nothing (the first, or one after every replica was lost)
# waits for the replicas being started: one that began alone would train on its own gradients
# until the others caught up, and a resumed run would not be the run it resumes.
FIRST_EPOCH_WAIT_S = 30.0
COLLECT_EVERY_S = 0.25  # one list_keys per status report: a few dozen keys of rounds in flight at most
ROUND_KEYS_KEPT = 4  # keys of this many rounds behind the newest decided one stay in the store
PACE_EVERY_S = 0.25  # the run's pace is sampled as often as the replicas report
INFO_FRESH_S = 1.0  # a replica reports every 0.25 s: silent for longer, its last report is stale
STUCK_S = 2.0  # a member waiting this long for a vote of a member that is in another epoch


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


class QuorumKeeper:
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
        self.healed: Set[Tuple[int, int]] = set()
        self.pending: Dict[int, int] = {}
        self.alive: Dict[int, Optional[int]] = {r: 0 for r in ranks}
        self.info: Dict[int, dict] = {}
        self.pending_since: Optional[float] = None  # the first join of the epoch being formed
        self.ready = False
        self.history: List[str] = []
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
        self._collected_at = -2
        self._collected_when = float("-inf")
        self.epochs: Dict[int, Set[Tuple[int, int]]] = {}
        # Per epoch, the rounds below this one had their keys collected: nobody waits on them, and
        # a vote there would start a fresh counter and write a second decision of a decided round.
        self.collected_below: Dict[int, int] = {}
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
            if finished:  # it left the loop with the others: nobody waits for it
                del self.members[rank]
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

    def _mates(self, rank: int) -> List[int]:
        """The ranks of `rank`'s replica, itself included."""
        first = rank - rank % self.k
        return list(range(first, first + self.k))

    def _top(self) -> int:
        return int(self._s.get(keys.TOP))

    def _add_vote(self, e: int, rnd: int, top: int, vote: int, member: int) -> bool:
        """Add a vote in `member`'s place to round `rnd` of epoch `e`; decide the round if it
        closes it, as a member would (commit: no failed vote, one ok at least). Through the
        member's node while that node relays and answers (ftrun.supervisor.relay): an add that
        completes the node's count forwards it, as the node's last voter would. Only a node the
        supervisor declared lost has its members' votes go to the run's store: a node store that
        does not answer now is tried again at the next poll (False: not cast), since the node's
        own count could never complete without this vote."""
        node = self.routes.node_of(member) if self.routes is not None else None
        if node is None or node in self.routes.lost:
            self._add_run_vote(e, rnd, top, vote)
            return True
        local = self._node_client(node)
        if local is None:
            return False
        try:
            total = local.add(keys.node_count_key(node, e, rnd), vote)
        except Exception:
            self.routes.drop(node)  # a new connection next time
            return False
        self._node_added.setdefault((node, e, rnd), []).append(vote)
        if keys.tally(total).votes == self._node_size(e, node):
            self._forward(node, local, e, rnd, top, total)
        return True

    def _add_run_vote(self, e: int, rnd: int, top: int, total: int) -> None:
        t = keys.tally(self._s.add(keys.count_key(e, rnd), total))
        if t.votes == len(self.epochs[e]):  # this closed the round: nobody else decides it
            self._decide(e, rnd, top, t.commit)

    def _node_client(self, node: Optional[int]):
        if node is None:
            return None
        try:
            return self.routes.client(node)
        except Exception:
            self.routes.drop(node)
            return None

    def _node_size(self, e: int, node: int) -> int:
        ranks = self.routes.ranks(node)
        return sum(1 for r, _ in self.epochs[e] if r in ranks)

    def _forward(self, node: int, local, e: int, rnd: int, top: int, total: int) -> None:
        """Forward a node's completed count to the run's store in place of its last voter; the
        decision reaches the node's members through its relay (ftrun.supervisor.relay.NodeRelay)."""
        self._add_run_vote(e, rnd, top, total)
        local.set(keys.node_forwarded_key(node, e, rnd), "1")

    def _close_orphaned_node(self, member: int, e: int, rnd: int, top: int, now: float) -> None:
        """A dead member's node counted every vote of the round but never marked it forwarded:
        the member may have been that node's last voter and died before forwarding. After
        STUCK_S (a live forwarder marks it within a store round trip) the keeper forwards the
        node's count less its own votes. Had the dead forwarder reached the run's store after
        all, the round is over-counted and decided by _close_orphaned, as after any double vote."""
        node = self.routes.node_of(member) if self.routes is not None else None
        local = self._node_client(node)
        if local is None:
            return
        where = (node, e, rnd)
        try:
            total = local.add(keys.node_count_key(node, e, rnd), 0)
            size = self._node_size(e, node)
            excess = keys.tally(total).votes - size
            if excess < 0 or local.check([keys.node_forwarded_key(node, e, rnd)]):
                self._orphan_seen.pop(where, None)
                return
            since = self._orphan_seen.setdefault(where, now)
            if now - since < STUCK_S:
                return
            self._orphan_seen.pop(where, None)
            # The votes past the node's size are the keeper's own, for members that had voted themselves.
            mine = self._node_added.get(where, [])
            self._forward(node, local, e, rnd, top, total - sum(mine[len(mine) - excess:] if excess else []))
            self.history.append(f"round {rnd}: rank {member} died before it forwarded node {node}'s votes; "
                                f"forwarded them in its place")
        except Exception:  # tried again at the next poll
            self.routes.drop(node)

    def _decide(self, e: int, rnd: int, top: int, commit: bool) -> None:
        s = self._s
        kept = 0 if commit else keys.read_kept(s, e, rnd)
        s.compare_set(keys.decision_key(e, rnd), "", keys.decision_text(commit, self.epoch_id, kept))
        if rnd > top:
            s.set(keys.TOP, str(rnd))

    def _close_orphaned(self, e: int, rnd: int, top: int) -> None:
        """A round every member voted in but nobody decided: its closer died between its vote
        and its decision. Decide it by its votes, as the closer would have (members that voted
        ok have stepped already; compare_set: a decision already written stands)."""
        s = self._s
        t = keys.tally(s.add(keys.count_key(e, rnd), 0))
        if t.votes >= len(self.epochs[e]) and not s.check([keys.decision_key(e, rnd)]):
            self._decide(e, rnd, top, t.commit)

    def _rounds_of(self, e: int, top: int) -> Set[int]:
        """Rounds of epoch `e` its live members may be waiting on: the two after the newest
        decided one, its start, and the round each live member in it last reported."""
        rounds = {top + 1, top + 2}
        if self.starts.get(e, -1) >= 0:
            rounds |= {self.starts[e], self.starts[e] + 1}
        for r, inc in self.alive.items():
            info = self.info.get(r) or {}
            if inc is not None and info.get("inc") == inc and info.get("epoch") == e and "round" in info:
                rounds |= {int(info["round"]), int(info["round"]) + 1}
        return rounds

    def _fill_votes(self, rank: int, inc: int, top: int, now: float) -> None:
        """Abstain for a dead member in the rounds its peers may be waiting on, in every
        epoch that lists it and that live members may still be in or enter. Not a failed
        vote: the live members' own votes say whether the round's collectives went through
        (if the dead one had sent its part, they did), and those that voted ok have stepped.
        Sharded replicas (--replica-size > 1) wait for the decision before stepping: for them
        the dead member's vote is a failed one, as it was before the vote left the critical
        path. A dead member's own vote may count besides the keeper's; a failed one then
        discards a round nobody has stepped past, where an abstention could commit a round
        whose other shard failed, and the replica holding that shard would restart whole."""
        vote = keys.ABSTAIN_VOTE if self.k == 1 else keys.FAIL_VOTE
        filled = self.dead.setdefault((rank, inc), {})
        oldest = min(self._live_epochs(), default=0) if self._all_live_report() else 0
        for e, members in self.epochs.items():
            if (rank, inc) not in members or e < oldest:
                continue
            done = filled.setdefault(e, set())
            rounds = {r for r in self._rounds_of(e, top) if r >= self.collected_below.get(e, -1)}
            for rnd in sorted(rounds - done):
                if self._add_vote(e, rnd, top, vote, rank):
                    done.add(rnd)
            for rnd in sorted(rounds & done):
                self._close_orphaned_node(rank, e, rnd, top, now)
                self._close_orphaned(e, rnd, top)

    def _unstick(self, now: float, top: int) -> None:
        """A member that has waited STUCK_S for a round's decision while another member of
        its epoch reports being in another epoch (or, still joining, in none while a newer
        epoch is out) would wait forever: that member will never vote there. Vote FAIL in its
        place (the round fails; everyone moves on)."""
        for v in self.ranks:
            info = self.info.get(v) or {}
            inc = self.alive.get(v)
            where = (info.get("epoch"), info.get("round"))
            if (inc is None or info.get("inc") != inc or info.get("phase") != "vote" or not self._fresh(v, now)
                    or where[0] not in self.epochs):
                self.voting_since.pop(v, None)
                continue
            since = self.voting_since.get(v)
            if since is None or since[0] != where:
                self.voting_since[v] = (where, now)
                continue
            if now - since[1] < STUCK_S:
                continue
            e, rnd = int(where[0]), int(where[1])
            for m, k in self.epochs[e]:
                mi = self.info.get(m) or {}
                if self._elsewhere(m, k, e, now) and (m, k, e, rnd) not in self.unstuck:
                    if not self._add_vote(e, rnd, top, keys.FAIL_VOTE, m):
                        continue  # its node's store did not answer: again at the next poll
                    self.unstuck.add((m, k, e, rnd))
                    at = f"in quorum {mi['epoch']}" if mi.get("epoch") is not None else "still joining"
                    self.history.append(f"rank {m} is {at} while quorum {e} waits for its "
                                        f"vote in round {rnd}: voted fail in its place")

    def _elsewhere(self, m: int, k: int, e: int, now: float) -> bool:
        """Whether member (m, k) of epoch `e` will never vote there: it reports being in another
        epoch; or in none yet while a newer one is published (a joining replica enters the
        newest epoch, never this older one that listed it)."""
        mi = self.info.get(m) or {}
        return (self.alive.get(m) == k and mi.get("inc") == k and self._fresh(m, now)
                and (mi.get("epoch") not in (None, e) or (mi.get("epoch") is None and e < self.epoch_id)))

    def _all_live_report(self) -> bool:
        """Every live replica's newest report, of its own incarnation, names the epoch it is in."""
        for r, inc in self.alive.items():
            info = self.info.get(r) or {}
            if inc is not None and not (info.get("inc") == inc and info.get("epoch")):
                return False
        return True

    def _live_epochs(self) -> Set[int]:
        live = set()
        for r, inc in self.alive.items():
            info = self.info.get(r) or {}
            if inc is not None and info.get("inc") == inc and info.get("epoch"):
                live.add(int(info["epoch"]))
        return live

    def _refill(self, top: int, now: float) -> None:
        """Keep abstaining for dead members some live replica may still wait for."""
        live_epochs = self._live_epochs()
        settled = self._all_live_report()  # a joiner may yet enter an old epoch that lists the dead
        for member in list(self.dead):
            newest = max((e for e, m in self.epochs.items() if member in m), default=0)
            if settled and live_epochs and min(live_epochs) > newest:
                del self.dead[member]  # every live replica is past every epoch that listed it
            else:
                self._fill_votes(member[0], member[1], top, now)

    def _collect(self, top: int, now: float) -> None:
        """Delete the keys of rounds every live member is past (counters, decisions, transfer
        words, group addresses) and of epochs nobody can still be in, so a long run's store
        stays the same size. "Past" is judged per epoch, by the newest round decided in it:
        rounds are numbered per epoch, and one that restarted afresh may count from anywhere."""
        if top == self._collected_at or now - self._collected_when < COLLECT_EVERY_S:
            return
        self._collected_at, self._collected_when = top, now
        s = self._s
        for where in [w for w in self._node_added if w[2] < top - 4 * ROUND_KEYS_KEPT]:
            del self._node_added[where]
        ours = []
        newest: Dict[int, int] = {}
        for key in s.list_keys():
            if not key.startswith(keys.PREFIX):
                continue
            parts = key[len(keys.PREFIX):].split("/")
            if parts[0] in ("n", "d", "p", "heal", "pg", "epoch", "start") and len(parts) > 1:
                try:
                    nums = (int(parts[1]), int(parts[2]) if parts[0] in ("n", "d", "p", "heal", "pg") else -1)
                except (IndexError, ValueError):
                    continue
                ours.append((key, parts[0], nums))
                if parts[0] == "d":
                    newest[nums[0]] = max(newest.get(nums[0], -1), nums[1])
            elif parts[0] == "replica" and len(parts) > 2:
                # A sharded replica's own group of an earlier incarnation: nobody uses it again.
                try:
                    rep, inc = int(parts[1]), int(parts[2])
                except ValueError:
                    continue
                now_inc = self.alive.get(rep * self.k)
                if now_inc is not None and inc < now_inc:
                    s.delete_key(key)
        # An epoch's keys go once every live replica reports being past it (_oldest_kept_epoch).
        oldest = self._oldest_kept_epoch()
        for e, rnd in newest.items():
            self.collected_below[e] = max(self.collected_below.get(e, -1), rnd - ROUND_KEYS_KEPT)
        for key, kind, (e, rnd) in ours:
            if e < oldest or kind in ("n", "d", "p", "heal", "pg") and rnd < newest.get(e, -1) - ROUND_KEYS_KEPT:
                s.delete_key(key)

    def _oldest_kept_epoch(self) -> int:
        """Epochs below this one have their keys deleted (-1: none). A live replica that reports no
        epoch of its own yet (joining, or its first report not read) may be about to enter any
        epoch that lists it: nothing is deleted by epoch meanwhile (this once took a joiner's
        epoch, and the decision it was about to read, from under it)."""
        return min(self._live_epochs(), default=-1) - 2 if self._all_live_report() else -1

    # ------------------------------------------------------------ polling
    def _drain_events(self) -> None:
        s = self._s
        for _ in range(s.queue_len(EVENTS)):
            rank, inc, what = s.queue_pop(EVENTS, False).decode().split()
            rank, inc = int(rank), int(inc)
            if what == "spawn":
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

    def _node_of(self, rank: int) -> Optional[int]:
        return self.routes.node_of(rank) if self.routes is not None else None

    def _read_with_reports(self, wanted: List[str]) -> Tuple[List[bytes], List[object]]:
        """Read `wanted` and every replica's status report in one multi_get: (the values of
        `wanted`, the reports in self.ranks order). A report is the raw text of the replica's own
        key, or the object its node relayed (ftrun.supervisor.relay); None when its node's key
        has not changed since the last read (nothing new from any of its replicas)."""
        nodes = self.routes.nodes if self.routes is not None else []
        direct = [r for r in self.ranks if self._node_of(r) is None]
        n, d = len(wanted), len(direct)
        vals = self._s.multi_get(wanted + [keys.info_key(r) for r in direct] + [keys.node_info_key(k) for k in nodes])
        reports: Dict[int, object] = dict(zip(direct, vals[n:n + d]))
        for k, raw in zip(nodes, vals[n + d:]):
            if raw == self._relayed_raw.get(k):
                continue
            self._relayed_raw[k] = raw
            try:
                relayed = json.loads(raw)
            except ValueError:
                continue
            for r in self.routes.ranks(k):
                reports[r] = relayed.get(str(r))
        return vals[:n], [reports.get(r) for r in self.ranks]

    def _absorb(self, healed: List[bytes], infos: List[object], now: float) -> None:
        """Take in the replicas' healed incarnations and status counters (as _read_with_reports gives them)."""
        for r, h, info in zip(self.ranks, healed, infos):
            if int(h) >= 0:
                self.healed.add((r, int(h)))
            # "{}": no report yet (a new store, or a worker of a relaying node that has not reported)
            if info is None or info == self._info_raw.get(r) or info == b"{}" or info == {}:
                continue
            self._info_raw[r] = info
            self.info_seen[r] = now
            if isinstance(info, dict):
                self.info[r] = info
                continue
            try:
                self.info[r] = json.loads(info)
            except ValueError:
                pass
        self._track_waits(now)

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

    def _publish(self, why: str) -> None:
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
        steps = self.round_steps if self.round_steps_chosen else keys.round_steps_for(self.pace.step_s(),
                                                                                      self.round_steps)
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

    # ------------------------------------------------------------ status and hangs
    def replica_fields(self, rank: int) -> dict:
        info = self.info.get(rank) or {}
        inc = self.alive.get(rank)
        return {
            "in_quorum": inc is not None and self.members.get(rank) == inc and (rank, inc) in self.healed,
            "healing": bool(info.get("healing")) and info.get("inc") == inc,
            "last_heal_s": info.get("last_heal_s"),
            "ft_phase": info.get("phase") if info.get("inc") == inc else None,
        }

    def run_fields(self) -> dict:
        """The run's figures for `ftrun status`. From every replica's last report, not only the
        members': after the run (or while a replica heals) the members may be few or none, and
        a replica's last report still holds the steps it saw. Committed steps are the global
        step (the furthest replica's); discarded rounds are counted by each incarnation, so the
        longest-lived replica's count is the run's (a lower bound once every first replica
        has been restarted)."""
        reports = [self.info.get(r) or {} for r in self.ranks]
        return {
            "quorum_id": self.epoch_id,
            "quorum_size": len(self.members),
            "steps_committed": max((int(i.get("step", 0)) for i in reports), default=0),
            "steps_discarded": max((int(i.get("discarded", 0)) for i in reports), default=0),
        }

    def _fresh(self, rank: int, now: float) -> bool:
        return now - self.info_seen.get(rank, -1e9) <= INFO_FRESH_S

    def _track_waits(self, now: float) -> None:
        """A member is waited on when others of its epoch have voted in its round and it has
        not. Only replicas that still report count, on both sides: a stopped replica's last
        report is stale (its heartbeat check catches it) and must not make a waiting peer
        look hung. O(N) per poll: the newest round any fresh member is voting in is enough."""
        fresh = {r for r in self.members if self._fresh(r, now)}
        voting = [int((self.info.get(r) or {}).get("round", -1)) for r in fresh
                  if (self.info.get(r) or {}).get("phase") == "vote"]
        newest_vote = max(voting, default=None)
        for r in self.ranks:
            mine = self.info.get(r) or {}
            waited = (newest_vote is not None and r in fresh and mine.get("phase") not in ("vote", "done", None)
                      and newest_vote >= int(mine.get("round", 0)))
            if waited:
                self.waited_since.setdefault(r, now)
            else:
                self.waited_since.pop(r, None)

    def waited_for_s(self, rank: int) -> float:
        """How long the others have been waiting for this replica without a break (0: they are not)."""
        since = self.waited_since.get(rank)
        return self.clock() - since if since is not None else 0.0

    def global_step(self) -> int:
        return max((int((self.info.get(r) or {}).get("step", 0)) for r in self.ranks), default=0)


class Pace:
    """The run's recent time per step, from the global step the keeper sees rise: the last
    WINDOW_S seconds of it, so that a run that slows down (or speeds up) is followed."""

    WINDOW_S = 30.0

    def __init__(self) -> None:
        self.samples: Deque[Tuple[float, int]] = deque()
        self.noted_at = float("-inf")

    def note(self, t: float, step: int) -> None:
        self.noted_at = t
        if self.samples and step < self.samples[-1][1]:  # a fresh start: the old pace says nothing
            self.samples.clear()
        if self.samples and step == self.samples[-1][1]:
            return
        self.samples.append((t, step))
        while len(self.samples) > 2 and t - self.samples[0][0] > self.WINDOW_S:
            self.samples.popleft()

    def step_s(self) -> Optional[float]:
        """Seconds per step, or None before a few steps over half a second at least were seen."""
        if len(self.samples) < 2:
            return None
        (t0, s0), (t1, s1) = self.samples[0], self.samples[-1]
        if s1 - s0 < 3 or t1 - t0 < 0.5:
            return None
        return (t1 - t0) / (s1 - s0)


def now() -> float:
    return time.time()
