"""`ftrun status [RUN_ID] [--watch] [--json] [--clean]`: the command, over the view and the table.

The runs are read and worked out by ftrun.status.view, drawn by ftrun.status.render;
this module only prints them once, or again while watched. It imports both (neither
imports it), so the view never depends on the table that draws it.
Must never import torch (it runs next to training and must answer in well under 0.3 s).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import List, Optional

from ftrun.errors import ConfigError
from ftrun.status.view import clean, collect

WATCH_INTERVAL_S = 0.5   # the supervisor rewrites state about this often


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

    from ftrun.status.render import render, terminal_console

    console = terminal_console()
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
