"""Leaving nothing behind: what a benchmark script made (processes, folders, namespaces), undone on
success, on failure, on Ctrl-C, SIGTERM and SIGHUP. The benchmarks under scripts/ share it; it
never makes anything itself.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Callable, List, Tuple

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Cleanup:
    """What to undo, recorded as each thing is made; `run` undoes it newest first (processes before
    the namespaces they live in), each once, and goes on past an undo that fails."""

    def __init__(self) -> None:
        self._undo: List[Tuple[str, Callable[[], None]]] = []

    def add(self, what: str, undo: Callable[[], None]) -> None:
        self._undo.append((what, undo))

    def forget(self, undo: Callable[[], None]) -> None:
        """Drop `undo` (its caller carried it out already)."""
        self._undo = [(w, u) for w, u in self._undo if u is not undo]

    def pending(self) -> List[str]:
        return [what for what, _ in self._undo]

    def run(self) -> List[str]:
        """Undo everything; return what could not be undone, with the reason."""
        failed = []
        while self._undo:
            what, undo = self._undo.pop()
            try:
                undo()
            except Exception as e:  # noqa: BLE001 - the rest must still be undone
                failed.append(f"{what}: {e}")
        return failed


def _as_exit(signum: int, frame) -> None:  # noqa: ARG001
    raise SystemExit(128 + signum)


def guarded(body: Callable[[Cleanup], int]) -> int:
    """Run body(cleanup) with Ctrl-C, SIGTERM and SIGHUP turned into exits, then undo whatever it
    recorded, with those signals held off so that a second Ctrl-C cannot cut the undoing short."""
    cleanup = Cleanup()
    before = {s: signal.signal(s, _as_exit) for s in STOP_SIGNALS}
    try:
        return body(cleanup)
    finally:
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            name = os.path.splitext(os.path.basename(sys.argv[0]))[0] or "benchmark"
            for line in cleanup.run():
                print(f"{name}: could not undo {line}", file=sys.stderr)
        finally:
            for s, h in before.items():
                signal.signal(s, h)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
