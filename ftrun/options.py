"""The one options schema: every run option declared once, for the CLI, recipes, PET_* and `ftrun validate`.

Each Option names its recipe key (also RunConfig's field), its command-line
spellings (torchrun's dashed and underscored ones included), the PET_ variable
torchrun reads for it, how a value is read and checked, its default and help,
and what ftrun does with torchrun's option (the docs' reference pages are generated from it).
A value that fails its check raises OptionError carrying the key, so every
caller can say where the value came from (flag, recipe line, variable).
This module must never import torch, read files or look at the machine.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from ftrun.hookspec import PARAMS, WRAP_NAMES


class OptionError(ValueError):
    """A value that does not fit its option: `problem` reads after the option's name."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(problem)
        self.key = key
        self.problem = problem


# --------------------------------------------------------------------------- value readers
# Each takes what a flag, a PET_ variable (text) or YAML (typed) gave and returns the
# normalised value, or raises ValueError with the problem phrased to follow the option's name.


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return repr(value)


def _int(value: Any) -> int:
    if isinstance(value, bool) or isinstance(value, (float, list, dict)) or value is None:
        raise ValueError(f"must be a whole number, not {_describe(value)}")
    try:
        return int(str(value).strip())
    except ValueError:
        raise ValueError(f"must be a whole number, not {_describe(value)}") from None


def _float(value: Any) -> float:
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


def _seconds(value: Any) -> float:
    """A duration in seconds: finite, 0 .. MAX_SECONDS."""
    f = _float(value)
    if f < 0:
        raise ValueError(f"must be >= 0 seconds, not {f:g}")
    if f > MAX_SECONDS:
        raise ValueError(f"must be at most {MAX_SECONDS:g} seconds (a week), not {f:g}")
    return f


# Progress is reported every 0.25 s: a shorter step timeout would call every healthy replica hung.
MIN_STEP_TIMEOUT_S = 1.0


def _step_timeout(value: Any) -> float:
    f = _seconds(value)
    if 0 < f < MIN_STEP_TIMEOUT_S:
        raise ValueError(f"must be 0 (off) or at least {MIN_STEP_TIMEOUT_S:g} second (progress is reported every "
                         f"0.25 s), not {f:g}")
    return f


def _count(lo: int) -> Callable[[Any], int]:
    """A whole number lo .. MAX_COUNT."""
    def read(value: Any) -> int:
        n = _int(value)
        if n < lo:
            raise ValueError(f"must be >= {lo}, not {n}")
        if n > MAX_COUNT:
            raise ValueError(f"must be at most {MAX_COUNT}, not {n}")
        return n
    read.kind = f"whole number, {lo} to {MAX_COUNT:,}"  # type: ignore[attr-defined]
    return read


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"must be true or false, not {_describe(value)}")


def _text(value: Any) -> str:
    # A bare number is fine (run_id: 7); true/false or a list is surely a mistake.
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"must be text, not {_describe(value)}")
    return str(value)


NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")


def _nproc(value: Any) -> Any:
    """A whole number >= 1, or torchrun's words (resolved on the machine by ftrun.config)."""
    if isinstance(value, str) and value.strip().lower() in NPROC_WORDS:
        return value.strip().lower()
    try:
        n = _int(value)
    except ValueError:
        raise ValueError(f"must be a whole number >= 1 or one of {', '.join(NPROC_WORDS)}, "
                         f"not {_describe(value)}") from None
    if n < 1:
        raise ValueError(f"must be at least 1, not {n}")
    if n > MAX_COUNT:
        raise ValueError(f"must be at most {MAX_COUNT}, not {n}")
    return n


MAX_NODES = 65536


def _nnodes(value: Any) -> Tuple[int, int]:
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


def _port(value: Any) -> int:
    n = _int(value)
    if not 0 < n < 65536:
        raise ValueError(f"must be a port number 1..65535, not {n}")
    return n


def _ranks(value: Any) -> Tuple[int, ...]:
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


