"""`ftrun report [RUN] [-o FILE]`: one self-contained HTML page of a run, for after the fact.

Reads what the run's supervisors wrote on this machine (each node's state.json and
timeline.json: ftrun.supervisor.accounting.ledger) and writes a single HTML file with the data,
the script that draws it and its styles inlined, so it opens with no network from a
cluster's shared disk: a lane per replica (starting, training, healing, away, hung,
done, spare: a hot spare waiting, gone: given up), the failures marked with their cause, committed steps per second over
time, the checkpoints, and the goodput breakdown.
Must never import torch, and never write anything but the one output file.
"""

from __future__ import annotations

import html
import json
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from ftrun.errors import ConfigError
from ftrun.status.state import RunStatus, scan_state_files
from ftrun.supervisor.accounting.timeline import read_timeline

ASSETS = Path(__file__).resolve().parent


def find_run(run_id: Optional[str]) -> List[Tuple[Path, RunStatus]]:
    """The state files of run `run_id` (exact, else a unique prefix; None: the newest run), one per node."""
    from ftrun.status.view import no_such_run

    files, bad = scan_state_files()
    if not files:
        why = f"; {len(bad)} state file(s) cannot be read" if bad else ""
        raise ConfigError(no_such_run(run_id or "", []) if run_id else f"no ftrun run has state on this machine{why}")
    ids = sorted({s.run_id for _, s in files}, key=lambda i: max(s.started for _, s in files if s.run_id == i))
    if run_id is None:
        chosen = ids[-1]
    elif run_id in ids:
        chosen = run_id
    else:
        prefixed = [i for i in ids if i.startswith(run_id)]
        if len(prefixed) != 1:
            raise ConfigError(no_such_run(run_id, ids))
        chosen = prefixed[0]
    return sorted(((p, s) for p, s in files if s.run_id == chosen), key=lambda ps: ps[1].node_rank)


def report_data(runs: List[Tuple[Path, RunStatus]]) -> Dict[str, Any]:
    """What the page draws: the run, and each node's lanes, failures, steps, checkpoints and books."""
    first = runs[0][1]
    nodes = []
    for path, status in runs:
        try:
            timeline = read_timeline(path.parent)
        except ValueError as e:
            raise ConfigError(f"cannot make the report: {e}") from None
        if timeline is None:
            raise ConfigError(f"run {status.run_id} has no timeline in {path.parent} (it was written by an ftrun "
                              f"without goodput accounting, or its supervisor could not write there)")
        nodes.append({**timeline, "node_rank": status.node_rank, "exit_code": status.exit_code,
                      "exit_summary": status.exit_summary, "ended": status.ended, "phase": status.phase,
                      "checkpoint": status.checkpoint})
    ends = [n.get("ended") or n.get("now") or time.time() for n in nodes]
    return {
        "run": {"run_id": first.run_id, "script": first.script, "argv": first.argv, "started": first.started,
                "ended": max(ends), "policy": first.policy, "hook": first.hook, "nnodes": first.nnodes,
                "nproc": first.nproc, "max_restarts": first.max_restarts},
        "nodes": nodes,
        "generated": time.time(),
    }


def render_html(data: Dict[str, Any]) -> str:
    """The page: the data as JSON in a script element, and the drawing script and styles inline."""
    css = (ASSETS / "run_report.css").read_text()
    js = (ASSETS / "run_report.js").read_text()
    # "</" would end the script element early: JSON allows "<\/" for it.
    blob = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    title = html.escape(f"ftrun report: {data['run']['run_id']}")
    return (f"<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>{title}</title>\n"
            f"<style>\n{css}</style>\n</head>\n<body>\n<main id=\"report\"><noscript>This report draws itself with "
            f"JavaScript; the data is in the page's ftrun-data element.</noscript></main>\n"
            f"<script type=\"application/json\" id=\"ftrun-data\">{blob}</script>\n<script>\n{js}</script>\n"
            f"</body>\n</html>\n")


def report_main(run_id: Optional[str], output: Optional[str]) -> int:
    """Write the report of `run_id` (the newest run when None) to `output` (default: RUN-report.html here)."""
    runs = find_run(run_id)
    data = report_data(runs)
    path = Path(output) if output else Path(f"{data['run']['run_id']}-report.html")
    if path.is_dir():
        path = path / f"{data['run']['run_id']}-report.html"
    page = render_html(data)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(page)
        os.replace(tmp, path)
    except OSError as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise ConfigError(f"cannot write the report to {path}: {e.strerror or e}") from None
    print(f"report of run {data['run']['run_id']} written to {path}")
    return 0
