"""The quorum keeper's key collection (mixed into quorum.QuorumKeeper): the keys of rounds every
live member is past, and of epochs nobody can still be in, are deleted, so a long run's store
stays the same size. Must never delete a key a live member may still read (a joiner reporting
no epoch yet may be about to enter any epoch that lists it), and never import torch.
"""

from __future__ import annotations

from typing import Dict

from ftrun import protocol as keys

COLLECT_EVERY_S = 0.25  # one list_keys per status report: a few dozen keys of rounds in flight at most
ROUND_KEYS_KEPT = 4  # keys of this many rounds behind the newest decided one stay in the store
EPOCH_COLLECTED = 1 << 62  # the collected horizon of an epoch whose keys are all gone: no round of it is voted in again


class KeyCollection:
    """Deletes finished rounds' and old epochs' keys; the state is QuorumKeeper's."""
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
            parsed = keys.parse_key(key)
            if parsed is None:
                continue
            kind, nums = parsed
            if kind in ("n", "d", "p", "heal", "pg") and len(nums) >= 2 or kind in ("epoch", "start") and nums:
                where = (nums[0], nums[1] if kind not in ("epoch", "start") else -1)
                ours.append((key, kind, where))
                if kind == "d":
                    newest[where[0]] = max(newest.get(where[0], -1), where[1])
            elif kind == "replica" and len(nums) >= 2:
                # A sharded replica's own group of an earlier incarnation: nobody uses it again.
                rep, inc = nums[0], nums[1]
                now_inc = self.alive.get(rep * self.k)
                if now_inc is not None and inc < now_inc:
                    s.delete_key(key)
        # An epoch's keys go once every live replica reports being past it (_oldest_kept_epoch).
        oldest = self._oldest_kept_epoch()
        for e, rnd in newest.items():
            self.collected_below[e] = max(self.collected_below.get(e, -1), rnd - ROUND_KEYS_KEPT)
        for e in {e for _, _, (e, _) in ours if e < oldest}:
            # Its decisions go too: a vote there later (for a member that dies after, while a
            # restarted replica has not reported yet) would start a fresh count and decide a
            # decided round again (found by the simulator on sharded replicas).
            self.collected_below[e] = EPOCH_COLLECTED
        for key, kind, (e, rnd) in ours:
            if e < oldest or kind in ("n", "d", "p", "heal", "pg") and rnd < newest.get(e, -1) - ROUND_KEYS_KEPT:
                s.delete_key(key)

    def _oldest_kept_epoch(self) -> int:
        """Epochs below this one have their keys deleted (-1: none). A live replica that reports no
        epoch of its own yet (joining, or its first report not read) may be about to enter any
        epoch that lists it: nothing is deleted by epoch meanwhile (this once took a joiner's
        epoch, and the decision it was about to read, from under it)."""
        return min(self._live_epochs(), default=-1) - 2 if self._all_live_report() else -1