def _std(value: Any) -> Dict[int, int]:
    """'3' -> {-1: 3} (every local rank); '0:3,1:1' -> {0: 3, 1: 1}."""
    text = str(value).strip() if not isinstance(value, bool) else "?"
    bad = f"takes 0-3 (0 none, 1 stdout, 2 stderr, 3 both) or per local rank as 0:3,1:1, not {_describe(value)}"
    if re.fullmatch(r"[0-3]", text):
        return {-1: int(text)}
    if re.fullmatch(r"\d+:[0-3](,\d+:[0-3])*", text):
        return {int(a): int(b) for a, b in (m.split(":") for m in text.split(","))}
    raise ValueError(bad)


def _endpoint(value: Any) -> Tuple[str, Optional[int]]:
    """'host:port', 'host', '[v6]:port' -> (host, port or None)."""
    text = _text(value).strip()
    m = re.fullmatch(r"\[([^\]]+)\](?::(\d+))?", text) or re.fullmatch(r"([^:\[\]]*)(?::(\d+))?", text)
    if not m or not m.group(1):
        raise ValueError(f"must be HOST:PORT such as node0:29400, not {_describe(value)}")
    port = int(m.group(2)) if m.group(2) is not None else None
    if port is not None and port > 65535:
        raise ValueError(f"has port {port}, which is not a TCP port; use 0..65535")
    return m.group(1), port


def _metrics_addr(value: Any) -> Tuple[str, int]:
    """'PORT' (on loopback) or 'HOST:PORT' / '[v6]:PORT' -> (host, port); port 0 picks a free one."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    text = _text(value).strip()
    host, port = ("127.0.0.1", text) if text.isdigit() else (None, None)
    if host is None:
        try:
            host, port = _endpoint(text)
        except ValueError:
            port = None
    if host is None or port is None or not str(port).isdigit() or int(port) > 65535:
        raise ValueError(f"must be a port (served on 127.0.0.1) or HOST:PORT such as 0.0.0.0:9400, not "
                         f"{_describe(value)}")
    return host, int(port)


RDZV_CONF_KEYS = ("join_timeout", "last_call_timeout", "close_timeout", "read_timeout", "timeout", "is_host",
                  "keep_alive_interval", "keep_alive_max_attempt", "heartbeat", "store_type", "use_libuv")


def _rdzv_conf(value: Any) -> Dict[str, str]:
    """torchrun's 'k1=v1,k2=v2' (a recipe may give a mapping); timeouts checked as numbers."""
    if isinstance(value, dict):
        pairs = [(str(k), str(v)) for k, v in value.items()]
    else:
        pairs = []
        for item in _text(value).split(","):
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
                _seconds(v)
            except ValueError as e:
                raise ValueError(f"{k}={v}: {e}") from None
        if k == "is_host":
            _bool(v)
    return out


def _signals(value: Any) -> Tuple[str, ...]:
    names = []
    for item in _text(value).split(","):
        name = item.strip().upper()
        if not name:
            continue
        name = name if name.startswith("SIG") else "SIG" + name
        if not hasattr(signal, name) or name in ("SIGKILL", "SIGSTOP", "SIGCHLD"):
            raise ValueError(f"names {item.strip()!r}, not a signal that can be forwarded (e.g. SIGTERM,SIGUSR1)")
        names.append(name)
    return tuple(names)


def _choice(*names: str) -> Callable[[Any], str]:
    def read(value: Any) -> str:
        text = _text(value).strip()
        if text not in names:
            raise ValueError(f"must be one of {', '.join(names)}, not {_describe(value)}")
        return text
    read.kind = "one of " + ", ".join(names)  # type: ignore[attr-defined]
    return read


def _rdzv_backend(value: Any) -> str:
    text = _text(value).strip()
    if text in ("etcd", "etcd-v2"):
        raise ValueError(f"{text} is not supported: ftrun hosts its own store; use --rdzv-backend c10d "
                         f"--rdzv-endpoint HOST:PORT (the same line on every node, no etcd server needed)")
    if text not in ("static", "c10d"):
        raise ValueError(f"must be static or c10d, not {_describe(value)}")
    return text


