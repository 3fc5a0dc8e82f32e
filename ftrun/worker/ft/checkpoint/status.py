"""What `ftrun status` learns of the checkpoints: a few words in the run's store.

The newest good checkpoint (its step, folder, size and cost, and the count of
failed saves then: those after it are the ones since), and each failed save
(the count, and the last one's step and why). The writer thread has a store
connection of its own (the loop's is busy voting).
Must never put anything but a few words in the store, never let a store error
reach a save (status only), and never import the supervisor.
"""

from __future__ import annotations

import datetime
import json
import time
from typing import Any, Dict, Optional

import torch.distributed as dist

from ftrun import keys
from ftrun.worker.settings import run_store


class StoreStatus:
    """One per Checkpointer; used by the writer thread, and by a resume."""

    def __init__(self) -> None:
        self._store: Any = None

    def client(self) -> Any:
        """A connection of the writer's own to the run's store (the loop's is busy voting)."""
        addr = run_store()  # where the store is now: it may have moved since the start
        if not addr:
            return None
        if self._store is None:
            try:
                host, _, port = addr.rpartition(":")
                self._store = dist.TCPStore(host, int(port), None, False, datetime.timedelta(seconds=10))
            except Exception:  # noqa: BLE001 - status only
                return None
        return self._store

    def failed(self, step: int, kind: str, why: str, retry: bool = False) -> Optional[str]:
        """Count a save that wrote nothing (a retry of the same save is not another); the newest
        good checkpoint, in words (None: none)."""
        store = self.client()
        if store is not None:
            try:
                failed = int(store.add(keys.CHECKPOINT_FAILED, 0 if retry else 1))
                store.set(keys.CHECKPOINT_FAILURE, json.dumps({"step": step, "why": why, "final": kind == "final",
                                                               "stop": kind == "stop", "time": time.time(),
                                                               "failed": failed}))
            except Exception:  # noqa: BLE001 - status only
                self._store = None
        return self._newest_good(store)

    def _newest_good(self, store: Any) -> Optional[str]:
        try:
            if store is not None and store.check([keys.CHECKPOINT]):
                info = json.loads(store.get(keys.CHECKPOINT))
                return f"step {info['step']} ({info['path']})"
        except Exception:  # noqa: BLE001 - only for the words
            pass
        return None

    def report(self, info: Dict[str, Any]) -> None:
        """The newest good checkpoint, for `ftrun status`: a few words in the store, with the count
        of failed saves then (those after it are the ones since)."""
        store = self.client()
        if store is None:
            return
        try:
            info = {**info, "failed": int(store.add(keys.CHECKPOINT_FAILED, 0))}
            info.pop("checksums", None)
            info.pop("optimizers", None)
            store.set(keys.CHECKPOINT, json.dumps(info))
        except Exception:  # noqa: BLE001 - status only
            self._store = None
