"""`ftrun status`: read the runs' state files and show them (rich table, --watch, --json, --clean).

Reads only the files the supervisors write (ftrun.status.state); decides by
itself whether a supervisor is still alive, so a run whose supervisor was
killed shows as "ended (supervisor gone)" instead of running forever.
Must never import torch (it runs next to training and must answer in well
under 0.3 s), never signal or touch a run's processes, and never write
anything except what --clean removes: ended runs' state files.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from ftrun.errors import ConfigError
from ftrun.status.state import RunPhase, RunStatus, read_state_files, runs_root, scan_state_files

if TYPE_CHECKING:  # rich is imported only when a table is drawn (the --json path skips it)
    from rich.console import RenderableType

WATCH_INTERVAL_S = 0.5   # the supervisor rewrites state about this often
STALE_AFTER_S = 5.0      # a live supervisor that has not written for this long is worth a warning
PID_REUSE_SLACK_S = 2.0  # /proc start times are coarse (boot time is whole seconds)
# Workers beat every 0.25 s and the supervisor records a beat within ~0.5 s: a running rank
# whose beat is older than this is not progressing (stopped, swapped out, stuck in a syscall).
STALLED_AFTER_S = 3.0
UNREADABLE = "unreadable"

GONE = "ended (supervisor gone)"


# ---------------------------------------------------------------------------
# Is the supervisor still there?


def _boot_time() -> Optional[float]:
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except OSError:
        pass
    return None


def _pid_start_time(pid: int, boot: Optional[float]) -> Optional[float]:
    """Wall time `pid` started (Linux /proc), or None where it cannot be known."""
    if boot is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime; the name may hold spaces
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def supervisor_alive(status: RunStatus, boot: Optional[float] = None) -> bool:
    """True while the run's supervisor process exists and is the one that started the run."""
    pid = status.pid
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False  # someone else's process now has that pid: ours is gone
    started = _pid_start_time(pid, boot if boot is not None else _boot_time())
    # A process that started after the run did is a recycled pid, not the supervisor.
    return started is None or started <= status.started + PID_REUSE_SLACK_S


# ---------------------------------------------------------------------------
# The data shown (the --json output is exactly this)


# What `ftrun status` works out and adds to the state file's fields (ftrun.status.state.RUN_FIELDS)
# in its --json output; the docs' reference is generated from these.
DERIVED_RUN_FIELDS: Dict[str, str] = {
    "recorded_phase": "The phase as the state file says it.",
    "supervisor_gone": "true when the run's supervisor died without writing its end (its workers died with it).",
    "shown_phase": "The phase as shown: running, ended, or 'ended (supervisor gone)'.",
    "uptime_s": "Seconds from the start to now, or to the end.",
    "updated_age_s": "Seconds since the supervisor last wrote the file.",
    "state_file": "The state file read.",
    "problem": "Only for a state file that cannot be read (phase 'unreadable'): which field is wrong.",
}
DERIVED_REPLICA_FIELDS: Dict[str, str] = {
    "heartbeat_age_s": "Seconds since the last heartbeat, or null.",
    "recorded_state": "The state as the file says it (state reads stalled where the heartbeat is over 3 s late).",
}


def snapshot(path: Path, status: RunStatus, now: float, boot: Optional[float]) -> Dict[str, Any]:
    """The state file's data plus what the reader works out: liveness, ages, uptime."""
    d = status.to_dict()
    alive = status.phase == RunPhase.ENDED.value or supervisor_alive(status, boot)
    gone = status.phase != RunPhase.ENDED.value and not alive
    d["recorded_phase"] = status.phase
    if gone:
        d["phase"] = RunPhase.ENDED.value
        d["exit_summary"] = status.exit_summary or f"supervisor (pid {status.pid}) is gone; its workers went with it"
    d["supervisor_gone"] = gone
    d["shown_phase"] = GONE if gone else status.phase
    end = status.ended if status.phase == RunPhase.ENDED.value and status.ended else (status.updated if gone else now)
    d["uptime_s"] = round(max(0.0, end - status.started), 3)
    d["updated_age_s"] = round(max(0.0, now - status.updated), 3)
    d["state_file"] = str(path)
    ck = d.get("checkpoint")
    if isinstance(ck, dict) and isinstance(ck.get("time"), (int, float)):
        ck["age_s"] = round(max(0.0, now - ck["time"]), 3)
    live = not gone and status.phase != RunPhase.ENDED.value
    for r in d["replicas"]:
        hb = r.get("last_heartbeat")
        r["heartbeat_age_s"] = round(max(0.0, now - hb), 3) if isinstance(hb, (int, float)) else None
        r["recorded_state"] = r["state"]
        last, rate = r.get("last_step_time"), r.get("steps_per_s")
        if live and isinstance(last, (int, float)) and isinstance(rate, (int, float)) and rate > 0:
            # The recorded rate is an average over the steps seen: a replica with no step for t
            # seconds (well past its usual gap, and past STALLED_AFTER_S: reports come in beats)
            # goes at most one step per t now, whatever it went before.
            gap = now - last
            if gap > max(STALLED_AFTER_S, 2.0 / rate):
                r["steps_per_s"] = round(min(rate, 1.0 / gap), 3)
        if live and r["state"] == "running" and r["heartbeat_age_s"] is not None \
                and r["heartbeat_age_s"] > STALLED_AFTER_S:
            r["state"] = "stalled"
    return d