def _str_list(value: Any) -> Tuple[str, ...]:
    if isinstance(value, list):
        return tuple(str(v) for v in value)
    return tuple(v for v in _text(value).split(",") if v)


# What each reader takes, in words (the docs' reference shows it as the option's type).
for _reader, _kind in ((_int, "whole number"), (_float, "number"), (_bool, "flag (true/false)"),
                       (_text, "text"), (_seconds, "seconds, 0 to a week"),
                       (_step_timeout, "seconds: 0 (off), or 1 to a week"),
                       (_nproc, "whole number >= 1, or auto, cpu, gpu, xpu"),
                       (_nnodes, f"N, or MIN:MAX (elastic), at most {MAX_NODES} nodes"), (_port, "port, 1 to 65535"),
                       (_ranks, "ranks, comma-separated (0,1)"), (_std, "0-3, or per local rank (0:3,1:1)"),
                       (_endpoint, "HOST:PORT"), (_rdzv_conf, "key=value pairs, comma-separated"),
                       (_signals, "signal names, comma-separated"), (_rdzv_backend, "static or c10d"),
                       (_str_list, "text, comma-separated")):
    _reader.kind = _kind  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- the schema


@dataclass(frozen=True)
class Option:
    """One run option, declared once."""

    key: str                        # RunConfig field, recipe key
    flags: Tuple[str, ...]          # command-line spellings; () for recipe-only keys
    read: Callable[[Any], Any]      # value reader/checker (ValueError with the problem)
    default: Any
    help: str
    pet: Optional[str] = None       # torchrun's PET_ variable for it
    is_flag: bool = False           # takes no value on the command line
    recipe: bool = True             # may appear in a recipe
    torchrun: str = ""              # what ftrun does with torchrun's option of this name (docs)
    group: str = "run"              # "run", or "hook" for hook parameters (nested under hook: in recipes)
    metavar: str = ""

    @property
    def flag(self) -> str:
        """The spelling used in messages: the first long one."""
        return next((f for f in self.flags if f.startswith("--")), self.key)

    @property
    def kind(self) -> str:
        """What the option takes, in words."""
        return getattr(self.read, "kind", "any")

    def parse(self, value: Any) -> Any:
        try:
            return self.read(value)
        except ValueError as e:
            raise OptionError(self.key, str(e)) from None


def _pet(flags: Tuple[str, ...]) -> str:
    # torchrun's env action: PET_ + the first long option's dest, upper-cased.
    long = [f for f in flags if f.startswith("--")]
    return "PET_" + long[0][2:].replace("-", "_").upper()


def _opt(key: str, flags: Tuple[str, ...], read: Callable[[Any], Any], default: Any, help: str,
         torchrun: str = "", pet: Any = False, **kw: Any) -> Option:
    name = pet if isinstance(pet, str) else _pet(flags) if pet else None
    return Option(key, flags, read, default, help, pet=name, torchrun=torchrun, **kw)


def _both(*names: str) -> Tuple[str, ...]:
    """'--nproc-per-node' -> ('--nproc-per-node', '--nproc_per_node'), as torchrun spells it."""
    out: List[str] = []
    for n in names:
        out.append(n)
        if n.startswith("--") and "-" in n[2:]:
            out.append("--" + n[2:].replace("-", "_"))
    return tuple(out)


