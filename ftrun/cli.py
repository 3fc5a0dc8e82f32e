"""The `ftrun` command line: run (the default), status, recipes, validate, report.

Parses flags with typer, turns the ones the user typed into a RunConfig and
hands it to the supervisor. A user's mistake becomes one line and exit 2.
This module must never import torch at module level: `--help`, `status`,
`recipes`, `validate` and `report` stay torch-free; only `run` reaches the supervisor.
"""

from __future__ import annotations

import inspect
import os
import sys
from typing import Any, Dict, List, Optional

import typer

from ftrun import __version__
from ftrun.errors import ConfigError
from ftrun.exits import EXIT_FAILED, EXIT_OK, EXIT_SIGINT, EXIT_USAGE
from ftrun.options import HOOK_OPTIONS, NEGATED, OPTIONS, OptionError

COMMANDS = ("run", "status", "recipes", "validate", "report")
RECIPE_HELP = "YAML recipe (file or bundled name); flags on the command line win."

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


def run_cmd(ctx: typer.Context, script: Optional[str] = None, args: Optional[List[str]] = None,
            recipe: Optional[str] = None, **given: Any) -> None:
    """Start and supervise one worker per device running SCRIPT."""
    typed: Dict[str, Any] = {}
    hook: Dict[str, Any] = {}
    for key, value in given.items():
        if value is None or value is False:
            continue  # a flag not given (False) is "not typed", so a recipe or PET_ may still set it
        if key in HOOK_OPTIONS:
            hook[key] = False if key in NEGATED else _hook_value(key, value)
        elif key == "hook":
            hook["name"] = value
        else:
            typed[key] = value
    if hook:
        typed["hook"] = hook
    if script is not None:
        typed["script"] = script
        typed["args"] = _script_args(ctx, list(args or []))
    launch(typed, recipe)


def _script_args(ctx: typer.Context, args: List[str]) -> List[str]:
    """The script's arguments as torchrun passes them: its argparse takes the command line's
    first `--` as the end of the launcher's options, so a `--` right after SCRIPT (when no `--`
    came before it) is dropped (`-m pkg.train -- --depth=26` gives `--depth=26`), and every
    later one is the script's. click keeps it, so the raw command line decides."""
    if args[:1] != ["--"]:
        return args
    argv = (ctx.obj or {}).get("argv")
    before = argv[:len(argv) - len(args) - 1] if argv is not None else []
    return args if "--" in before else args[1:]


def _hook_value(key: str, value: Any) -> Any:
    opt = HOOK_OPTIONS[key]
    try:
        return opt.parse(value)
    except OptionError as e:
        raise ConfigError(f"command line: {opt.flag} {e.problem}", key=key, problem=e.problem) from None


def _run_signature() -> inspect.Signature:
    """run_cmd's parameters, from the options schema: every spelling of every option, as text or flag."""
    params = [
        inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context),
        inspect.Parameter("script", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Optional[str],
                          default=typer.Argument(None, help="Training script (or module with -m, executable with "
                                                 "--no-python).", show_default=False, metavar="SCRIPT")),
        inspect.Parameter("args", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Optional[List[str]],
                          default=typer.Argument(None, help="Arguments for the script, passed untouched.",
                                                 show_default=False, metavar="[ARGS]...")),
        inspect.Parameter("recipe", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Optional[str],
                          default=typer.Option(None, "--recipe", help=RECIPE_HELP, show_default=False)),
    ]
    for opt in list(OPTIONS.values()) + list(HOOK_OPTIONS.values()):
        if not opt.flags:
            continue
        pet = f" [env: {opt.pet}]" if opt.pet else ""
        if opt.is_flag:
            default = typer.Option(False, *opt.flags, help=opt.help + pet, show_default=False)
            annotation: Any = bool
        else:
            default = typer.Option(None, *opt.flags, help=opt.help + pet, show_default=False,
                                   metavar=opt.metavar or "VALUE")
            annotation = Optional[str]
        params.append(inspect.Parameter(opt.key, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=annotation,
                                        default=default))
    return inspect.Signature(params)


run_cmd.__signature__ = _run_signature()  # type: ignore[attr-defined]
run_cmd.__annotations__ = {p.name: p.annotation for p in run_cmd.__signature__.parameters.values()}
app.command("run", context_settings={"allow_interspersed_args": False,
                                     "help_option_names": ["-h", "--help"]})(run_cmd)


