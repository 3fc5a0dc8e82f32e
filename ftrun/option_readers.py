"""The value readers of the run options: each takes what a flag, a PET_ variable (text) or YAML
(typed) gave and returns the normalised value, or raises ValueError with the problem phrased to
follow the option's name ("must be a whole number, not 'x'").

ftrun.options names one reader per option; each reader carries `kind`, what it takes in
words (the docs' reference shows it as the option's type).
This module must never import torch, read files or look at the machine (--nproc-per-node's
words are counted on the machine by ftrun.layout).
"""

from __future__ import annotations

import re
import signal
from typing import Any, Callable, Dict, Optional, Tuple

def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return repr(value)


def whole(value: Any) -> int:
    if isinstance(value, bool) or isinstance(value, (float, list, dict)) or value is None:
        raise ValueError(f"must be a whole number, not {_describe(value)}")
    try:
        return int(str(value).strip())
    except ValueError:
        raise ValueError(f"must be a whole number, not {_describe(value)}") from None


def number(value: Any) -> float:
    if isinstance(value, bool) or isinstance(value, (list, dict)) or value is None:
        raise ValueError(f"must be a number, not {_describe(value)}")
    try:
        f = float(str(value).strip()) if isinstance(value, str) else float(value)
    except (TypeError, ValueError):
        raise ValueError(f"must be a number, not {_describe(value)}") from None
    if f != f:
        raise ValueError("must be a number, not NaN")
    if f in (float("inf"), float("-inf")):
        raise ValueError(f"must be a finite number, not {'-' if f < 0 else ''}infinity")
    return f


# Timeouts beyond a week are typos, and beyond threading.TIMEOUT_MAX they crash a wait.
MAX_SECONDS = 7 * 24 * 3600.0
# Counts beyond this overflow the C ints torch and the workers read them into (TORCHELASTIC_MAX_RESTARTS, ...).
MAX_COUNT = 1_000_000


def seconds(value: Any) -> float:
    """A duration in seconds: finite, 0 .. MAX_SECONDS."""
    f = number(value)
    if f < 0:
        raise ValueError(f"must be >= 0 seconds, not {f:g}")
    if f > MAX_SECONDS:
        raise ValueError(f"must be at most {MAX_SECONDS:g} seconds (a week), not {f:g}")
    return f


# Progress is reported every 0.25 s: a shorter step timeout would call every healthy replica hung.
MIN_STEP_TIMEOUT_S = 1.0


def step_timeout(value: Any) -> float:
    f = seconds(value)
    if 0 < f < MIN_STEP_TIMEOUT_S:
        raise ValueError(f"must be 0 (off) or at least {MIN_STEP_TIMEOUT_S:g} second (progress is reported every "
                         f"0.25 s), not {f:g}")
    return f


def count(lo: int) -> Callable[[Any], int]:
    """A whole number lo .. MAX_COUNT."""
    def read(value: Any) -> int:
        n = whole(value)
        if n < lo:
            raise ValueError(f"must be >= {lo}, not {n}")
        if n > MAX_COUNT:
            raise ValueError(f"must be at most {MAX_COUNT}, not {n}")
        return n
    read.kind = f"whole number, {lo} to {MAX_COUNT:,}"  # type: ignore[attr-defined]
    return read


def flag(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"must be true or false, not {_describe(value)}")


def plain_text(value: Any) -> str:
    # A bare number is fine (run_id: 7); true/false or a list is surely a mistake.
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"must be text, not {_describe(value)}")
    return str(value)


NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")


def nproc(value: Any) -> Any:
    """A whole number >= 1, or torchrun's words (resolved on the machine by ftrun.layout)."""
    if isinstance(value, str) and value.strip().lower() in NPROC_WORDS:
        return value.strip().lower()
    try:
        n = whole(value)
    except ValueError:
        raise ValueError(f"must be a whole number >= 1 or one of {', '.join(NPROC_WORDS)}, "
                         f"not {_describe(value)}") from None
    if n < 1:
        raise ValueError(f"must be at least 1, not {n}")
    if n > MAX_COUNT:
        raise ValueError(f"must be at most {MAX_COUNT}, not {n}")
    return n