OPTIONS_LIST: Tuple[Option, ...] = (
    # ---- torchrun's options (torch 2.13), in its --help order
    _opt("nnodes", ("--nnodes",), _nnodes, (1, 1), "Number of machines, or MIN:MAX for an elastic run.",
         "same; MIN:MAX starts with MIN..MAX nodes and re-forms with the survivors after a node loss", pet=True,
         metavar="N|MIN:MAX"),
    _opt("nproc", ("--nproc",) + _both("--nproc-per-node"), _nproc, 1,
         "Workers on this node: a number, or auto / cpu / gpu / xpu.",
         "same (auto: visible GPUs, else CPU cores; gpu found without importing torch)", pet="PET_NPROC_PER_NODE",
         metavar="N|auto"),
    _opt("rdzv_backend", _both("--rdzv-backend"), _rdzv_backend, "static",
         "static (--node-rank per node) or c10d (the same command on every node).",
         "static and c10d; etcd and etcd-v2 get one line naming c10d", pet=True, metavar="static|c10d"),
    _opt("rdzv_endpoint", _both("--rdzv-endpoint"), _endpoint, None,
         "c10d: HOST:PORT of the node that hosts the run's store (localhost:0 on one node picks a free port).",
         "same; the node at that address (or is_host=1) hosts the store; node ranks are assigned at join", pet=True,
         metavar="HOST:PORT"),
    _opt("run_id", ("--run-id", "--run_id") + _both("--rdzv-id"), _text, None,
         "Name of the run (TORCHELASTIC_RUN_ID; the same on every node). [default: generated]",
         "same (also ftrun's run name, shown by ftrun status)", pet="PET_RDZV_ID", metavar="ID"),
    _opt("rdzv_conf", _both("--rdzv-conf"), _rdzv_conf, None,
         "c10d settings key=value,...: join_timeout, last_call_timeout, close_timeout, read_timeout, is_host.",
         "join_timeout, last_call_timeout, close_timeout, read_timeout and is_host honoured; other keys accepted",
         pet=True, metavar="K=V,..."),
    _opt("standalone", ("--standalone",), _bool, False, "One node, store on a free local port (as torchrun).",
         "same", pet=True, is_flag=True),
    _opt("max_restarts", _both("--max-restarts"), _count(0), None,
         "Restart budget: per group, or per replica with --ft. [default: 0, or 3 with --ft]",
         "same (per replica with --ft)", pet=True, metavar="N"),
    _opt("monitor_interval", _both("--monitor-interval"), _seconds, 0.1,
         "Accepted for torchrun; ftrun sees exits at once, without polling.",
         "accepted; not needed: worker exits are seen within milliseconds (no polling)", pet=True, metavar="S"),
    _opt("start_method", _both("--start-method"), _choice("spawn", "fork", "forkserver"), "spawn",
         "Accepted for torchrun; ftrun forks each worker from a clean pre-warmed zygote.",
         "accepted; every worker is forked from a zygote that imported torch but ran nothing (forkserver-like)",
         pet=True, metavar="spawn|fork|forkserver"),
    _opt("event_log_handler", _both("--event-log-handler"), _text, "null", "Accepted for torchrun; unused.",
         "accepted; ftrun's events are its state file (ftrun status --json)", pet=True, metavar="NAME"),
    _opt("role", ("--role",), _text, "default", "Role name of the workers (ROLE_NAME).", "same", pet=True,
         metavar="ROLE"),
    _opt("module", ("-m", "--module"), _bool, False, "Run SCRIPT as a module, like python -m.",
         "same; found from the working directory as python -m finds it", pet=True, is_flag=True),
    _opt("no_python", _both("--no-python"), _bool, False, "Run SCRIPT as an executable, without python.",
         "same", pet=True, is_flag=True),
    _opt("run_path", _both("--run-path"), _bool, False, "Run SCRIPT with runpy.run_path (wins over --no-python).",
         "same (ftrun runs every script with runpy in a worker forked from its zygote)", pet=True, is_flag=True),
    _opt("log_dir", _both("--log-dir"), _text, None, "Folder for per-rank log files. [default: the run's own folder]",
         "same folder; ftrun writes DIR/rank<N>/stdout.log and stderr.log, always (torchrun nests a "
         "sub-folder per run and attempt)", pet=True, metavar="DIR"),
    _opt("redirects", ("-r", "--redirects"), _std, None,
         "Keep these streams off the console (file only): 0-3 or per local rank as 0:3,1:1.",
         "same (logs are always written to files; redirected streams leave the console)", pet=True,
         metavar="STD"),
    _opt("tee", ("-t", "--tee"), _std, None, "Streams to file and console: 0-3 or per local rank as 0:3,1:1.",
         "same (ftrun always writes files and shows the console; tee keeps a stream on the console)", pet=True,
         metavar="STD"),
    _opt("local_ranks_filter", _both("--local-ranks-filter"), _ranks, None,
         "Show only these local ranks on the console, e.g. 0,1.", "same", pet=True, metavar="0,1"),
    _opt("duplicate_stdout_filters", _both("--duplicate-stdout-filters"), _str_list, None,
         "Accepted for torchrun: grep the per-rank log files instead.",
         "accepted; every line is in the per-rank log files", pet=True, metavar="A,B"),
    _opt("duplicate_stderr_filters", _both("--duplicate-stderr-filters"), _str_list, None,
         "Accepted for torchrun: grep the per-rank log files instead.",
         "accepted; every line is in the per-rank log files", pet=True, metavar="A,B"),
    _opt("node_rank", _both("--node-rank"), _count(0), 0, "This machine's rank (static). [default: 0]",
         "same (static); with c10d ranks are assigned at join, as torchrun does", pet=True, metavar="K"),
    _opt("master_addr", _both("--master-addr"), _text, "127.0.0.1", "Address of node 0 (static). [default: 127.0.0.1]",
         "same", pet=True, metavar="HOST"),
    _opt("master_port", _both("--master-port"), _port, None, "Port of the run's store (static). [default: a free port]",
         "same (one node without it: a free port, as torchrun)", pet=True, metavar="PORT"),
    _opt("local_addr", _both("--local-addr"), _text, None, "This node's address as the others should reach it.",
         "same (MASTER_ADDR when this node hosts the store)", pet=True, metavar="HOST"),
    _opt("logs_specs", _both("--logs-specs"), _text, None, "Accepted for torchrun; ftrun writes its own logs.",
         "accepted; ftrun writes per-rank files under --log-dir", pet=False, metavar="NAME"),
    _opt("numa_binding", _both("--numa-binding"), _choice("node", "socket", "exclusive", "core-complex"), None,
         "Accepted for torchrun; not applied.", "accepted, not applied (no NUMA binding yet)", pet=False,
         metavar="MODE"),
    _opt("signals_to_handle", _both("--signals-to-handle"), _signals, ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"),
         "Signals forwarded to the workers. [default: SIGTERM,SIGINT,SIGHUP,SIGQUIT]", "same", pet=True,
         metavar="SIGS"),
    _opt("shutdown_timeout", _both("--shutdown-timeout"), _seconds, 5.0,
         "Grace between SIGTERM and SIGKILL, seconds; with --checkpoint-dir it also bounds the checkpoint a "
         "stop signal saves first. [default: 5]",
         "same; default 5 s, not 30 (TORCH_ELASTIC_SHUTDOWN_TIMEOUT is read too)", pet=True, metavar="S"),
    _opt("virtual_local_rank", _both("--virtual-local-rank"), _bool, False,
         "LOCAL_RANK=0 in every worker, each seeing only its own GPU.", "same", pet=True, is_flag=True),
    # ---- ftrun's own
    _opt("ft", ("--ft",), _bool, False, "Replica fault tolerance: only a failed replica restarts and heals from a peer.",
         is_flag=True),
    _opt("min_replicas", ("--min-replicas",), _count(1), 1, "With --ft: fewest live replicas that keep training.",
         metavar="N"),
    _opt("replica_size", _both("--replica-size"), _count(1), 1,
         "With --ft: workers per replica; they shard the model (FSDP2 over ft.device_mesh()). [default: 1]",
         metavar="K"),
    _opt("checkpoint_dir", _both("--checkpoint-dir"), _text, None,
         "With --ft: folder for durable checkpoints, written asynchronously from one replica; a run "
         "resumes from the newest one whose checksums hold whenever no replica holds trained state. One "
         "run at a time per folder.", metavar="DIR"),
    _opt("checkpoint_every", _both("--checkpoint-every"), _count(1), 500,
         "With --checkpoint-dir: committed steps between checkpoints. [default: 500]", metavar="N"),
    _opt("checkpoint_keep", _both("--checkpoint-keep"), _count(1), 2,
         "With --checkpoint-dir: how many good checkpoints to keep. [default: 2]", metavar="K"),
    _opt("step_timeout", ("--step-timeout",), _step_timeout, None,
         "Seconds without an optimizer step before a replica counts as hung (stacks dumped, killed, restarted); "
         "0: off.",
         metavar="S"),
    _opt("metrics_port", _both("--metrics-port"), _metrics_addr, None,
         "Serve Prometheus metrics at http://HOST:PORT/metrics: a port (on loopback), or HOST:PORT to listen "
         "elsewhere (0.0.0.0:PORT: every interface); port 0 picks a free one (ftrun status --json shows it).",
         pet=True, metavar="[HOST:]PORT"),
    _opt("quiet", ("--quiet", "-q"), _bool, False, "Print only ftrun's own lines, not the workers'.", is_flag=True),
    _opt("verbose", ("--verbose",), _bool, False,
         "Also print ftrun's per-rank lines (joins, state transfers, traffic every 100 steps); by default they "
         "go to the log files only.", pet="FTRUN_VERBOSE", is_flag=True),
    _opt("ranks", ("--ranks",), _ranks, None, "Show only these global ranks on the console, e.g. 0,1.",
         metavar="0,1"),
    _opt("dry_run", ("--dry-run",), _bool, False,
         "Print the launch plan (layout, ranks, each worker's environment, every option and where its value "
         "came from) and exit 0, starting nothing.", is_flag=True, recipe=False),
    _opt("join_timeout", ("--join-timeout",), _seconds, 120.0,
         "Seconds to wait for every node (also --rdzv-conf join_timeout=S). [default: 120]", metavar="S"),
    _opt("hook", ("--hook",), _text, None,
         "DDP comm hook: allreduce, fp16, bf16, powersgd, batched-powersgd, localsgd, noop.", metavar="NAME"),
    _opt("env", (), lambda v: v, None, "Extra environment variables for the workers (recipe only)."),
    _opt("script", (), _text, None, "Training script (the command line's SCRIPT wins)."),
    _opt("args", (), lambda v: v, None, "Script arguments (the command line's wins)."),
    _opt("description", (), _text, None, "One line saying what the recipe is for."),
)

