"""A gloo group's own TCP connections, so that a member can hang up on the group at once.

Gloo cannot end an operation early: its abort() neither wakes a wait nor closes a connection,
and a group's connections close only when the last thing holding them goes (the group, and
every Work of it still referenced: a failed one held by the reducer, a hook, a traceback). A
peer blocked on a member that has left an operation waits until then, or out the group's whole
timeout. Shutting the group's sockets down (shutdown(2)) fails every operation on them at once,
at both ends, whoever holds them.

A group's connections are told apart from the process's other sockets by listeners: each group's
gloo device listens on a port of its own (the one listening socket that appears as the device is
created); a connection a peer opened to this member arrives on that listener, and one this member
opened goes to a peer's listener, whose address each member publishes under the group's prefix
before it connects. They are found once, when the group has connected (gloo connects every pair
as the group is built), and must number one per peer; each is remembered by its descriptor and
its socket's inode, and a descriptor is shut only after a dup of it is checked to still be that
socket, so nothing else (another group, the store, a later socket on a reused descriptor) is ever
touched. Linux only (it reads /proc); elsewhere, or when the count is off (TORCH_GLOO_LAZY_INIT),
there are no lines and the group waits as gloo's own do. Must never close a descriptor of gloo's,
never touch a listening socket, never create a socket object for a descriptor it has not checked
(that may change its blocking mode), and never import the supervisor.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Tuple

Address = Tuple[str, int]
KEY = "ftrun-listener-"  # + group rank: that member's gloo listener, "HOST PORT", under the group's prefix
_LISTEN, _ESTABLISHED = "0A", "01"  # /proc/net/tcp states


def _host(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    # The kernel prints each 32-bit word in host order (little-endian here).
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)) if sys.byteorder == "little" else raw
    if len(words) == 4:
        return socket.inet_ntop(socket.AF_INET, words)
    if words[:12] == b"\0" * 10 + b"\xff\xff":  # an IPv4 address seen through an IPv6 socket
        return socket.inet_ntop(socket.AF_INET, words[12:])
    return socket.inet_ntop(socket.AF_INET6, words)


def _address(field: str) -> Address:
    host, _, port = field.partition(":")
    return _host(host), int(port, 16)


def _same(a: Address, b: Address) -> bool:
    return a[1] == b[1] and (a[0] == b[0] or b[0] in ("0.0.0.0", "::"))


def _sockets() -> Dict[int, Tuple[int, Address, Address, str]]:
    """{descriptor: (inode, local, remote, state)} of this process's TCP sockets; {} without /proc."""
    inodes: Dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return {}
    for name in names:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed meanwhile
        if link.startswith("socket:["):
            inodes[int(link[8:-1])] = int(name)
    found: Dict[int, Tuple[int, Address, Address, str]] = {}
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9 and int(cols[9]) in inodes:
                ino = int(cols[9])
                found[inodes[ino]] = (ino, _address(cols[1]), _address(cols[2]), cols[3])
    return found


def _listeners() -> FrozenSet[Tuple[int, int]]:
    return frozenset((fd, s[0]) for fd, s in _sockets().items() if s[3] == _LISTEN)


def supported() -> bool:
    return sys.platform.startswith("linux") and os.path.isdir("/proc/self/fd")


class GlooLines:
    """One gloo group's connections, once it has connected: (descriptor, inode) of each."""

    def __init__(self, listener: Address) -> None:
        self.listener = listener
        self.lines: List[Tuple[int, int]] = []
        self.hung_up = False

    @staticmethod
    def device(create: Callable[[], Any]) -> Tuple[Any, Optional["GlooLines"]]:
        """A gloo device from `create`, and its lines-to-be (None where its listener cannot be told
        apart: not Linux, or another listener appeared at the same moment)."""
        if not supported():
            return create(), None
        before = _listeners()
        device = create()
        new = [fd for fd, ino in _listeners() - before]
        if len(new) != 1:
            return device, None
        sock = _sockets().get(new[0])
        return device, (GlooLines(sock[1]) if sock is not None else None)

    def publish(self, store: Any, rank: int) -> None:
        """Say where this member listens, before it connects (so every peer finds it once connected)."""
        store.set(f"{KEY}{rank}", f"{self.listener[0]} {self.listener[1]}")

    def connected(self, store: Any, rank: int, size: int) -> bool:
        """Find the group's connections, once it has connected; False (no lines) unless there is
        exactly one per peer."""
        peers = []
        for r in range(size):
            if r != rank:
                key = f"{KEY}{r}"
                # Every peer that publishes does so before it connects, so before this member's
                # connect ends; one whose listener could not be told apart never does (no wait).
                if not store.check([key]):
                    return False
                host, port = store.get(key).decode().split()
                peers.append((host, int(port)))
        # Established only: a connection of an older group whose peer has closed it lingers as CLOSE_WAIT.
        mine = [(fd, s[0]) for fd, s in _sockets().items()
                if s[3] == _ESTABLISHED and (_same(s[1], self.listener) or any(_same(s[2], p) for p in peers))]
        if len(mine) != size - 1:
            return False
        self.lines = mine
        return True

    def hang_up(self) -> int:
        """Shut every connection of the group down (both directions); how many were (0 once done:
        a socket shut down stays so)."""
        if self.hung_up:
            return 0
        self.hung_up = True
        shut = 0
        for fd, ino in self.lines:
            try:
                mine = os.dup(fd)
            except OSError:
                continue  # gloo closed it already (a failed pair): its peer has seen that
            try:
                if os.fstat(mine).st_ino != ino:
                    continue  # the descriptor is another file's now
                s = socket.socket(fileno=mine)
                try:
                    s.shutdown(socket.SHUT_RDWR)
                    shut += 1
                except OSError:
                    pass  # not connected any more
                finally:
                    s.detach()
            finally:
                os.close(mine)  # the dup only: the socket stays gloo's
        return shut
