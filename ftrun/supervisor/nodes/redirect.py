"""The word left at a c10d run's original endpoint once its store has moved.

A node started with the run's original line after the store moved (the pod
at the endpoint's address restarted by its scheduler, or any node given that
`--rdzv-endpoint`) would find nothing there, or, on the endpoint's own
machine, host a fresh store and start a second run. The node now hosting the
moved store therefore tries the endpoint twice a second; when a store answers
there and says it belongs to this run (``RDZV_RUN``), it writes ``RDZV_MOVED``
= host:port of the store now. The rendezvous of a node hosting or joining at
the endpoint reads it and joins the run where it is
(ftrun.supervisor.nodes.rendezvous), and a hosting node keeps its store up with
that word in it for the nodes that come after.

Must never block the supervisor's loop (it runs in its own thread), never
decide anything about the run, and never import torch at module level.
"""

from __future__ import annotations

import datetime
import threading

from ftrun.keys import RDZV_MOVED, RDZV_RUN
from ftrun.supervisor.store import wait_reachable

EVERY_S = 0.5
OP_TIMEOUT_S = 2.0


class Redirect(threading.Thread):
    """Tries `endpoint` every EVERY_S and leaves `target` there for nodes of run `run_id`."""

    def __init__(self, endpoint: str, run_id: str, target: str) -> None:
        super().__init__(name="ftrun-redirect", daemon=True)
        self.host, _, port = endpoint.rpartition(":")
        self.port = int(port)
        self.run_id = run_id
        self.target = target
        self.stop = threading.Event()

    def run(self) -> None:
        import torch.distributed as dist

        while not self.stop.wait(EVERY_S):
            if wait_reachable(self.host, self.port, OP_TIMEOUT_S, self.stop) is not None:
                continue
            try:
                s = dist.TCPStore(self.host, self.port, None, False, datetime.timedelta(seconds=OP_TIMEOUT_S))
                if s.check([RDZV_RUN]) and s.get(RDZV_RUN).decode() == self.run_id and not (
                        s.check([RDZV_MOVED]) and s.get(RDZV_MOVED).decode() == self.target):
                    s.set(RDZV_MOVED, self.target)
            except Exception:  # noqa: BLE001 - the endpoint went again, or is not a store: next time
                pass
