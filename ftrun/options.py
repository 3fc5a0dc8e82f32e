"""The one options schema: every run option declared once, for the CLI, recipes, PET_* and `ftrun validate`.

Each Option names its recipe key (also RunConfig's field), its command-line
spellings (torchrun's dashed and underscored ones included), the PET_ variable
torchrun reads for it, its reader (ftrun.option_readers), its default and help,
and what ftrun does with torchrun's option (the docs' reference pages are generated from it).
A value that fails its check raises OptionError carrying the key, so every
caller can say where the value came from (flag, recipe line, variable).
This module must never import torch, read files or look at the machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from ftrun.option_readers import (choice, count, endpoint, flag, metrics_addr, nnodes, nproc, number,
                                  plain_text, port, ranks, rdzv_backend, rdzv_conf, seconds, signals, std,
                                  step_timeout, text_list, whole)
from ftrun.hookspec import HOOK_NAMES, PARAMS, WRAP_NAMES


class OptionError(ValueError):
    """A value that does not fit its option: `problem` reads after the option's name."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(problem)
        self.key = key
        self.problem = problem


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
    _opt("nnodes", ("--nnodes",), nnodes, (1, 1), "Number of machines, or MIN:MAX for an elastic run.",
         "same; MIN:MAX starts with MIN..MAX nodes and re-forms with the survivors after a node loss", pet=True,
         metavar="N|MIN:MAX"),
    _opt("nproc", ("--nproc",) + _both("--nproc-per-node"), nproc, 1,
         "Workers on this node: a number, or auto / cpu / gpu / xpu.",
         "same (auto: visible GPUs, else CPU cores; gpu found without importing torch)", pet="PET_NPROC_PER_NODE",
         metavar="N|auto"),
    _opt("rdzv_backend", _both("--rdzv-backend"), rdzv_backend, "static",
         "static (--node-rank per node) or c10d (the same command on every node).",
         "static and c10d; etcd and etcd-v2 get one line naming c10d", pet=True, metavar="static|c10d"),
    _opt("rdzv_endpoint", _both("--rdzv-endpoint"), endpoint, None,
         "c10d: HOST:PORT of the node that hosts the run's store (localhost:0 on one node picks a free port).",
         "same; the node at that address (or is_host=1) hosts the store; node ranks are assigned at join", pet=True,
         metavar="HOST:PORT"),
    _opt("run_id", ("--run-id", "--run_id") + _both("--rdzv-id"), plain_text, None,
         "Name of the run (TORCHELASTIC_RUN_ID; the same on every node). [default: generated]",
         "same (also ftrun's run name, shown by ftrun status)", pet="PET_RDZV_ID", metavar="ID"),
    _opt("rdzv_conf", _both("--rdzv-conf"), rdzv_conf, None,
         "c10d settings key=value,...: join_timeout, last_call_timeout, close_timeout, read_timeout, is_host.",
         "join_timeout, last_call_timeout, close_timeout, read_timeout and is_host honoured; other keys accepted",
         pet=True, metavar="K=V,..."),
    _opt("standalone", ("--standalone",), flag, False, "One node, store on a free local port (as torchrun).",
         "same", pet=True, is_flag=True),
    _opt("max_restarts", _both("--max-restarts"), count(0), None,
         "Restart budget: per group, or per replica with --ft (a replica given up fails the run: exit 0 "
         "only when every worker exits 0). [default: 0, or 3 with --ft]",
         "same (per replica with --ft)", pet=True, metavar="N"),
    _opt("monitor_interval", _both("--monitor-interval"), seconds, 0.1,
         "Accepted for torchrun; ftrun sees exits at once, without polling.",
         "accepted; not needed: worker exits are seen within milliseconds (no polling)", pet=True, metavar="S"),
    _opt("start_method", _both("--start-method"), choice("spawn", "fork", "forkserver"), "spawn",
         "Accepted for torchrun; ftrun forks each worker from a clean pre-warmed zygote.",
         "accepted; every worker is forked from a zygote that imported torch but ran nothing (forkserver-like)",
         pet=True, metavar="spawn|fork|forkserver"),
    _opt("event_log_handler", _both("--event-log-handler"), plain_text, "null", "Accepted for torchrun; unused.",
         "accepted; ftrun's events are its state file (ftrun status --json)", pet=True, metavar="NAME"),
    _opt("role", ("--role",), plain_text, "default", "Role name of the workers (ROLE_NAME).", "same", pet=True,
         metavar="ROLE"),
    _opt("module", ("-m", "--module"), flag, False, "Run SCRIPT as a module, like python -m.",
         "same; found from the working directory as python -m finds it", pet=True, is_flag=True),
    _opt("no_python", _both("--no-python"), flag, False, "Run SCRIPT as an executable, without python.",
         "same", pet=True, is_flag=True),
    _opt("run_path", _both("--run-path"), flag, False, "Run SCRIPT with runpy.run_path (wins over --no-python).",
         "same (ftrun runs every script with runpy in a worker forked from its zygote)", pet=True, is_flag=True),
    _opt("log_dir", _both("--log-dir"), plain_text, None,
         "Folder for per-rank log files. [default: the run's own folder]",
         "same folder; ftrun writes DIR/rank<N>/stdout.log and stderr.log, always (torchrun nests a "
         "sub-folder per run and attempt)", pet=True, metavar="DIR"),
    _opt("redirects", ("-r", "--redirects"), std, None,
         "Keep these streams off the console (file only): 0-3 or per local rank as 0:3,1:1.",
         "same (logs are always written to files; redirected streams leave the console)", pet=True,
         metavar="STD"),
    _opt("tee", ("-t", "--tee"), std, None, "Streams to file and console: 0-3 or per local rank as 0:3,1:1.",
         "same (ftrun always writes files and shows the console; tee keeps a stream on the console)", pet=True,
         metavar="STD"),
    _opt("local_ranks_filter", _both("--local-ranks-filter"), ranks, None,
         "Show only these local ranks on the console, e.g. 0,1.", "same", pet=True, metavar="0,1"),
    _opt("duplicate_stdout_filters", _both("--duplicate-stdout-filters"), text_list, None,
         "Accepted for torchrun: grep the per-rank log files instead.",
         "accepted; every line is in the per-rank log files", pet=True, metavar="A,B"),
    _opt("duplicate_stderr_filters", _both("--duplicate-stderr-filters"), text_list, None,
         "Accepted for torchrun: grep the per-rank log files instead.",
         "accepted; every line is in the per-rank log files", pet=True, metavar="A,B"),
    _opt("node_rank", _both("--node-rank"), count(0), 0, "This machine's rank (static). [default: 0]",
         "same (static); with c10d ranks are assigned at join, as torchrun does", pet=True, metavar="K"),
    _opt("master_addr", _both("--master-addr"), plain_text, "127.0.0.1",
         "Address of node 0 (static). [default: 127.0.0.1]",
         "same", pet=True, metavar="HOST"),
    _opt("master_port", _both("--master-port"), port, None, "Port of the run's store (static). [default: a free port]",
         "same (one node without it: a free port, as torchrun)", pet=True, metavar="PORT"),
    _opt("local_addr", _both("--local-addr"), plain_text, None, "This node's address as the others should reach it.",
         "same (MASTER_ADDR when this node hosts the store)", pet=True, metavar="HOST"),
    _opt("logs_specs", _both("--logs-specs"), plain_text, None, "Accepted for torchrun; ftrun writes its own logs.",
         "accepted; ftrun writes per-rank files under --log-dir", pet=False, metavar="NAME"),
    _opt("numa_binding", _both("--numa-binding"), choice("node", "socket", "exclusive", "core-complex"), None,
         "Accepted for torchrun; not applied.", "accepted, not applied (no NUMA binding yet)", pet=False,
         metavar="MODE"),
    _opt("signals_to_handle", _both("--signals-to-handle"), signals, ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"),
         "Signals forwarded to the workers. [default: SIGTERM,SIGINT,SIGHUP,SIGQUIT]", "same", pet=True,
         metavar="SIGS"),
    _opt("shutdown_timeout", _both("--shutdown-timeout"), seconds, 5.0,
         "Grace between SIGTERM and SIGKILL, seconds; with --checkpoint-dir it also bounds the checkpoint a "
         "stop signal saves first. [default: 5]",
         "same; default 5 s, not 30 (TORCH_ELASTIC_SHUTDOWN_TIMEOUT is read too)", pet=True, metavar="S"),
    _opt("virtual_local_rank", _both("--virtual-local-rank"), flag, False,
         "LOCAL_RANK=0 in every worker, each seeing only its own GPU.", "same", pet=True, is_flag=True),
    # ---- ftrun's own
    _opt("ft", ("--ft",), flag, False, "Replica fault tolerance: only a failed replica restarts and heals from a peer.",
         is_flag=True),
    _opt("min_replicas", ("--min-replicas",), count(1), 1, "With --ft: fewest live replicas that keep training.",
         metavar="N"),
    _opt("spares", ("--spares",), count(0), 0,
         "With --ft: replicas kept warm as hot spares (script started, model built, waiting in its first "
         "ft.steps()/ft.epochs()); one takes a failed replica's place. Counted out of the --nproc workers. "
         "[default: 0]", pet=True, metavar="N"),
    _opt("replica_size", _both("--replica-size"), count(1), 1,
         "With --ft: workers per replica; they shard the model (FSDP2 over ft.device_mesh()). [default: 1]",
         metavar="K"),
    _opt("checkpoint_dir", _both("--checkpoint-dir"), plain_text, None,
         "With --ft: folder for durable checkpoints, written asynchronously from one replica; a run "
         "resumes from the newest one whose checksums hold whenever no replica holds trained state. One "
         "run at a time per folder.", metavar="DIR"),
    _opt("checkpoint_every", _both("--checkpoint-every"), count(1), 500,
         "With --checkpoint-dir: committed steps between checkpoints. [default: 500]", metavar="N"),
    _opt("checkpoint_keep", _both("--checkpoint-keep"), count(1), 2,
         "With --checkpoint-dir: how many good checkpoints to keep. [default: 2]", metavar="K"),
    _opt("step_timeout", ("--step-timeout",), step_timeout, None,
         "Seconds without an optimizer step before a replica counts as hung (stacks dumped, killed, restarted); "
         "0: off.",
         metavar="S"),
    _opt("metrics_port", _both("--metrics-port"), metrics_addr, None,
         "Serve Prometheus metrics at http://HOST:PORT/metrics: a port (on loopback), or HOST:PORT to listen "
         "elsewhere (0.0.0.0:PORT: every interface); port 0 picks a free one (ftrun status --json shows it).",
         pet=True, metavar="[HOST:]PORT"),
    _opt("quiet", ("--quiet", "-q"), flag, False, "Print only ftrun's own lines, not the workers'.", is_flag=True),
    _opt("verbose", ("--verbose",), flag, False,
         "Also print ftrun's per-rank lines (joins, state transfers, traffic every 100 steps); by default they "
         "go to the log files only.", pet="FTRUN_VERBOSE", is_flag=True),
    _opt("ranks", ("--ranks",), ranks, None, "Show only these global ranks on the console, e.g. 0,1.",
         metavar="0,1"),
    _opt("dry_run", ("--dry-run",), flag, False,
         "Print the launch plan (layout, ranks, each worker's environment, every option and where its value "
         "came from) and exit 0, starting nothing.", is_flag=True, recipe=False),
    _opt("join_timeout", ("--join-timeout",), seconds, 120.0,
         "Seconds to wait for every node (also --rdzv-conf join_timeout=S). [default: 120]", metavar="S"),
    _opt("hook", ("--hook",), plain_text, None,
         f"DDP comm hook: {', '.join(HOOK_NAMES)}.", pet=True, metavar="NAME"),
    _opt("env", (), lambda v: v, None, "Extra environment variables for the workers (recipe only)."),
    _opt("script", (), plain_text, None, "Training script (the command line's SCRIPT wins)."),
    _opt("args", (), lambda v: v, None, "Script arguments (the command line's wins)."),
    _opt("description", (), plain_text, None, "One line saying what the recipe is for."),
)