MAX_NODES = 65536


def nnodes(value: Any) -> Tuple[int, int]:
    """'N' or torchrun's elastic 'MIN:MAX' -> (min, max)."""
    text = str(value).strip() if not isinstance(value, bool) else ""
    parts = text.split(":")
    try:
        if len(parts) not in (1, 2) or isinstance(value, (bool, list, dict, float)):
            raise ValueError
        lo, hi = int(parts[0]), int(parts[-1])
    except ValueError:
        raise ValueError(f"must be a number of nodes N or a range MIN:MAX such as 2:4, not {_describe(value)}") from None
    if len(parts) == 1 and lo < 1:
        raise ValueError(f"must be >= 1, not {lo}")
    if lo < 1 or hi < lo:
        raise ValueError(f"must have 1 <= MIN <= MAX, not {text}")
    if hi > MAX_NODES:
        raise ValueError(f"must be at most {MAX_NODES} nodes, not {hi}")
    return lo, hi


def port(value: Any) -> int:
    n = whole(value)
    if not 0 < n < 65536:
        raise ValueError(f"must be a port number 1..65535, not {n}")
    return n


def ranks(value: Any) -> Tuple[int, ...]:
    items = value if isinstance(value, (list, tuple)) else [value] if isinstance(value, int) else str(value).split(",")
    out = set()
    for item in items:
        text = str(item).strip()
        if isinstance(item, bool) or not text.isdigit():
            raise ValueError(f"takes a comma-separated list of ranks >= 0 such as 0,1, not {_describe(value)}")
        out.add(int(text))
    if not out:
        raise ValueError("needs at least one rank, such as 0")
    return tuple(sorted(out))


# torchrun's Std: 0 none, 1 stdout, 2 stderr, 3 both; for all local ranks or per local rank.
STD_NAMES = {0: "none", 1: "stdout", 2: "stderr", 3: "both"}


def std(value: Any) -> Dict[int, int]:
    """'3' -> {-1: 3} (every local rank); '0:3,1:1' -> {0: 3, 1: 1}."""
    text = str(value).strip() if not isinstance(value, bool) else "?"
    bad = f"takes 0-3 (0 none, 1 stdout, 2 stderr, 3 both) or per local rank as 0:3,1:1, not {_describe(value)}"
    if re.fullmatch(r"[0-3]", text):
        return {-1: int(text)}
    if re.fullmatch(r"\d+:[0-3](,\d+:[0-3])*", text):
        return {int(a): int(b) for a, b in (m.split(":") for m in text.split(","))}
    raise ValueError(bad)


def endpoint(value: Any) -> Tuple[str, Optional[int]]:
    """'host:port', 'host', '[v6]:port' -> (host, port or None)."""
    text = plain_text(value).strip()
    m = re.fullmatch(r"\[([^\]]+)\](?::(\d+))?", text) or re.fullmatch(r"([^:\[\]]*)(?::(\d+))?", text)
    if not m or not m.group(1):
        raise ValueError(f"must be HOST:PORT such as node0:29400, not {_describe(value)}")
    port = int(m.group(2)) if m.group(2) is not None else None
    if port is not None and port > 65535:
        raise ValueError(f"has port {port}, which is not a TCP port; use 0..65535")
    return m.group(1), port


