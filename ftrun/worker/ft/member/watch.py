"""The member's quorum watcher: a thread that learns of each new quorum as the keeper publishes it
(a blocking read of the next quorum's key), so that no step asks; it follows the run's store when
it moves. Owns the newest quorum id this member has seen. Must never import torch, never wait
unbounded on one quorum's key, and never import the supervisor.
"""

from __future__ import annotations

from typing import Any, Optional

from ftrun import keys

# A read of the next quorum waits this long, then the newest quorum is read again: the quorum it
# waits for may have come and been collected while this process was stopped, and a read of it
# would wait for ever, deaf to every later quorum.
WAIT_S = 10.0


class QuorumWatch:
    """The newest quorum seen (`latest`), kept up to date off the training thread."""

    def __init__(self, driver: Any) -> None:  # the member/driver.py MemberDriver that owns this part
        self.d = driver
        self.latest = 0
        self._started = False

    def seen(self, latest: int) -> None:
        """The training thread read the newest quorum (a join, a store's move). Never backwards:
        a rejoin in place reads it while this thread runs, which may have seen a newer one since;
        going back to the older one, the member would close rounds naming it and its peers, who
        know the newer one is out, would give up each of its groups for ever."""
        self.latest = max(self.latest, latest)

    def start(self) -> None:
        """Start the thread once per process (a rejoin in place keeps it)."""
        if not self._started:
            self._started = True
            self.d.fx.spawn(self._run, "ftrun-quorums")

    def _run(self) -> None:
        d, fx = self.d, self.d.fx
        gen: Optional[int] = None
        store, nxt = None, 0
        while True:
            if gen != d.store_gen:
                gen = d.store_gen
                try:
                    store = fx.connect(WAIT_S)
                except Exception:  # noqa: BLE001 - the store is moving: try again
                    fx.sleep(0.05)
                    gen = None
                    continue
                nxt = self.latest + 1
            nxt = max(nxt, self.latest + 1)  # the training thread may have read a newer one (seen)
            try:
                store.get(keys.quorum_key(nxt))
            except Exception:  # noqa: BLE001 - no new quorum for a while (a timeout), or the store is gone
                if d.finished:
                    return
                newest = self._newest(store) if gen == d.store_gen else None
                if newest is not None:  # the store answers: the wait timed out
                    nxt = max(nxt, newest + 1)
                    continue
                while gen == d.store_gen and not d.finished and fx.store_gone():
                    fx.sleep(0.05)  # wait for the training thread to find the next store
                continue
            if gen == d.store_gen:
                self.latest = max(self.latest, nxt)
            nxt += 1

    def _newest(self, store: Any) -> Optional[int]:
        """The newest quorum published (keys.LATEST), taken as seen; None if the store does not
        answer (it may be gone: the caller looks)."""
        try:
            if store.check([keys.LATEST]):
                self.latest = max(self.latest, int(store.get(keys.LATEST)))
        except Exception:  # noqa: BLE001 - the store is down or moving
            return None
        return self.latest
