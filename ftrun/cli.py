"""The `ftrun` command line: run (the default), status, recipes, validate.

Parses flags with typer, turns the ones the user typed into a RunConfig and
hands it to the supervisor. A user's mistake becomes one line and exit 2.
This module must never import torch at module level: `--help`, `status`,
`recipes` and `validate` stay torch-free; only `run` reaches the supervisor.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Dict, List, Optional

import typer

from ftrun import __version__
from ftrun.errors import ConfigError

COMMANDS = ("run", "status", "recipes", "validate")

app = typer.Typer(
    name="ftrun",
    help=(
        "Fault-tolerant, torchrun-style launcher for PyTorch distributed training.\n\n"
        "ftrun [RUN OPTIONS] SCRIPT [ARGS]... is the same as ftrun run ... "
        "(see ftrun run --help for every run option)."
    ),
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        print(f"ftrun {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """Fault-tolerant, torchrun-style launcher for PyTorch distributed training."""


HOOK_PARAM_FLAGS = ("rank", "start_iter", "min_compression_rate", "error_feedback", "warm_start",
                    "orthogonalization_epsilon", "seed", "batch_same_shape", "period")


@app.command(
    "run",
    context_settings={"allow_interspersed_args": False, "help_option_names": ["-h", "--help"]},
)
def run_cmd(
    ctx: typer.Context,
    script: Optional[str] = typer.Argument(None, help="Training script (or module with -m, executable with --no-python).", show_default=False),
    args: Optional[List[str]] = typer.Argument(None, help="Arguments for the script, passed untouched.", show_default=False),
    nproc: Optional[str] = typer.Option(None, "--nproc", "--nproc-per-node", "--nproc_per_node", help="Workers on this node: a number, or 'auto' (visible GPUs, else CPU cores). [default: 1]", show_default=False),
    recipe: Optional[str] = typer.Option(None, "--recipe", help="YAML recipe (file or bundled name); flags on the command line win."),
    module: Optional[bool] = typer.Option(None, "-m", "--module", help="Run SCRIPT as a module, like python -m.", show_default=False),
    no_python: Optional[bool] = typer.Option(None, "--no-python", help="Run SCRIPT as an executable, without python.", show_default=False),
    max_restarts: Optional[int] = typer.Option(None, "--max-restarts", "--max_restarts", help="Restart budget: per group, or per replica with --ft. [default: 0, or 3 with --ft]", show_default=False),
    ft: Optional[bool] = typer.Option(None, "--ft", help="Replica fault tolerance: only a failed replica restarts and heals from a peer.", show_default=False),
    min_replicas: Optional[int] = typer.Option(None, "--min-replicas", help="With --ft: fewest live replicas that keep training. [default: 1]", show_default=False),
    hook: Optional[str] = typer.Option(None, "--hook", help="DDP comm hook: allreduce, fp16, bf16, powersgd, batched-powersgd, localsgd, noop.", show_default=False),
    rank: Optional[int] = typer.Option(None, "--rank", help="PowerSGD matrix approximation rank.", show_default=False),
    start_iter: Optional[int] = typer.Option(None, "--start-iter", help="Iteration at which PowerSGD / local SGD starts.", show_default=False),
    min_compression_rate: Optional[float] = typer.Option(None, "--min-compression-rate", help="PowerSGD: compress a tensor only above this rate.", show_default=False),
    no_error_feedback: Optional[bool] = typer.Option(None, "--no-error-feedback", help="PowerSGD: turn error feedback off.", show_default=False),
    no_warm_start: Optional[bool] = typer.Option(None, "--no-warm-start", help="PowerSGD: turn warm start off.", show_default=False),
    orthogonalization_epsilon: Optional[float] = typer.Option(None, "--orthogonalization-epsilon", help="PowerSGD: epsilon in orthogonalization.", show_default=False),
    seed: Optional[int] = typer.Option(None, "--seed", help="PowerSGD: seed of the random initial matrices.", show_default=False),
    batch_same_shape: Optional[bool] = typer.Option(None, "--batch-same-shape", help="PowerSGD: batch tensors of the same shape.", show_default=False),
    period: Optional[int] = typer.Option(None, "--period", help="localsgd: average parameters every N steps.", show_default=False),
    wrap: Optional[str] = typer.Option(None, "--wrap", help="Compress what the hook sends: fp16 or bf16.", show_default=False),
    step_timeout: Optional[float] = typer.Option(None, "--step-timeout", help="Seconds without an optimizer step before a replica counts as hung (stacks dumped, killed, restarted). [default: off]", show_default=False),
    shutdown_timeout: Optional[float] = typer.Option(None, "--shutdown-timeout", help="Grace between SIGTERM and SIGKILL, seconds. [default: 5]", show_default=False),
    log_dir: Optional[str] = typer.Option(None, "--log-dir", help="Folder for per-rank log files. [default: the run's own folder]", show_default=False),
    quiet: Optional[bool] = typer.Option(None, "--quiet", "-q", help="Print only ftrun's own lines, not the workers'.", show_default=False),
    ranks: Optional[str] = typer.Option(None, "--ranks", help="Show only these ranks on the console, e.g. 0,1.", show_default=False),
    nnodes: Optional[int] = typer.Option(None, "--nnodes", help="Number of machines. [default: 1]", show_default=False),
    node_rank: Optional[int] = typer.Option(None, "--node-rank", "--node_rank", help="This machine's rank. [default: 0]", show_default=False),
    master_addr: Optional[str] = typer.Option(None, "--master-addr", "--master_addr", help="Address of node 0. [default: 127.0.0.1]", show_default=False),
    master_port: Optional[int] = typer.Option(None, "--master-port", "--master_port", help="Port of the run's store. [default: a free port]", show_default=False),
    join_timeout: Optional[float] = typer.Option(None, "--join-timeout", help="Seconds to wait for every node. [default: 120]", show_default=False),
    run_id: Optional[str] = typer.Option(None, "--run-id", "--run_id", help="Name of the run. [default: generated]", show_default=False),
) -> None:
    """Start and supervise one worker per device running SCRIPT."""
    typed: Dict[str, Any] = {
        "nproc": nproc, "module": module, "no_python": no_python, "max_restarts": max_restarts, "ft": ft,
        "min_replicas": min_replicas, "step_timeout": step_timeout, "shutdown_timeout": shutdown_timeout,
        "log_dir": log_dir, "quiet": quiet, "ranks": ranks, "nnodes": nnodes, "node_rank": node_rank,
        "master_addr": master_addr, "master_port": master_port, "join_timeout": join_timeout, "run_id": run_id,
    }
    typed = {k: v for k, v in typed.items() if v is not None}
    hook_flags = {
        "name": hook, "rank": rank, "start_iter": start_iter, "min_compression_rate": min_compression_rate,
        "error_feedback": False if no_error_feedback else None, "warm_start": False if no_warm_start else None,
        "orthogonalization_epsilon": orthogonalization_epsilon, "seed": seed,
        "batch_same_shape": batch_same_shape, "period": period, "wrap": wrap,
    }
    hook_flags = {k: v for k, v in hook_flags.items() if v is not None}
    if hook_flags:
        typed["hook"] = hook_flags
    if script is not None:
        typed["script"] = script
        typed["args"] = list(args or [])
    launch(typed, recipe)


@app.command("status")
def status_cmd(
    run_id: Optional[str] = typer.Argument(None, help="Show only this run.", show_default=False),
    watch: bool = typer.Option(False, "--watch", "-w", help="Refresh in place until Ctrl-C."),
    as_json: bool = typer.Option(False, "--json", help="Print the same data as JSON, for scripts."),
    clean: bool = typer.Option(False, "--clean", help="Remove the state of ended runs (logs are kept)."),
) -> None:
    """Live health of every ftrun run of this user on this machine."""
    from ftrun.status.view import status_main

    raise typer.Exit(status_main(run_id=run_id, watch=watch, as_json=as_json, clean_ended=clean))


@app.command("recipes")
def recipes_cmd(name: Optional[str] = typer.Argument(None, help="Print this bundled recipe.", show_default=False)) -> None:
    """List the bundled recipes, one line each, or print one."""
    from ftrun.recipe import recipes_main

    raise typer.Exit(recipes_main(name))


@app.command("validate")
def validate_cmd(file: str = typer.Argument(..., help="Recipe file (or bundled name) to check.")) -> None:
    """Check a recipe without running anything: exit 0 if good, 2 with one line if not."""
    from ftrun.recipe import validate_main

    raise typer.Exit(validate_main(file))


def launch(typed: Dict[str, Any], recipe: Optional[str]) -> None:
    from ftrun.recipe import config_with_recipe

    # Errors that only appear once recipe and flags are merged still point at the recipe's line.
    cfg = config_with_recipe(typed, recipe)
    from ftrun.supervisor.run import run_supervisor  # no torch at import: the supervisor loads it lazily

    code = run_supervisor(cfg)
    # The supervisor loaded torch (for the store); tearing it down at exit costs
    # half a second and does nothing useful once every worker is gone.
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def _route(argv: List[str]) -> List[str]:
    """`ftrun [RUN OPTIONS] SCRIPT ...` means `ftrun run ...`."""
    if not argv:
        return argv
    first = argv[0]
    if first in COMMANDS or first in ("--help", "-h", "--version"):
        return argv
    return ["run"] + argv


def main(argv: Optional[List[str]] = None) -> None:
    """Console entry point: exit 2 with one line for any user mistake."""
    argv = _route(list(sys.argv[1:] if argv is None else argv))
    if argv[:1] == ["status"]:
        # `ftrun status` runs while training is going on: skip building the typer app.
        from ftrun.status.view import fast_status

        try:
            code = fast_status(argv[1:])
        except ConfigError as e:
            _fail(str(e))
        if code is not None:
            sys.exit(code)
    command = typer.main.get_command(app)
    try:
        rv = command.main(args=argv, prog_name="ftrun", standalone_mode=False)
    except ConfigError as e:
        _fail(str(e))
    except KeyboardInterrupt:
        sys.exit(130)
    except SystemExit:
        raise
    except Exception as e:  # typer's own exceptions (its click is vendored: match by class)
        kinds = {c.__name__ for c in type(e).__mro__}
        if "NoArgsIsHelpError" in kinds:
            print(e.format_message() if hasattr(e, "format_message") else str(e))
            sys.exit(0)
        if "UsageError" in kinds:
            _fail(f"{e.format_message()} (see ftrun --help)")
        if "Abort" in kinds:
            sys.exit(130)
        if "Exit" in kinds:
            sys.exit(getattr(e, "exit_code", 0))
        raise
    sys.exit(rv if isinstance(rv, int) else 0)


def _fail(message: str) -> None:
    sys.stderr.write(f"ftrun: error: {message}\n")
    sys.stderr.flush()
    sys.exit(2)


if __name__ == "__main__":
    main()
