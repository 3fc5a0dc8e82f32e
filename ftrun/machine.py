"""What this machine has and can do, looked up without importing torch.

Its CPUs and GPUs, its addresses and free ports, the folders it could write,
how many workers it can hold, and the file `python -m` would run. Each function
looks and answers; what an answer means for a run, and the one-line error, are
decided by the callers (ftrun.preflight, ftrun.layout, ftrun.plan).
This module must never import torch (the CLI path uses it), never raise
ConfigError, and never write, start or run anything: it binds a socket only to
see whether a port or an address is free, and closes it at once.
"""

from __future__ import annotations

import importlib.machinery
import os
import socket
import stat
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Tuple

if TYPE_CHECKING:
    from ftrun.run_config import RunConfig

WORKERS_PER_CPU = 8                # more workers than this per usable core is oversubscription, not training
WORKER_MEMORY_BYTES = 100 << 20    # the least a worker needs beyond what it shares with its zygote


def visible_device_count() -> int:
    """GPUs this node may use, found without importing torch (0 if none)."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        return len([d for d in cvd.split(",") if d.strip() and d.strip() != "-1"])
    gpus = Path("/proc/driver/nvidia/gpus")
    return len(list(gpus.iterdir())) if gpus.is_dir() else 0


def cpu_count() -> int:
    """CPUs this process may use (affinity and cgroup sets respected), as torchrun counts them."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def port_is_free(addr: str, port: int) -> bool:
    """Whether a listener could bind `addr:port` now."""
    with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM) as s:
        # As the store's own listener does: connections of an earlier run still in
        # TIME_WAIT must not make a free port look taken.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr if addr not in ("localhost",) else "127.0.0.1", port))
        except OSError:
            return False
    return True


def this_node_name(local_addr: Optional[str] = None) -> str:
    """The address torchrun puts in MASTER_ADDR for a node that hosts the store: --local-addr, else its FQDN."""
    return local_addr or socket.getfqdn()


def is_local_address(host: str) -> Optional[bool]:
    """True if `host` resolves to an address of this machine (loopback, any, or one of its interfaces),
    False if it resolves elsewhere, None if it does not resolve."""
    import ipaddress

    import psutil

    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError, OSError):
        return None
    mine = {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs
            if a.family in (socket.AF_INET, socket.AF_INET6)}
    for family, _, _, _, sockaddr in infos:
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        addr = str(sockaddr[0]).split("%")[0]
        ip = ipaddress.ip_address(addr)
        if ip.is_loopback or ip.is_unspecified or addr in mine:
            return True
    return False


def store_bind_addr(master_addr: str) -> str:
    """The local address the store binds for `master_addr`: that address when it is one of this
    machine's (so the store is reachable there and nowhere else), else every interface
    (master_addr names a NAT or load-balancer address, or a name that resolves elsewhere)."""
    try:
        infos = socket.getaddrinfo(master_addr, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return "0.0.0.0"
    for family, _, _, _, sockaddr in infos:
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        addr = sockaddr[0]
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((addr, 0))
            return addr
        except OSError:
            continue
    return "0.0.0.0"


def store_listen_addr(cfg: RunConfig) -> str:
    """Where the store listens: where MASTER_ADDR points (one node), master_addr's interface (static)."""
    if cfg.rdzv == "c10d":
        return "0.0.0.0"  # as torchrun's store: reachable at this node's FQDN as well as at the endpoint
    return store_bind_addr(cfg.master_addr)


def folder_problem(path: str) -> Optional[str]:
    """Why ftrun could not create and write folder `path`, or None. Looks only; creates nothing."""
    target = os.path.abspath(path)
    if any(len(part.encode()) > 255 for part in target.split(os.sep)):
        return "has a name longer than 255 bytes, which no Linux file system takes"
    p = target
    while True:
        try:
            st = os.stat(p)
        except (FileNotFoundError, NotADirectoryError):
            parent = os.path.dirname(p)
            if parent == p:
                return "cannot be created"
            p = parent
            continue
        except OSError as e:
            return f"cannot be used ({e.strerror or e})"
        break
    if not stat.S_ISDIR(st.st_mode):
        return "is a file, not a folder" if p == target else f"cannot be created: {p} is a file"
    kernel = _kernel_file_system(p)
    if kernel:  # root may "write" there, yet no folder of ours can be made in it
        return (f"{'is' if p == target else 'would be'} in {kernel[0]}, the kernel's own {kernel[1]} file system, "
                f"which holds no files of a run")
    if not os.access(p, os.W_OK | os.X_OK):
        err = "read-only file system" if _read_only(p) else "no permission"
        return (f"is not writable ({err})" if p == target else f"cannot be created in {p} ({err})")
    return None


# File systems whose files the kernel makes: nobody creates folders or files of their own there.
KERNEL_FILE_SYSTEMS = {"proc", "sysfs", "cgroup", "cgroup2", "devpts", "debugfs", "tracefs", "securityfs", "pstore",
                       "bpf", "configfs", "fusectl", "efivarfs", "binfmt_misc", "mqueue", "nsfs", "selinuxfs"}


def _kernel_file_system(path: str) -> Optional[Tuple[str, str]]:
    """(mount point, type) when existing folder `path` is on a kernel file system, else None."""
    best: Optional[Tuple[str, str]] = None
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, kind = left.split(), right.split()[:1]
        if len(fields) < 5 or not kind:
            continue
        point = fields[4].encode().decode("unicode_escape")  # spaces come as \040
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[0])):  # the last of one point is on top
            best = (point, kind[0])
    return best if best is not None and best[1] in KERNEL_FILE_SYSTEMS else None


