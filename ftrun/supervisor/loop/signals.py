"""The run's stopping signals, caught in one place for the whole run.

One handler serves the run from its start to its end, through every c10d round and the gaps
between them: it records the signal and hands it to the round that runs (its Stopper, which posts
it to the loop's queue). Between rounds nobody is handed it; the rendezvous's waits read it at
their next poll (`signalled`) and end the run there, at a point of their choosing.
Must never raise from the handler or do more there than an attribute write and the sink's
queue put: a handler runs between any two bytecodes of the main thread, inside whatever it holds.
"""

from __future__ import annotations

import signal
from typing import Callable, Iterable, Optional

Sink = Callable[[int, object], None]


class RunSignals:
    """The stopping signals of one run: the last one received, and where it goes now."""

    def __init__(self, signums: Iterable[int]) -> None:
        self.signums = tuple(signums)
        self.last: Optional[int] = None  # the last stopping signal received, for the whole run
        self._sink: Optional[Sink] = None

    def install(self) -> None:
        """Catch the run's signals from now on, until the process exits: one that comes after the
        run has ended is recorded and changes nothing (the exit status is decided), where the
        handler there was before (Python's KeyboardInterrupt) would end ftrun with a traceback."""
        for s in self.signums:
            signal.signal(s, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.last = signum
        sink = self._sink
        if sink is not None:
            sink(signum, frame)

    def deliver_to(self, sink: Optional[Sink]) -> None:
        """Hand every signal to `sink` (a round's Stopper.on_signal) from now on, None: to nobody.
        A signal received since the last wait's poll is handed over at once: none is lost between them."""
        self._sink = sink
        if sink is not None and self.last is not None:
            sink(self.last, None)

    def signalled(self) -> Optional[int]:
        """The stopping signal received, if any (what the waits between rounds poll)."""
        return self.last