def unreadable(path: Path, problem: str) -> Dict[str, Any]:
    """What is shown for a state file that cannot be read: its folder's name and why, no guesses."""
    return {"run_id": path.parent.name, "phase": UNREADABLE, "shown_phase": UNREADABLE, "state_file": str(path),
            "problem": f"state file {path} {problem}", "replicas": []}


def collect(run_id: Optional[str] = None) -> List[Dict[str, Any]]:
    """Snapshots of every run (or of `run_id`: exact, else a unique prefix). ConfigError if no such run."""
    now = time.time()
    boot = _boot_time()
    files, bad = scan_state_files()
    if run_id is not None:
        known = [s.run_id for _, s in files] + [p.parent.name for p, _ in bad]
        exact = [(p, s) for p, s in files if s.run_id == run_id]
        prefixed = [(p, s) for p, s in files if s.run_id.startswith(run_id)]
        bad_exact = [(p, why) for p, why in bad if p.parent.name == run_id]
        bad_prefixed = [(p, why) for p, why in bad if p.parent.name.startswith(run_id)]
        if exact or bad_exact:
            files, bad = exact, bad_exact
        elif len(prefixed) + len(bad_prefixed) == 1:
            files, bad = prefixed, bad_prefixed
        else:
            raise ConfigError(_no_such_run(run_id, known))
    return [snapshot(p, s, now, boot) for p, s in files] + [unreadable(p, why) for p, why in bad]


def _no_such_run(run_id: str, known: List[str]) -> str:
    from ftrun.config import closest

    if not known:
        return f"no run {run_id!r} on this machine: no ftrun run has state here ({runs_root()})"
    hint = closest(run_id, known) or f"; runs here: {', '.join(known[:8])}{' ...' if len(known) > 8 else ''}"
    return f"no run {run_id!r} on this machine{hint}"


# ---------------------------------------------------------------------------
# Rendering for people

STATE_STYLE = {
    "starting": "cyan", "running": "green", "hung": "bold red", "restarting": "yellow",
    "recovering": "magenta", "failed": "bold red", "done": "blue", "stopped": "dim", "stalled": "bold yellow",
}


