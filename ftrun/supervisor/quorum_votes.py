"""The quorum keeper's votes in the place of members that cannot vote (mixed into
quorum.QuorumKeeper): abstentions for a dead member in the rounds its peers may wait on, in
every epoch that lists it; a failed vote for a member that will never vote in a round because it
is in another epoch (or still joining while a newer one is out); rounds whose closer died
before deciding; on several nodes, through the member's node store. Never a vote in a round
whose keys were collected. Must never import torch, and never touch processes.
"""

from __future__ import annotations

from typing import Optional, Set

from ftrun import protocol as keys

STUCK_S = 2.0  # a member waiting this long for a vote of a member that is in another epoch


class DeadVotes:
    """Votes for members that cannot cast their own; the state is QuorumKeeper's."""
    def _rejoin(self, rank: int, inc: int, nxt: int) -> None:
        """Incarnation `inc` of `rank` became `nxt` in place (ft/relocation.py _rejoin): what a
        restart shows, without a new process. The old one is out (an epoch without it, its votes
        cast for it where due: it never votes again) and the new one is alive, to join and heal.
        A worker that died meanwhile (its exit was taken first) stays dead."""
        if self.alive.get(rank) != inc or self.k != 1:
            return
        self.on_exit(rank, inc)
        self.on_spawn(rank, nxt)
        self.rejoined.append((rank, nxt))
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
        if keys.closes(total, vote, self._node_size(e, node)):
            self._forward(node, local, e, rnd, top, total)
        return True

    def _add_run_vote(self, e: int, rnd: int, top: int, total: int) -> None:
        after = self._s.add(keys.count_key(e, rnd), total)
        if keys.closes(after, total, len(self.epochs[e])):  # this closed the round: nobody else decides it
            self._decide(e, rnd, top, keys.tally(after).commit)

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
        """Rounds of epoch `e` its live members may be waiting on: its start, the round each live
        member in it last reported, and, in an epoch a live member reports being in (or the
        newest while a member it lists lives: it may be entering), the two after the newest
        decided round. Not those
        two in an older epoch nobody reports being in: a joiner that enters such an epoch begins
        at its start and reports its rounds, while votes in rounds nobody else comes to never
        close, and their keys stay until the epoch is collected (found by the simulator: a store
        of 4 replicas grew past 300 keys while a restarted replica was still starting)."""
        rounds: Set[int] = set()
        if self.starts.get(e, -1) >= 0:
            rounds |= {self.starts[e], self.starts[e] + 1}
        # The newest epoch while a member it lists lives (it may be entering, before it reports):
        # with every one of them dead, each abstention would close the next round, and the next.
        someone = e == self.epoch_id and any(self.alive.get(r) == inc for r, inc in self.epochs.get(e, ()))
        for r, inc in self.alive.items():
            info = self.info.get(r) or {}
            if inc is not None and info.get("inc") == inc and info.get("epoch") == e:
                someone = True
                if "round" in info:
                    rounds |= {int(info["round"]), int(info["round"]) + 1}
        if someone:
            rounds |= {top + 1, top + 2}
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
            rounds = self._rounds_to_fill(e, top)
            for rnd in sorted(rounds - done):
                if self._add_vote(e, rnd, top, vote, rank):
                    done.add(rnd)
            for rnd in sorted(rounds & done):
                self._close_orphaned_node(rank, e, rnd, top, now)
                self._close_orphaned(e, rnd, top)

    def _rounds_to_fill(self, e: int, top: int) -> Set[int]:
        """The rounds of epoch `e` to abstain in for a dead member: those its peers may wait on,
        never one below the collected horizon (a vote there would start a fresh count and
        decide a decided round a second time, d5bb6bf)."""
        return {r for r in self._rounds_of(e, top) if r >= self.collected_below.get(e, -1)}

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
        """Whether member (m, k) of epoch `e` will never vote there: it finished; it reports being
        in another epoch; or in none yet while a newer one is published (a joining replica enters
        the newest epoch, never this older one that listed it)."""
        if (m, k) in self.finished_members:  # it left the loop: a joiner left behind would wait for ever
            return True
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
