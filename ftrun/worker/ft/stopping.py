"""How a member stops (mixed into manager.Manager): at a stop epoch (the writer replica saves the
last committed step), at the loop's end (the last save retried), and when the run finished
while it was restarting. Must never run the script's code after the loop on an untrained state,
and never import the supervisor.
"""

from __future__ import annotations

import json
import time
from typing import Any, Dict


from ftrun import protocol as keys
from ftrun.protocol import Epoch
from ftrun.worker.ft.checkpoint import SAVE_ERRORS
from ftrun.worker.ft.checkpoint_writer import FINAL_SAVE_ATTEMPTS, FINAL_SAVE_RETRY_S
from ftrun.worker.ft.member.core import InSync
from ftrun.worker.ft.member_io import _log, _log_detail, leave

PARK_POLL_S = 0.2  # a stopped member looks this often for a newer stop epoch naming it the writer


class Stopping:
    """The member's ways out of the loop; the state is Manager's."""

    def _retry_final_save(self) -> None:
        """The checkpoint of the loop's last step failed (this replica wrote it): try again, a
        few times, a little later each time (every worker of the replica knows the outcome
        alike, so they all retry together). The training itself is done either way."""
        ck = self.checkpoints
        for _ in range(FINAL_SAVE_ATTEMPTS - 1):  # the tries so far count: a round top's save of it is one
            tried = ck.attempts
            if ck.result != (self.step, False) or tried >= FINAL_SAVE_ATTEMPTS:
                break
            _log_detail(f"rank {self.rank}: trying the checkpoint of the last step {self.step} again in "
                        f"{FINAL_SAVE_RETRY_S * tried:g} s (try {tried + 1} of {FINAL_SAVE_ATTEMPTS})")
            time.sleep(FINAL_SAVE_RETRY_S * tried)
            ck.save(self.state, self.step, "final")
            ck.wait()
        if ck.result == (self.step, False) and self.shard == 0:
            _log(f"rank {self.rank}: the checkpoint of the last step {self.step} failed {ck.attempts} "
                 f"time{'s' if ck.attempts != 1 else ''} ({ck.last_failure}); the training itself ended normally")

    def _finish_without_peers(self) -> None:
        """The run finished while this replica was restarting, and no peer is left to heal it.
        It takes the final checkpoint when there is one (--checkpoint-dir: the last step is
        always saved); otherwise it exits at once, with status 0, so that the script's code
        after the loop (a final save, an evaluation) never runs on its untrained state."""
        lead = f"rank {self.rank}: the run finished at step {self.step} while this replica was restarting"
        if self.checkpoints is not None and self.k == 1:
            try:
                found = self.checkpoints.resume(self.state, self.total)
            except SAVE_ERRORS as e:  # a foreign or damaged checkpoint: no state to stand on
                _log(f"rank {self.rank}: {str(e).splitlines()[0][:300]}")
                found = None
            if found is not None and found.step == self.step:
                self.core.handle(InSync())
                _log(f"{lead}; no peer is left to heal it: it resumed from checkpoint step {found.step}, the final one")
                return
        leave(keys.EXIT_OK, f"{lead}; no peer is left to heal it and no checkpoint holds the final step: exiting now "
                            f"(status 0) instead of running the script's code after the loop on an untrained model")

    def _stop_here(self, epoch: Epoch) -> None:
        """A stop signal reached the run (ftrun published a stop epoch): every member stops at this
        round boundary, which all reach alike, each holding the state of the last step it
        committed. The writer replica saves that step (unless its newest save is of it already)
        and says how it went (protocol.STOP_SAVE); every member then waits to be stopped, and
        saves after all should a newer stop epoch name its replica the writer (the first one's
        died). The script's code after the loop never runs on a stopped run. Never returns."""
        self._drop_group()
        self._set_phase("stop")
        saved = False
        while True:
            self.epoch = epoch
            if not saved and self.replica == epoch.writer:
                saved = True
                self._save_before_stop()
            time.sleep(PARK_POLL_S)
            if self.latest_seen > epoch.id:
                try:
                    newest = Epoch.from_json(self.store.get(keys.epoch_key(self.latest_seen)))
                except Exception:  # noqa: BLE001 - the store is going away with the run
                    continue
                if newest.stop and (self.rank, self.inc) in newest.members:
                    epoch = newest

    def _save_before_stop(self) -> None:
        ck = self.checkpoints
        word: Dict[str, Any] = {"step": self.step, "ok": False, "rank": self.rank}
        if ck is None or not self.in_sync or self._tainted:
            word["why"] = "the writing replica does not hold the trained state"
        else:
            ck.wait()  # a periodic save of this very step may be in flight
            if ck.result != (self.step, True):
                ck.save(self.state, self.step, "stop")
                ck.wait()
            word["ok"] = ck.result == (self.step, True)
            if word["ok"]:
                word["path"] = str(ck.settings.root / f"step-{self.step}")
            else:
                word["why"] = ck.last_failure
        if self.shard == 0:
            try:
                self.store.set(keys.STOP_SAVE, json.dumps(word))
            except Exception:  # noqa: BLE001 - the supervisor stops the run at its deadline anyway
                pass