# Hook parameters are declared in ftrun.hookspec (its catalogue is their one source); here they
# only get their command-line form. Values are checked there; recipes nest them under `hook:`.
_READERS: Dict[type, Callable[[Any], Any]] = {int: _int, float: _float, bool: _bool}
HOOK_FLAGS: Tuple[Option, ...] = tuple(
    _opt(key, (p.flag,), _READERS[p.kind], None,
         ("Turn off: " + p.help if p.flag.startswith("--no-") else p.help[:1].upper() + p.help[1:]) + ".", group="hook",
         is_flag=p.kind is bool, metavar="" if p.kind is bool else "N" if p.kind is int else "X")
    for key, p in PARAMS.items()
) + (_opt("wrap", ("--wrap",), _text, None, f"Compress what the hook sends: {' or '.join(WRAP_NAMES)}.",
          group="hook", metavar="|".join(WRAP_NAMES)),)

OPTIONS: Dict[str, Option] = {o.key: o for o in OPTIONS_LIST}
HOOK_OPTIONS: Dict[str, Option] = {o.key: o for o in HOOK_FLAGS}
# The flags that turn a hook parameter off (--no-error-feedback sets error_feedback: false).
NEGATED = {"error_feedback", "warm_start"}


def pet_values(environ: Mapping[str, str]) -> Dict[str, Tuple[Any, str]]:
    """{key: (value, 'PET_NAME')} for every PET_ variable set, read as torchrun reads it.

    An empty value counts as unset (torchrun's env action ignores it too)."""
    out: Dict[str, Tuple[Any, str]] = {}
    for opt in OPTIONS_LIST:
        if opt.pet is None:
            continue
        raw = environ.get(opt.pet)
        if raw is None or raw == "":
            continue
        if opt.is_flag:
            # torchrun's check_env: bool(int(value)); anything else is a mistake to report.
            if raw.strip() not in ("0", "1"):
                raise OptionError(opt.key, f"must be 0 or 1, not {raw!r}")
            if raw.strip() == "0":
                continue
            out[opt.key] = (True, opt.pet)
        else:
            out[opt.key] = (raw, opt.pet)
    return out