@app.command("status")
def status_cmd(
    run_id: Optional[str] = typer.Argument(None, help="Show only this run.", show_default=False),
    watch: bool = typer.Option(False, "--watch", "-w", help="Refresh in place until Ctrl-C."),
    as_json: bool = typer.Option(False, "--json", help="Print the same data as JSON, for scripts."),
    clean: bool = typer.Option(False, "--clean", help="Remove the state of ended runs (logs are kept)."),
) -> None:
    """Live health of every ftrun run of this user on this machine."""
    from ftrun.status.command import status_main

    raise typer.Exit(status_main(run_id=run_id, watch=watch, as_json=as_json, clean_ended=clean))


@app.command("recipes")
def recipes_cmd(name: Optional[str] = typer.Argument(None, help="Print this bundled recipe.", show_default=False)) -> None:
    """List the bundled recipes, one line each, or print one."""
    from ftrun.recipe import recipes_main

    raise typer.Exit(recipes_main(name))


@app.command("report")
def report_cmd(
    run_id: Optional[str] = typer.Argument(None, help="The run (its id or a unique prefix); the newest run if left "
                                           "out.", show_default=False),
    output: Optional[str] = typer.Option(None, "--output", "-o", help="Where to write the page. [default: "
                                         "RUN-report.html here]", show_default=False, metavar="FILE"),
) -> None:
    """Write one self-contained HTML page of a run: replicas over time, failures, steps/s, checkpoints, goodput."""
    from ftrun.status.run_report import report_main

    raise typer.Exit(report_main(run_id, output))


@app.command("validate")
def validate_cmd(file: str = typer.Argument(..., help="Recipe file (or bundled name) to check.")) -> None:
    """Check a recipe without running anything: exit 0 if good, 2 with one line if not."""
    from ftrun.recipe import validate_main

    raise typer.Exit(validate_main(file))


def launch(typed: Dict[str, Any], recipe: Optional[str]) -> None:
    from ftrun.recipe import config_with_recipe

    dry_run = bool(typed.pop("dry_run", False))
    # Errors that only appear once recipe and flags are merged still point at the recipe's line.
    cfg = config_with_recipe(typed, recipe)
    if dry_run:
        from ftrun.plan import plan_text

        raise typer.Exit(_print_plan(plan_text(cfg)))
    from ftrun.supervisor.workers.env import import_env, quiet_torch_warnings

    if cfg.use_zygote:
        from ftrun.supervisor.workers.spawn import start_zygote_early

        start_zygote_early(import_env(cfg))  # before any thread: one torch import for the store and the zygote
    quiet_torch_warnings()  # workers keep the user's environment
    if cfg.rdzv == "c10d":
        from ftrun.supervisor.loop.c10d import run_c10d

        code = run_c10d(cfg)
    else:
        from ftrun.supervisor.loop.run import run_supervisor  # no torch at import: the supervisor loads it lazily

        code = run_supervisor(cfg)
    # The supervisor loaded torch (for the store); tearing it down at exit costs
    # half a second and does nothing useful once every worker is gone.
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def _print_plan(text: str) -> int:
    """The --dry-run plan on stdout: a reader that stops early (`| head`) is not an error; no stdout is."""
    try:
        if sys.stdout is None:
            raise OSError("standard output is closed")
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        sys.stdout = open(os.devnull, "w")  # nothing more to flush into the closed pipe at exit
    except OSError as e:
        sys.stdout = open(os.devnull, "w")
        sys.stderr.write(f"ftrun: error: cannot print the plan ({e.strerror or e}); give ftrun a standard output\n")
        return EXIT_FAILED
    return EXIT_OK


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
        from ftrun.status.command import fast_status

        try:
            code = fast_status(argv[1:])
        except ConfigError as e:
            _fail(str(e))
        if code is not None:
            sys.exit(code)
    command = typer.main.get_command(app)
    try:
        rv = command.main(args=argv, prog_name="ftrun", standalone_mode=False, obj={"argv": argv})
    except ConfigError as e:
        _fail(str(e))
    except KeyboardInterrupt:
        sys.exit(EXIT_SIGINT)
    except SystemExit:
        raise
    except Exception as e:  # typer's own exceptions (its click is vendored: match by class)
        kinds = {c.__name__ for c in type(e).__mro__}
        if "NoArgsIsHelpError" in kinds:
            print(e.format_message() if hasattr(e, "format_message") else str(e))
            sys.exit(EXIT_OK)
        if "UsageError" in kinds:
            _fail(f"{e.format_message()} (see ftrun --help)")
        if "Abort" in kinds:
            sys.exit(EXIT_SIGINT)
        if "Exit" in kinds:
            sys.exit(getattr(e, "exit_code", 0))
        raise
    sys.exit(rv if isinstance(rv, int) else 0)


def _fail(message: str) -> None:
    sys.stderr.write(f"ftrun: error: {message}\n")
    sys.stderr.flush()
    sys.exit(EXIT_USAGE)


if __name__ == "__main__":
    main()
