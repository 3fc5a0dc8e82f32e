"""`ftrun status` for people: a run's header lines and its replicas' table, drawn with rich and
fitted to the terminal's width (columns give way, values are never cut).

Draws the snapshots ftrun.status.view collects (the --json output); rich is
imported only here and only when a table is drawn.
Must never import torch, never read or write a run's files, and never decide
anything about a run (liveness, stalls, ages are the view's): it only draws.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional

from ftrun.status.state import RunPhase
from ftrun.status.view import STALE_AFTER_S, UNREADABLE

if TYPE_CHECKING:
    from rich.console import RenderableType


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
    syncs = [r.get("next_sync") for r in run.get("replicas") or [] if isinstance(r.get("next_sync"), int)]
    if syncs:
        info.append(f" (next sync at step {min(syncs)})")
    info.append(f"  policy {run.get('policy')}, max restarts {run.get('max_restarts')}"
                f"{', group restarts ' + str(run.get('group_restarts')) if run.get('group_restarts') else ''}")
    info.append(f"  supervisor pid {run.get('pid')}", style="dim")
    if run.get("nnodes", 1) > 1:
        info.append(f"  node {run.get('node_rank')} of {run.get('nnodes')}", style="dim")
    lines: List[Any] = [head, info]
    if ft and (run.get("quorum_id") is not None or run.get("steps_committed") is not None):
        spares = f" and {run['spares']} spare{'s' if run['spares'] != 1 else ''}" if run.get("spares") else ""
        lines.append(Text(f"  quorum {_num(run.get('quorum_id'), '{}')}: {_num(run.get('quorum_size'), '{}')} replicas"
                          f"{spares};"
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
    lines += _not_written_lines(run)
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
            q = "healing" if r.get("healing") else ("in" if r.get("in_quorum") else (
                "spare" if r.get("spare") else ("out" if r.get("in_quorum") is False else "-")))
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


def _not_written_lines(run: Dict[str, Any]) -> List[Any]:
    """'not written: logs in /scratch/logs (No space left on device), 12.0 MiB of worker output lost'."""
    from rich.text import Text

    out = []
    missing = run.get("not_written")
    for kind, rec in (missing.items() if isinstance(missing, dict) else ()):
        if isinstance(rec, dict):
            lost = rec.get("bytes_lost")
            out.append(Text(f"  not written: {kind} in {rec.get('folder')} ({rec.get('why')})"
                            + (f", {_bytes(lost)} of worker output lost (the console had it)"
                               if isinstance(lost, int) and lost else ""), style="bold yellow"))
    return out


CAUSE_WORDS = {"startup": "start-up", "failures": "failures", "hangs": "hangs", "checkpoints": "checkpoints",
               "waiting": "waiting", "output": "output waits", "end": "end"}


def _goodput_line(run: Dict[str, Any]) -> Optional[Any]:
    """'goodput 97.1%; lost: start-up 4.2s, failures 1.3s; 2 failures, back in 0.84s, 0.91s' (None before any figure;
    with --spares the spares' wait is said apart, after what was lost)."""
    from rich.text import Text

    gp = run.get("goodput")
    if not isinstance(gp, (int, float)):
        return None
    lost = run.get("lost_s") if isinstance(run.get("lost_s"), dict) else {}
    parts = [f"{CAUSE_WORDS.get(c, c)} {_age(s)}" for c, s in sorted(lost.items(), key=lambda cs: -(cs[1] or 0))
             if isinstance(s, (int, float)) and s >= 0.05]
    text = f"  goodput {100 * gp:.1f}%" + ("; lost: " + ", ".join(parts) if parts else "")
    spare = run.get("spare_s")
    if isinstance(spare, (int, float)) and spare >= 0.05:  # not replica-time: said apart from what was lost
        text += f"; hot spares waited {_age(spare)}"
    fails = [f for f in run.get("failures") or [] if isinstance(f, dict)]
    if fails:
        text += "; " + failures_words(fails, run.get("phase") == RunPhase.ENDED.value)
    if run.get("metrics_url") and run.get("phase") != RunPhase.ENDED.value:
        text += f"; metrics {run['metrics_url']}"
    return Text(text, style="cyan")


SHOWN_FAILURES = 3  # the goodput line names how fast the last few failures came back


def failures_words(fails: List[Dict[str, Any]], ended: bool) -> str:
    """'2 failures, back in 0.84s, 0.91s'; '5 failures, the last 3 back in 1.3s, 1.0s, 4.8s'; one whose
    replica has not stepped again: 'not back yet' (a live run) or 'never back' (an ended one)."""
    shown = fails[-SHOWN_FAILURES:]
    backs = [f.get("back_s") if isinstance(f.get("back_s"), (int, float)) else None for f in shown]
    which = f", the last {len(shown)}" if len(shown) < len(fails) else ""
    head = f"{len(fails)} failure{'s' if len(fails) != 1 else ''}{which}"
    if all(b is not None for b in backs):
        return f"{head} back in {', '.join(_age(b) for b in backs)}"
    away = "never back" if ended else "not back yet"
    return f"{head}{':' if which else ','} " + ", ".join(f"back in {_age(b)}" if b is not None else away
                                                       for b in backs)


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


def terminal_console() -> Any:
    """A terminal's own width; piped (`| less`, a file, a CI log), no width at all, so nothing is
    cut to rich's 80 columns: a table without borders is no wider than its widest row."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=100_000)
