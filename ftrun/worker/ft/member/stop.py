"""How a member stops: at a stop quorum (the writer replica saves the last committed step), at the
loop's end (the last save retried), and when the run finished while it was restarting; and the
checkpoint a fresh quorum's source resumes. Must never run the script's code after the loop on an
untrained state, never import torch, and never import the supervisor.
"""

from __future__ import annotations

import json
from typing import Any, Dict

from ftrun import exits, keys
from ftrun.wire import Quorum
from ftrun.worker.ft.member.core import Entered, InSync

PARK_POLL_S = 0.2  # a stopped member looks this often for a newer stop quorum naming it the writer


class StopPaths:
    """The member's ways out of the loop; owns nothing but its constants."""

    def __init__(self, driver: Any) -> None:  # the member/driver.py MemberDriver that owns this part
        self.d = driver

    def resume(self) -> None:
        """The source of a fresh quorum: take the newest complete checkpoint, if any, into this
        worker's own objects and its global step; the heal then sends that state to the others."""
        d = self.d
        d.set_phase("resume")
        try:
            found = d.checkpoints.resume(d.state, d.total)
        except d.checkpoints.mismatch as e:  # every worker says it: the supervisor quotes whichever exits first
            d.fx.exit(exits.EXIT_CANNOT_GO_ON, f"rank {d.rank}: {e}")
        except Exception as e:  # noqa: BLE001 - a failed read left part of a checkpoint in the tensors
            d.fx.restart(f"rank {d.rank}: {str(e).splitlines()[0][:300]}; exiting so that ftrun restarts it clean")
        if found is not None:
            d.resumed_at(found.step)

    def retry_final_save(self) -> None:
        """The checkpoint of the loop's last step failed (this replica wrote it): try again, a few
        times, a little later each time (every worker of the replica knows the outcome alike, so
        they all retry together). The training itself is done either way."""
        d = self.d
        ck = d.checkpoints
        if ck.result != (d.step, False):
            return  # it went through (the usual case: nothing to load for it)
        from ftrun.worker.ft.checkpoint.writer import FINAL_SAVE_ATTEMPTS, FINAL_SAVE_RETRY_S

        for _ in range(FINAL_SAVE_ATTEMPTS - 1):  # the tries so far count: a round top's save of it is one
            tried = ck.attempts
            if ck.result != (d.step, False) or tried >= FINAL_SAVE_ATTEMPTS:
                break
            d.fx.log_detail(f"rank {d.rank}: trying the checkpoint of the last step {d.step} again in "
                            f"{FINAL_SAVE_RETRY_S * tried:g} s (try {tried + 1} of {FINAL_SAVE_ATTEMPTS})")
            d.fx.sleep(FINAL_SAVE_RETRY_S * tried)
            ck.save(d.state, d.step, "final")
            ck.wait()
        if ck.result == (d.step, False) and d.shard == 0:
            d.fx.log(f"rank {d.rank}: the checkpoint of the last step {d.step} failed {ck.attempts} "
                     f"time{'s' if ck.attempts != 1 else ''} ({ck.last_failure}); the training itself ended normally")

    def finish_without_peers(self) -> None:
        """The run finished while this replica was restarting, and no peer is left to heal it. It
        takes the final checkpoint when there is one; otherwise it exits at once, with status 0,
        so that the script's code after the loop never runs on its untrained state."""
        d = self.d
        # A first incarnation that never entered a quorum waited the whole run: a hot spare (--spares);
        # so did one that a feeder fed (a restarted replica waits as the spare after a promotion).
        fed = d.fx.fed()
        was = "waiting to join as a hot spare" if fed or (d.inc == 0 and d.quorum is None) else "restarting"
        lead = f"rank {d.rank}: the run finished at step {d.step} while this replica was {was}"
        if d.checkpoints is not None and d.k == 1:
            try:
                found = d.checkpoints.resume(d.state, d.total)
            except Exception as e:  # noqa: BLE001 - a foreign or damaged checkpoint: no state to stand on
                d.fx.log(f"rank {d.rank}: {str(e).splitlines()[0][:300]}")
                found = None
            if found is not None and found.step == d.step:
                d.core.handle(InSync())
                d.fx.log(f"{lead}; no peer is left to heal it: it resumed from checkpoint step {found.step}, "
                         f"the final one")
                return
        # A fed spare holds a copy no vote confirmed (ft/heal/feed.py): not the committed state either.
        model = "a fed copy of the model that no vote confirmed" if fed else "an untrained model"
        d.fx.exit(exits.EXIT_OK, f"{lead}; no peer is left to heal it and no checkpoint holds the final step: "
                                f"exiting now (status 0) instead of running the script's code after the loop on "
                                f"{model}")

    def stop_here(self, quorum: Quorum) -> None:
        """A stop signal reached the run (ftrun published a stop quorum): every member stops at
        this round boundary, each holding the state of the last step it committed. The writer
        replica saves that step and says how it went (keys.STOP_SAVE); every member then waits
        to be stopped, and saves after all should a newer stop quorum name its replica the writer.
        The script's code after the loop never runs on a stopped run. Never returns."""
        d = self.d
        d.entry.drop_group()
        d.set_phase("stop")
        d.fx.park()
        saved = False
        while True:
            d.core.handle(Entered(quorum, d.round))  # reported as the member's quorum
            if not saved and d.replica == quorum.writer:
                saved = True
                self._save_before_stop()
            d.fx.sleep(PARK_POLL_S)
            if d.latest_seen > quorum.id:
                try:
                    newest = Quorum.from_json(d.store.get(keys.quorum_key(d.latest_seen)))
                except Exception:  # noqa: BLE001 - the store is going away with the run
                    continue
                if newest.stop and (d.rank, d.inc) in newest.members:
                    quorum = newest

    def _save_before_stop(self) -> None:
        d = self.d
        ck = d.checkpoints
        word: Dict[str, Any] = {"step": d.step, "ok": False, "rank": d.rank}
        if ck is None or not d.in_sync or d.heals.tainted:
            word["why"] = "the writing replica does not hold the trained state"
        elif d.iteration.done:
            # Inside a step of several ft.Optimizers whose first sub-steps a failure left committed:
            # that state is no step's, and a resume would take those sub-steps twice.
            word["why"] = (f"the stop came inside step {d.step}, {d.iteration.done} of whose optimizer steps were "
                           f"committed: that state is no step's to save (the newest checkpoint before it stands)")
        else:
            ck.wait()  # a periodic save of this very step may be in flight
            if ck.result != (d.step, True):
                ck.save(d.state, d.step, "stop")
                ck.wait()
            word["ok"] = ck.result == (d.step, True)
            if word["ok"]:
                word["path"] = str(ck.settings.root / f"step-{d.step}")
            else:
                word["why"] = ck.last_failure
        if d.shard == 0:
            try:
                d.store.set(keys.STOP_SAVE, json.dumps(word))
            except Exception:  # noqa: BLE001 - the supervisor stops the run at its deadline anyway
                pass
