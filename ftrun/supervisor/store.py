"""The run's TCPStore, hosted by the supervisor so it outlives every worker.

The listening socket is bound at once (no torch needed, so the port is known
and reserved before anything starts); torch is imported and the TCPStore is
built on that socket in a background thread while the workers start, so
ftrun never makes workers wait for the supervisor's own torch import.
Must never be imported by worker code.
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, List, Optional

STORE_TIMEOUT_S = 60
CLIENT_OP_TIMEOUT_S = 10  # other nodes' ops on the hosting node's store


def bind_listener(addr: str, port: Optional[int]) -> socket.socket:
    """A listening TCP socket on addr:port (port None or 0: a free one)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((addr, port or 0))
    sock.listen(1024)
    return sock


def wait_reachable(host: str, port: int, timeout: float, stop: Optional[threading.Event] = None) -> Optional[str]:
    """Connect to host:port with plain sockets until it answers or `timeout` runs out.

    torch's TCPStore client retries by itself, but prints a C++ stack trace
    for every failed try; probing first keeps a node that starts before node 0
    quiet, and gives a one-line reason when node 0 never answers.
    Returns None when reachable, else the last error as one line."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(2.0, max(0.1, deadline - time.monotonic()))):
                return None
        except OSError as e:
            last = e.strerror or str(e) or type(e).__name__
        if time.monotonic() >= deadline or (stop is not None and stop.is_set()):
            return last
        time.sleep(0.2)


class StoreUnreachable(ConnectionError):
    """A store operation got no answer in time: the store's machine is gone or cut off."""


class BoundedStore:
    """A TCPStore client whose every call answers or fails within `timeout_s`.

    torch's client waits for ever for the answer to add, set or check on a connection whose
    peer vanished without a reset (a machine that lost power, a link cut): only get and wait
    honour its timeout. Each call runs on a daemon thread of this object's own; the caller waits
    at most `timeout_s`, and from the first call that got no answer every call fails at once
    (the connection is dead; the stuck thread is left behind and never joined)."""

    def __init__(self, store: Any, timeout_s: float) -> None:
        self._store = store
        self._timeout = timeout_s
        self._jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self._dead: Optional[str] = None
        threading.Thread(target=self._run, name="ftrun-store-op", daemon=True).start()

    def _run(self) -> None:
        while True:
            fut, fn, args = self._jobs.get()
            try:
                fut.set_result(fn(*args))
            except BaseException as e:
                fut.set_exception(e)

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._store, name)
        if not callable(fn):
            return fn

        def call(*args: Any, **kwargs: Any) -> Any:
            if self._dead is not None:
                raise StoreUnreachable(self._dead)
            fut: Future = Future()
            self._jobs.put((fut, lambda: fn(*args, **kwargs), ()))
            try:
                return fut.result(self._timeout)
            except FutureTimeout:
                self._dead = f"no answer from the store within {self._timeout:g} s"
                raise StoreUnreachable(self._dead) from None

        return call


def open_run_store(cfg: Any, bind_addr: str) -> "RunStore":
    """Node 0: bind the store's port now and host the store; other nodes: join node 0's store."""
    if cfg.node_rank == 0:
        listener = bind_listener(bind_addr, cfg.master_port)
        return RunStore(cfg.master_addr, listener.getsockname()[1], listener)
    return RunStore(cfg.master_addr, cfg.master_port, None, connect_timeout=cfg.join_timeout)


class RunStore:
    """Hosts or joins a TCPStore, built off the main thread: the run's (hosted by node 0, joined
    by the others) or a node's standby store (--ft on several nodes, ftrun.supervisor.nodes.failover)."""

    def __init__(self, host: str, port: int, listener: Optional[socket.socket],
                 connect_timeout: float = STORE_TIMEOUT_S) -> None:
        self.host = host
        self.port = port
        self._listener = listener
        self.connect_timeout = connect_timeout
        self.store: Any = None
        self.error: Optional[BaseException] = None
        self.ready = threading.Event()
        self._thread = threading.Thread(target=self._build, name="ftrun-store", daemon=True)
        self._thread.start()

    def _build(self) -> None:
        try:
            import datetime

            import torch.distributed as dist

            timeout = datetime.timedelta(seconds=STORE_TIMEOUT_S)
            if self._listener is not None:
                fd = self._listener.detach()  # the TCPStore owns the socket from here on
                self.store = dist.TCPStore(self.host, self.port, None, True, timeout,
                                           wait_for_workers=False, master_listen_fd=fd)
            else:
                unreachable = wait_reachable(self.host, self.port, self.connect_timeout)
                if unreachable is not None:
                    raise ConnectionError(f"{self.host}:{self.port} did not answer within "
                                          f"{self.connect_timeout:g} s ({unreachable})")
                client = dist.TCPStore(self.host, self.port, None, False, timeout)
                # A client op that waits this long means node 0 is gone; the
                # supervisor must learn that in seconds, not minutes.
                client.set_timeout(datetime.timedelta(seconds=CLIENT_OP_TIMEOUT_S))
                self.store = BoundedStore(client, CLIENT_OP_TIMEOUT_S)
        except BaseException as e:  # reported by the supervisor loop
            self.error = e
        finally:
            self.ready.set()

    def adopt(self, store: Any, host: str, port: int) -> None:
        """The run's store moved (ftrun.supervisor.nodes.failover): every user of this object follows."""
        self.store, self.host, self.port = store, host, port

    def wait(self, timeout: Optional[float] = None) -> bool:
        return self.ready.wait(timeout) and self.store is not None

    def set(self, key: str, value: str) -> None:
        self.store.set(key, value)

    def multi_get(self, keys: List[str]) -> List[bytes]:
        return self.store.multi_get(keys)

    def clear_worker_keys(self, keep_prefix: str = "ftrun/") -> int:
        """Delete every key the workers' own rendezvous left behind (gloo/NCCL addresses,
        barriers), keeping ftrun's. A restarted group must never read the previous
        attempt's peer addresses: that is how a restart ends in "connectFullMesh
        failed ... Connection refused" on a port of the dead attempt."""
        removed = 0
        for key in self.store.list_keys():
            if not key.startswith(keep_prefix):
                self.store.delete_key(key)
                removed += 1
        return removed