# Hook parameters are declared in ftrun.hookspec (its catalogue is their one source); here they
# only get their command-line form. Values are checked there; recipes nest them under `hook:`.
_READERS: Dict[type, Callable[[Any], Any]] = {int: whole, float: number, bool: flag}
HOOK_FLAGS: Tuple[Option, ...] = tuple(
    _opt(key, (p.flag,), _READERS[p.kind], None,
         ("Turn off: " + p.help if p.flag.startswith("--no-") else p.help[:1].upper() + p.help[1:]) + ".", group="hook",
         is_flag=p.kind is bool, metavar="" if p.kind is bool else "N" if p.kind is int else "X", pet=True)
    for key, p in PARAMS.items()
) + (_opt("wrap", ("--wrap",), plain_text, None, f"Compress what the hook sends: {' or '.join(WRAP_NAMES)} (int8: --hook diloco only).",
          group="hook", metavar="|".join(WRAP_NAMES), pet=True),)

OPTIONS: Dict[str, Option] = {o.key: o for o in OPTIONS_LIST}
HOOK_OPTIONS: Dict[str, Option] = {o.key: o for o in HOOK_FLAGS}
# The flags that turn a hook parameter off (--no-error-feedback sets error_feedback: false).
NEGATED = {"error_feedback", "warm_start"}


def pet_values(environ: Mapping[str, str]) -> Dict[str, Tuple[Any, str]]:
    """{key: (value, 'PET_NAME')} for every PET_ variable set, read as torchrun reads it.

    An empty value counts as unset (torchrun's env action ignores it too)."""
    out: Dict[str, Tuple[Any, str]] = {}
    for opt in OPTIONS_LIST + HOOK_FLAGS:
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