def metrics_addr(value: Any) -> Tuple[str, int]:
    """'PORT' (on loopback) or 'HOST:PORT' / '[v6]:PORT' -> (host, port); port 0 picks a free one."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    text = plain_text(value).strip()
    host, port = ("127.0.0.1", text) if text.isdigit() else (None, None)
    if host is None:
        try:
            host, port = endpoint(text)
        except ValueError:
            port = None
    if host is None or port is None or not str(port).isdigit() or int(port) > 65535:
        raise ValueError(f"must be a port (served on 127.0.0.1) or HOST:PORT such as 0.0.0.0:9400, not "
                         f"{_describe(value)}")
    return host, int(port)


RDZV_CONF_KEYS = ("join_timeout", "last_call_timeout", "close_timeout", "read_timeout", "timeout", "is_host",
                  "keep_alive_interval", "keep_alive_max_attempt", "heartbeat", "store_type", "use_libuv")


def rdzv_conf(value: Any) -> Dict[str, str]:
    """torchrun's 'k1=v1,k2=v2' (a recipe may give a mapping); timeouts checked as numbers."""
    if isinstance(value, dict):
        pairs = [(str(k), str(v)) for k, v in value.items()]
    else:
        pairs = []
        for item in plain_text(value).split(","):
            if not item.strip():
                continue
            k, sep, v = item.partition("=")
            if not sep or not k.strip():
                raise ValueError(f"takes key=value pairs such as join_timeout=600,is_host=1, not {_describe(value)}")
            pairs.append((k.strip(), v.strip()))
    out = dict(pairs)
    for k, v in out.items():
        if k.endswith("timeout") or k == "keep_alive_interval":
            try:
                seconds(v)
            except ValueError as e:
                raise ValueError(f"{k}={v}: {e}") from None
        if k == "is_host":
            flag(v)
    return out


def signals(value: Any) -> Tuple[str, ...]:
    names = []
    for item in plain_text(value).split(","):
        name = item.strip().upper()
        if not name:
            continue
        name = name if name.startswith("SIG") else "SIG" + name
        if not hasattr(signal, name) or name in ("SIGKILL", "SIGSTOP", "SIGCHLD"):
            raise ValueError(f"names {item.strip()!r}, not a signal that can be forwarded (e.g. SIGTERM,SIGUSR1)")
        names.append(name)
    return tuple(names)


def choice(*names: str) -> Callable[[Any], str]:
    def read(value: Any) -> str:
        text = plain_text(value).strip()
        if text not in names:
            raise ValueError(f"must be one of {', '.join(names)}, not {_describe(value)}")
        return text
    read.kind = "one of " + ", ".join(names)  # type: ignore[attr-defined]
    return read


def rdzv_backend(value: Any) -> str:
    text = plain_text(value).strip()
    if text in ("etcd", "etcd-v2"):
        raise ValueError(f"{text} is not supported: ftrun hosts its own store; use --rdzv-backend c10d "
                         f"--rdzv-endpoint HOST:PORT (the same line on every node, no etcd server needed)")
    if text not in ("static", "c10d"):
        raise ValueError(f"must be static or c10d, not {_describe(value)}")
    return text


def text_list(value: Any) -> Tuple[str, ...]:
    if isinstance(value, list):
        return tuple(str(v) for v in value)
    return tuple(v for v in plain_text(value).split(",") if v)


# What each reader takes, in words (the docs' reference shows it as the option's type).
for _reader, _kind in ((whole, "whole number"), (number, "number"), (flag, "flag (true/false)"),
                       (plain_text, "text"), (seconds, "seconds, 0 to a week"),
                       (step_timeout, "seconds: 0 (off), or 1 to a week"),
                       (nproc, "whole number >= 1, or auto, cpu, gpu, xpu"),
                       (nnodes, f"N, or MIN:MAX (elastic), at most {MAX_NODES} nodes"), (port, "port, 1 to 65535"),
                       (ranks, "ranks, comma-separated (0,1)"), (std, "0-3, or per local rank (0:3,1:1)"),
                       (endpoint, "HOST:PORT"), (rdzv_conf, "key=value pairs, comma-separated"),
                       (signals, "signal names, comma-separated"), (rdzv_backend, "static or c10d"),
                       (text_list, "text, comma-separated")):
    _reader.kind = _kind  # type: ignore[attr-defined]