def _read_only(path: str) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def max_workers() -> Tuple[int, str]:
    """How many workers this machine can run, and the rule that sets it."""
    import psutil

    cpus = cpu_count()
    limits = [(WORKERS_PER_CPU * cpus, f"{WORKERS_PER_CPU} per usable CPU core, {cpus} here")]
    avail = psutil.virtual_memory().available
    limits.append((int(avail // WORKER_MEMORY_BYTES),
                   f"{WORKER_MEMORY_BYTES >> 20} MiB each, {avail / (1 << 30):.1f} GiB of memory available"))
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    # RLIMIT_NPROC does not bind root; unlimited needs no count.
    if os.geteuid() != 0 and soft != resource.RLIM_INFINITY:
        uid = os.getuid()
        mine = sum(1 for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real == uid)
        # the supervisor and its zygote count too
        limits.append((max(0, soft - mine - 2), f"ulimit -u {soft}, {mine} processes of yours running"))
    return min(limits)


def python_path_for(cwd: str) -> list:
    """The module search path `python -m` would have in `cwd`: cwd first, then PYTHONPATH, then the installation's."""
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    # sys.path[0] is the supervisor's own script folder (e.g. .venv/bin), not the user's.
    rest = [p for p in sys.path[1:] if p not in extra]
    return [cwd] + extra + rest


def find_module(name: str, cwd: str) -> Tuple[Optional[str], Optional[str]]:
    """(why `python -m name` would fail in `cwd` or None, the file it would run or None).

    Imports nothing (no package __init__ runs)."""
    parts = name.split(".")
    if not all(p.isidentifier() for p in parts):
        return f"{name!r} is not a module name (python -m takes a dotted name such as pkg.train, not a path)", None
    path = python_path_for(cwd)
    spec = None
    for i, part in enumerate(parts):
        full = ".".join(parts[: i + 1])
        spec = importlib.machinery.PathFinder.find_spec(full, path)
        if spec is None:
            if i == 0 and part in sys.builtin_module_names:
                return None, None
            where = "the Python path" if i == 0 else f"package {'.'.join(parts[:i])!r}"
            return (f"no module named {full!r} in {where} (searched from {cwd}, as python -m would); "
                    f"check the name, run from the project's root, or install it"), None
        if i < len(parts) - 1:
            if spec.submodule_search_locations is None:
                return f"{full!r} is a module, not a package, so it has no {parts[i + 1]!r}", None
            path = list(spec.submodule_search_locations)
    if spec is not None and spec.submodule_search_locations is not None:
        main = importlib.machinery.PathFinder.find_spec(name + ".__main__", list(spec.submodule_search_locations))
        if main is None:
            return (f"{name!r} is a package without a __main__ module, so python -m cannot run it; "
                    f"name a module inside it (e.g. -m {name}.train) or add {name.replace('.', '/')}/__main__.py"), None
        return None, main.origin
    return None, spec.origin if spec is not None else None