def _age(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    if seconds < 10:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        m, s = divmod(int(seconds), 60)
        return f"{m}m{s:02d}s" if m else f"{s}s"
    h, rem = divmod(int(seconds), 3600)
    return f"{h}h{rem // 60:02d}m"


def _bytes(n: Optional[int]) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _num(x: Optional[float], fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def _script_line(run: Dict[str, Any]) -> str:
    argv = run.get("argv") or []
    script = run.get("script") or "?"
    # Show the script and what follows it on the ftrun command line (its own arguments).
    if script in argv:
        rest = argv[argv.index(script) + 1:]
        return " ".join([script] + rest)
    return script


# Columns that give way, first to last, when the terminal is too narrow for the table: values are
# never cut ("st…" for a state, "104…" for a step); rank, state and step always stay.
OPTIONAL_COLUMNS = ("rss", "cpu %", "heartbeat", "last heal", "restarts", "pid", "quorum", "node", "steps/s")
FAILURE_MIN = 12  # the failure column's least width: it is the one cut to fit


def _fit(cols: List[str], rows: List[List[Any]], width: Optional[int]) -> List[int]:
    """Indexes of the columns to show so that the table fits in `width` (None: no limit)."""
    keep = list(range(len(cols)))
    if width is None:
        return keep

    def need(idx: List[int]) -> int:
        widths = [FAILURE_MIN if cols[i] == "last failure" else
                  max([len(cols[i])] + [len(str(row[i])) for row in rows]) for i in idx]
        return sum(widths) + 2 * (len(idx) - 1)

    for name in OPTIONAL_COLUMNS:
        if need(keep) <= width:
            break
        keep = [i for i in keep if cols[i] != name]
    return keep


def render_run(run: Dict[str, Any], width: Optional[int] = None) -> "RenderableType":
    """One run: a header line and a table of its replicas, fitted to `width` columns."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    if run["phase"] == UNREADABLE:
        line = Text()
        line.append(run["run_id"], style="bold")
        line.append(f"  {UNREADABLE}: ", style="bold red")
        line.append(run["problem"])
        return line
    ended = run["phase"] == RunPhase.ENDED.value
    ft = "ft" in str(run.get("policy", "")) or any(r.get("in_quorum") is not None for r in run["replicas"])

    head = Text()
    head.append(run["run_id"], style="bold")
    head.append("  ")
    head.append(_script_line(run), style="cyan")
    phase_style = "red" if run["supervisor_gone"] or (ended and run.get("exit_code")) else ("blue" if ended else "green")
    head.append("  ")
    head.append(run["shown_phase"], style=phase_style)
    head.append(f"  {'ran' if ended else 'up'} {_age(run['uptime_s'])}")
    info = Text("  ")
    info.append(f"hook {run.get('hook') or 'none (allreduce)'}")
    info.append(f"  policy {run.get('policy')}, max restarts {run.get('max_restarts')}"
                f"{', group restarts ' + str(run.get('group_restarts')) if run.get('group_restarts') else ''}")
    info.append(f"  supervisor pid {run.get('pid')}", style="dim")
    if run.get("nnodes", 1) > 1:
        info.append(f"  node {run.get('node_rank')} of {run.get('nnodes')}", style="dim")
    lines: List[Any] = [head, info]
    if ft and (run.get("quorum_id") is not None or run.get("steps_committed") is not None):
        lines.append(Text(f"  quorum {_num(run.get('quorum_id'), '{}')}: {_num(run.get('quorum_size'), '{}')} replicas;"
                          f" steps committed {_num(run.get('steps_committed'), '{}')},"
                          f" discarded {_num(run.get('steps_discarded'), '{}')}", style="magenta"))
    ck = run.get("checkpoint")
    if isinstance(ck, dict) and ck.get("step") is not None:
        lines.append(Text(f"  checkpoint step {ck.get('step')}, {_age(ck.get('age_s'))} ago, "
                          f"{_bytes(ck.get('bytes'))}, written in {_num(ck.get('write_s'), '{:.2f}s')}: "
                          f"{ck.get('path')}", style="magenta"))
    if isinstance(ck, dict) and ck.get("failed_total"):
        last = ck.get("last_failure") if isinstance(ck.get("last_failure"), dict) else {}
        since = ck.get("failed_since") or 0
        lines.append(Text(f"  checkpoint saves failed: {since} since the last good one, {ck['failed_total']} in all"
                          + (f"; last, step {last.get('step')}: {last.get('why')}" if last else ""),
                          style="bold red" if since else "yellow"))
    gp = _goodput_line(run)
    if gp is not None:
        lines.append(gp)
    if ended:
        code = run.get("exit_code")
        summary = run.get("exit_summary") or ""
        style = "red" if (code or run["supervisor_gone"]) else "blue"
        lines.append(Text(f"  {'exit ' + str(code) + ': ' if code is not None else ''}{summary}", style=style))
    elif run["updated_age_s"] > STALE_AFTER_S:
        lines.append(Text(f"  supervisor has not updated its state for {_age(run['updated_age_s'])}", style="yellow"))

    reps = run["replicas"]
    table = Table(box=None, pad_edge=False, header_style="bold", padding=(0, 1))
    multinode = (run.get("nnodes") or 1) > 1 or any(r.get("node_rank") for r in reps)
    cols = (["node"] if multinode else []) + ["rank", "pid", "state", "restarts", "step", "steps/s", "heartbeat", "cpu %", "rss"]
    if ft:
        cols += ["quorum", "last heal"]
    cols.append("last failure")
    rows = []
    for r in reps:
        state = r.get("state") or "?"
        style = STATE_STYLE.get(state, "")
        if run["supervisor_gone"] and state not in ("done", "failed", "stopped"):
            state, style = "gone", "dim"  # the workers die with their supervisor; the recorded state is stale
        live_hb = r.get("heartbeat_age_s") is not None and not ended
        row = ([str(r.get("node_rank", 0))] if multinode else []) + [
            str(r.get("rank")), _num(r.get("pid"), "{}"), Text(state, style=style),
            str(r.get("restarts", 0)), str(r.get("step", 0)), _num(r.get("steps_per_s"), "{:.2f}") if not ended else "-",
            (_age(r["heartbeat_age_s"]) + " ago") if live_hb else "-",
            _num(r.get("cpu_percent")) if not ended else "-", _bytes(r.get("rss_bytes")) if not ended else "-",
        ]
        if ft:
            q = "healing" if r.get("healing") else ("in" if r.get("in_quorum") else ("out" if r.get("in_quorum") is False else "-"))
            row += [q, _num(r.get("last_heal_s"), "{:.2f}s")]
        # One line per replica, so --watch stays steady: a long reason is cut (--json has it whole).
        row.append(Text(r.get("last_failure") or "", style="red", no_wrap=True, overflow="ellipsis"))
        rows.append(row)
    shown = _fit(cols, rows, width)
    for i in shown:
        c = cols[i]
        table.add_column(c, justify="left" if c in ("state", "last failure", "quorum") else "right",
                         no_wrap=c != "last failure", min_width=FAILURE_MIN if c == "last failure" else None)
    for row in rows:
        table.add_row(*[row[i] for i in shown])
    if reps:
        lines.append(table)
    return Group(*lines)


CAUSE_WORDS = {"startup": "start-up", "failures": "failures", "hangs": "hangs", "checkpoints": "checkpoints",
               "waiting": "waiting", "end": "end"}


def _goodput_line(run: Dict[str, Any]) -> Optional[Any]:
    """'goodput 97.1%; lost: start-up 4.2s, failures 1.3s; 2 failures, back in 0.84s, 0.91s' (None before any figure)."""
    from rich.text import Text

    gp = run.get("goodput")
    if not isinstance(gp, (int, float)):
        return None
    lost = run.get("lost_s") if isinstance(run.get("lost_s"), dict) else {}
    parts = [f"{CAUSE_WORDS.get(c, c)} {_age(s)}" for c, s in sorted(lost.items(), key=lambda cs: -(cs[1] or 0))
             if isinstance(s, (int, float)) and s >= 0.05]
    text = f"  goodput {100 * gp:.1f}%" + ("; lost: " + ", ".join(parts) if parts else "")
    fails = [f for f in run.get("failures") or [] if isinstance(f, dict)]
    if fails:
        backs = [_age(f["back_s"]) if isinstance(f.get("back_s"), (int, float)) else "not back" for f in fails[-3:]]
        text += f"; {len(fails)} failure{'s' if len(fails) != 1 else ''}, back in {', '.join(backs)}"
    if run.get("metrics_url") and run.get("phase") != RunPhase.ENDED.value:
        text += f"; metrics {run['metrics_url']}"
    return Text(text, style="cyan")


def render(runs: List[Dict[str, Any]], run_id: Optional[str] = None, width: Optional[int] = None) -> "RenderableType":
    from rich.console import Group
    from rich.text import Text

    if not runs:
        return Text(f"run {run_id} is gone (its state was removed)" if run_id else "no ftrun run is alive on this machine")
    parts: List[Any] = []
    for i, run in enumerate(runs):
        if i:
            parts.append(Text(""))
        parts.append(render_run(run, width))
    live = sum(1 for r in runs if r["phase"] not in (RunPhase.ENDED.value, UNREADABLE))
    ended = sum(1 for r in runs if r["phase"] == RunPhase.ENDED.value)
    broken = len(runs) - live - ended
    if run_id is None:
        parts.append(Text(""))
        note = f"{live} run{'s' if live != 1 else ''} alive" if live else "no ftrun run is alive on this machine"
        if ended:
            note += f"; {ended} ended (ftrun status --clean removes them)"
        if broken:
            note += f"; {broken} unreadable (remove a state file by hand once no run uses it)"
        parts.append(Text(note, style="dim"))
    return Group(*parts)


# ---------------------------------------------------------------------------
# --clean


def clean(run_id: Optional[str] = None) -> List[Tuple[str, Optional[str]]]:
    """Remove the state of ended runs; [(run_id, folder kept because it holds logs or None)].

    Logs are never removed: they are what explains a failed run. A run folder
    left empty is removed with its state.
    """
    removed: List[Tuple[str, Optional[str]]] = []
    now, boot = time.time(), _boot_time()
    for path, status in read_state_files():
        if run_id is not None and status.run_id != run_id:
            continue
        snap = snapshot(path, status, now, boot)
        if snap["phase"] != RunPhase.ENDED.value:
            if run_id is not None:
                raise ConfigError(f"run {run_id!r} is still running (supervisor pid {status.pid}); stop it before --clean")
            continue
        folder = path.parent
        for leftover in [path] + list(folder.glob("state.json.*.tmp")):
            try:
                leftover.unlink()
            except FileNotFoundError:
                pass
        try:
            folder.rmdir()
            kept = None
        except OSError:
            kept = str(folder)  # not empty: logs (or other files) stay
        removed.append((status.run_id, kept))
    return removed


# ---------------------------------------------------------------------------
# Entry point


def status_main(run_id: Optional[str] = None, watch: bool = False, as_json: bool = False,
                clean_ended: bool = False) -> int:
    """`ftrun status [RUN_ID] [--watch] [--json] [--clean]`; a bad RUN_ID is a ConfigError (exit 2)."""
    if clean_ended:
        if run_id is not None:
            collect(run_id)  # the same one-line error for an unknown id
        removed = clean(run_id)
        if as_json:
            print(json.dumps([{"run_id": r, "kept": k} for r, k in removed]))
            return 0
        from rich.console import Console

        console = Console(highlight=False, soft_wrap=True)
        if not removed:
            console.print("no ended runs to clean")
        for rid, kept in removed:
            console.print(f"removed {rid}" + (f" [dim](logs kept in {kept})[/dim]" if kept else ""))
        return 0

    runs = collect(run_id)
    if as_json and not watch:
        # For scripts: the same data as the table, without loading rich at all (fast path).
        sys.stdout.write(json.dumps(runs, indent=2) + "\n")
        return 0
    if as_json:
        # --watch --json: one compact JSON document per line and refresh, for a consumer to stream.
        try:
            while True:
                sys.stdout.write(json.dumps(runs, separators=(",", ":")) + "\n")
                sys.stdout.flush()
                time.sleep(WATCH_INTERVAL_S)
                try:
                    runs = collect(run_id)
                except ConfigError:
                    runs = []
        except KeyboardInterrupt:
            pass
        except BrokenPipeError:
            # The reader went away (e.g. `| head`): stop quietly; point stdout at devnull so exit does not complain.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0

    console = _console()
    width = console.width if console.is_terminal else None
    if not watch:
        console.print(render(runs, run_id, width))
        return 0

    from rich.live import Live

    try:
        with Live(render(runs, run_id, width), console=console, refresh_per_second=4, transient=False) as live:
            while True:
                time.sleep(WATCH_INTERVAL_S)
                try:
                    runs = collect(run_id)
                except ConfigError:
                    runs = []  # the run was cleaned away while watched: say so, keep watching
                live.update(render(runs, run_id, console.width if console.is_terminal else None))
    except KeyboardInterrupt:
        pass  # Ctrl-C is how --watch ends: not an error
    return 0


def _console() -> Any:
    """A terminal's own width; piped (`| less`, a file, a CI log), no width at all, so nothing is
    cut to rich's 80 columns: a table without borders is no wider than its widest row."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=100_000)


def fast_status(argv: List[str]) -> Optional[int]:
    """`ftrun status ARGS` without building the typer CLI (typer + pydantic cost ~140 ms of CPU).

    Handles exactly `[RUN_ID] [--watch|-w] [--json] [--clean]`; returns None for anything
    else (--help, unknown or misspelt flags) so the full CLI answers with its usual help
    and errors. A bad RUN_ID raises ConfigError, as status_main does.
    """
    run_id: Optional[str] = None
    opts = {"watch": False, "as_json": False, "clean_ended": False}
    names = {"--watch": "watch", "-w": "watch", "--json": "as_json", "--clean": "clean_ended"}
    for arg in argv:
        if arg in names:
            opts[names[arg]] = True
        elif arg.startswith("-") or run_id is not None:
            return None
        else:
            run_id = arg
    return status_main(run_id=run_id, **opts)
