"""The docs' reference pages, rendered from the code so that they cannot drift from it.

Each function returns one page's Markdown, read from the one place the code
declares it: the options schema (ftrun.options), the hook catalogue
(ftrun.hookspec), the registry of environment variables (ftrun.envvars), the
exit statuses (ftrun.exits), the state file's fields (ftrun.status), the
command line's own --help and the docstrings of ftrun/ft.py (read with ast:
ftrun.ft imports torch). The pages are committed under docs/reference/, so that
they read in a clone; `python scripts/docs_reference.py --write` rewrites them
(and the guides' diffs, scripts/docs_hooks.py, and the benchmark plots), and tests/test_docs.py fails
when one is stale. Never imports torch.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Iterable, Sequence

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GENERATED = ("<!-- Generated from the code by scripts/docs_reference.py: edit the code, not this page, "
             "and run `python scripts/docs_reference.py --write` (a test fails while it is stale). -->\n\n")


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(out) + "\n"


def _code(text: str) -> str:
    return f"`{text}`" if text else ""


# ---------------------------------------------------------------- run options

_DEFAULT_IN_HELP = re.compile(r"\s*\[default: ([^\]]*)\]")


def option_default(opt: Any) -> str:
    """The default as a reader should see it: the help's own words where it gives them."""
    m = _DEFAULT_IN_HELP.search(opt.help)
    if m:
        return m.group(1)
    d = opt.default
    if d is None:
        return "-"
    if isinstance(d, bool):
        return "on" if d else "off"
    if opt.key == "nnodes":
        return str(d[0])
    if isinstance(d, (tuple, list)):
        return ",".join(map(str, d))
    return f"{d:g}" if isinstance(d, float) else str(d)


def option_meaning(opt: Any) -> str:
    return _DEFAULT_IN_HELP.sub("", opt.help).strip()


def _option_entry(opt: Any, recipe_key: str) -> str:
    """One option as a heading (linkable as #key) and what it takes, its default, PET_ name and recipe key."""
    first, rest = opt.flags[0], opt.flags[1:]
    facts = [f"takes: {opt.kind}" if not opt.is_flag else "a flag", f"default: {option_default(opt)}"]
    if opt.pet:
        facts.append(f"environment: `{opt.pet}`")
    facts.append(f"recipe: `{recipe_key}`" if opt.recipe else "not in recipes")
    lines = [f"### `{first}` {{#{opt.key.replace('_', '-')}}}\n", option_meaning(opt) + "\n",
             " · ".join(facts) + "\n"]
    if rest:
        lines.append("Also spelled " + ", ".join(f"`{f}`" for f in rest) + ".\n")
    if opt.torchrun:
        lines.append(f"torchrun's option; what ftrun does with it: {opt.torchrun}.\n")
    return "\n".join(lines)


def _option_entries(options: Iterable[Any], recipe_key=lambda o: o.key) -> str:
    return "\n".join(_option_entry(o, recipe_key(o)) for o in options if o.flags)


def torchrun_table() -> list:
    """(torchrun spellings, PET_ name, what ftrun does) for each of torchrun's options."""
    from ftrun.options import OPTIONS_LIST

    rows = []
    for opt in OPTIONS_LIST:
        if not opt.torchrun:
            continue
        spellings = [f for f in opt.flags if f not in ("--nproc", "--run-id", "--run_id")]
        rows.append((", ".join(f"`{f}`" for f in spellings), f"`{opt.pet}`" if opt.pet else "-", opt.torchrun))
    return rows


def options_page() -> str:
    from ftrun.cli import RECIPE_HELP
    from ftrun.options import HOOK_FLAGS, OPTIONS_LIST

    torchruns = [o for o in OPTIONS_LIST if o.torchrun]
    own = [o for o in OPTIONS_LIST if not o.torchrun]
    summary = _table(["option", "meaning"], [[", ".join(f"[`{f}`](#{o.key.replace('_', '-')})" for f in o.flags[:1]),
                                              option_meaning(o)] for o in list(OPTIONS_LIST) + list(HOOK_FLAGS)
                                             if o.flags]
                     + [["[`--recipe`](#recipe)", RECIPE_HELP]])
    page = ["# Run options\n", GENERATED,
            "Every option of `ftrun run` (and of `ftrun SCRIPT ...`, the same command), from the one options "
            "schema in `ftrun/options.py`. Options come before SCRIPT; everything after SCRIPT goes to the "
            "script. A value comes from, key by key: **the command line > a recipe > `PET_*` > Slurm > the "
            "default** ([where a value comes from](../guides/running.md#where-a-value-comes-from)); "
            "`ftrun --dry-run ...` shows each value and its source. A bad value from any of them is one line "
            "naming it, exit 2, nothing started.\n",
            "## At a glance\n", summary,
            "\n## torchrun's options\n",
            "Both of torchrun's spellings are accepted. The environment variable is the `PET_` one torchrun "
            "(and ftrun) reads when the option is not given.\n",
            _option_entries(torchruns),
            "\n## ftrun's own options\n",
            f"### `--recipe` {{#recipe}}\n\n{RECIPE_HELP} See [Recipes](../guides/recipes.md).\n\n"
            f"takes: a file, or a bundled recipe's name · default: - · not in recipes\n",
            _option_entries(own),
            "\n## Hook parameters\n",
            "They go with `--hook` (see [Hooks](hooks.md) for which hook takes which); in a recipe they are "
            "keys of the `hook:` mapping.\n",
            _option_entries(HOOK_FLAGS, recipe_key=_hook_recipe_key),
            "\n## What ftrun does with each of torchrun's options\n",
            _table(["torchrun option", "`PET_` variable", "what ftrun does with it"], torchrun_table()),
            "\n`--nproc` and `--run-id` are ftrun's spellings of `--nproc-per-node` and `--rdzv-id`.\n"]
    return "\n".join(page)


def _hook_recipe_key(opt: Any) -> str:
    from ftrun.options import NEGATED

    if opt.key in NEGATED:
        return f"hook.{opt.key}: false"
    return f"hook.{opt.key}"


# ---------------------------------------------------------------- the command line


def _help(*args: str) -> str:
    env = dict(os.environ, COLUMNS="100", TERM="dumb", NO_COLOR="1")
    out = subprocess.run([sys.executable, "-m", "ftrun", *args, "--help"], capture_output=True, text=True,
                         env=env, cwd=str(ROOT), timeout=60)
    if out.returncode != 0:
        raise RuntimeError(f"ftrun {' '.join(args)} --help failed ({out.returncode}): {out.stderr.strip()}")
    return out.stdout.rstrip()


def cli_page() -> str:
    parts = ["# Command line\n", GENERATED,
             "What `--help` prints for each command. `ftrun [RUN OPTIONS] SCRIPT [ARGS]...` is the same as "
             "`ftrun run ...`; `--help`, `status`, `recipes` and `validate` never import torch. Every run "
             "option is described in [Run options](options.md).\n"]
    for args, title in (((), "ftrun"), (("run",), "ftrun run"), (("status",), "ftrun status"),
                        (("recipes",), "ftrun recipes"), (("validate",), "ftrun validate")):
        parts += [f"## `{title}`\n", "```text", _help(*args), "```\n"]
    return "\n".join(parts)


# ---------------------------------------------------------------- hooks


def hooks_page() -> str:
    from ftrun.hookspec import (DEFAULT_OVERRIDES, HALF_WRAPS, HOOK_NAMES, HOOK_PARAMS, PARAMS, REQUIRED, WRAP_NAMES,
                                 WRAPPABLE)

    rows = []
    for name in HOOK_NAMES:
        params = ", ".join(f"`{PARAMS[p].flag}`" + (" (required)" if p in REQUIRED.get(name, ()) else "")
                           for p in HOOK_PARAMS[name]) or "none"
        rows.append([f"`{name}`", params, ", ".join(WRAP_NAMES if name == "diloco" else HALF_WRAPS) if name in WRAPPABLE else "no"])
    prow = []
    for key, p in PARAMS.items():
        hooks = [n for n in HOOK_NAMES if key in HOOK_PARAMS[n]]
        default = "required" if p.default is None else ("on" if p.default is True else "off" if p.default is False
                                                         else p.default)
        overrides = [f"{n}: {DEFAULT_OVERRIDES[n][key]}" for n in hooks if key in DEFAULT_OVERRIDES.get(n, {})]
        if overrides:
            default = f"{default} ({', '.join(overrides)})"
        kind = "flag" if p.kind is bool else ("whole number" if p.kind is int else "number")
        bound = "" if p.minimum is None or p.kind is bool else f" >= {p.minimum:g}"
        key_text = f"`{key}: false`" if p.flag.startswith("--no-") else f"`{key}`"
        prow.append([f"`{p.flag}`", key_text, kind + bound, default, ", ".join(hooks), p.help])
    return "\n".join([
        "# Hooks\n", GENERATED,
        "The DDP communication hooks `--hook` puts on every DDP model of the script, from the catalogue in "
        "`ftrun/hookspec.py`; how to choose one is in the [hooks guide](../guides/hooks.md).\n",
        "## Hooks and the parameters each takes\n",
        _table(["`--hook`", "parameters", f"`--wrap {'|'.join(WRAP_NAMES)}`"], rows),
        "\nA parameter a hook does not take is refused with one line (exit 2), as is a `--wrap` on a hook "
        "that cannot be wrapped.\n",
        "## Parameters\n",
        _table(["flag", "recipe key (under `hook:`)", "takes", "default", "hooks", "meaning"], prow),
        f"\n`--wrap {'|'.join(HALF_WRAPS)}` (recipe: `hook.wrap`) sends whatever the hook sends in half "
        f"precision; it applies to {', '.join(f'`{n}`' for n in WRAPPABLE)}. `--wrap int8` applies to `diloco` "
        f"alone: its syncs send the pseudo-gradients as int8, one scale per chunk, with error feedback "
        f"(the [hooks guide](../guides/hooks.md)).\n",
    ])


# ---------------------------------------------------------------- environment


def environment_page() -> str:
    from ftrun.envvars import INTERNAL, KINDS, SETTING, TEST, TORCHRUN, WORKER, DEVELOPMENT, of_kind

    parts = ["# Environment variables\n", GENERATED,
             "Every variable ftrun sets in a worker or reads, from the registry in `ftrun/envvars.py` (a test "
             "checks that every `FTRUN_` name in the code is listed there). `ftrun --dry-run ...` prints the "
             "environment each worker of a launch line gets.\n",
             "A pod's or a job's own `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT` never "
             "reach the workers: every torchrun variable is ftrun's. A recipe's `env:` adds variables of its "
             "own. The `PET_*` variables torchrun reads are options: see [Run options](options.md).\n"]
    for kind in (TORCHRUN, WORKER):
        parts += [f"## {KINDS[kind][0].upper()}{KINDS[kind][1:]}\n",
                  _table(["variable", "when", "meaning"],
                         [[f"`{v.name}`", v.when or "always", v.meaning] for v in of_kind(kind)])]
    for kind in (SETTING, INTERNAL, TEST, DEVELOPMENT):
        parts += [f"\n## {KINDS[kind][0].upper()}{KINDS[kind][1:]}\n",
                  _table(["variable", "default", "meaning"],
                         [[f"`{v.name}`", v.default or "-", v.meaning] for v in of_kind(kind)])]
    return "\n".join(parts)


# ---------------------------------------------------------------- exit statuses


def exit_codes_page() -> str:
    from ftrun.exits import EXIT_STATUSES

    own = [[f"**{e.code}**", _code(e.name) if e.name != "-" else "", e.meaning] for e in EXIT_STATUSES
           if e.who == "ftrun"]
    worker = [[f"**{e.code}**", _code(e.name), e.meaning] for e in EXIT_STATUSES if e.who == "worker"]
    return "\n".join([
        "# Exit statuses\n", GENERATED,
        "From the named constants in `ftrun/exits.py`.\n",
        "## What `ftrun` exits with\n",
        _table(["status", "constant", "meaning"], own),
        "\nA scheduler that retries on a status: retry on 200 (and, if you like, on 128 + N for a signal a "
        "pre-emption sends); 2 is a mistake to fix, and retrying it changes nothing. See "
        "[Checkpoints](../guides/checkpoints.md#requeue) for Slurm and Kubernetes.\n",
        "## Between a worker and its ftrun\n",
        "A worker of a `--ft` run may exit with these on purpose; ftrun reads them and acts:\n",
        _table(["status", "constant", "meaning"], worker),
    ])


# ---------------------------------------------------------------- recipes


def recipes_page() -> str:
    from ftrun.options import OPTIONS_LIST
    from ftrun.recipe import bundled_recipes

    rows = []
    for opt in OPTIONS_LIST:
        if not opt.recipe:
            continue
        flag = opt.flag if opt.flags else "-"
        rows.append([f"`{opt.key}`", opt.kind if opt.key not in ("env", "args") else
                     ("mapping NAME: value" if opt.key == "env" else "list"),
                     option_default(opt), f"`{flag}`" if opt.flags else "-", option_meaning(opt)])
    rows.append(["`hook`", "a name, or a mapping with `name:` and the parameters", "none", "`--hook` and "
                 "its parameters", "See [Hooks](hooks.md): keys are the parameters' names (`rank`, `start_iter`, "
                 "..., `wrap`)."])
    bundled = []
    for path in bundled_recipes():
        desc = ""
        for line in path.read_text().splitlines():
            if line.startswith("description:"):
                desc = line.split(":", 1)[1].strip()
        bundled.append([f"`{path.stem}`", desc])
    return "\n".join([
        "# Recipe schema\n", GENERATED,
        "A recipe is a YAML mapping of these keys (the run options, spelled with underscores), read with "
        "`yaml.safe_load` only. Every key is optional; a key with no value means the default. How to write "
        "and check one: [the recipes guide](../guides/recipes.md).\n",
        _table(["key", "takes", "default", "flag", "meaning"], sorted(rows, key=lambda r: r[0])),
        "\n## Bundled recipes\n",
        "`ftrun recipes NAME` prints one, comments included.\n",
        _table(["name", "description"], bundled),
    ])


# ---------------------------------------------------------------- ftrun status --json


def status_json_page() -> str:
    from ftrun.status.state import REPLICA_FIELDS, RUN_FIELDS
    from ftrun.status.view import DERIVED_REPLICA_FIELDS, DERIVED_RUN_FIELDS

    return "\n".join([
        "# `ftrun status --json`\n", GENERATED,
        "A list with one object per run: every field of the run's state file (`ftrun/status/state.py`), plus "
        "what `ftrun status` works out as it reads it (`ftrun/status/view.py`). Times are Unix seconds. "
        "`--watch --json` prints one such document per line.\n",
        "## A run\n",
        _table(["field", "meaning"], [[f"`{k}`", v] for k, v in RUN_FIELDS.items()]),
        "\nAdded by `ftrun status`:\n",
        _table(["field", "meaning"], [[f"`{k}`", v] for k, v in DERIVED_RUN_FIELDS.items()]),
        "\n## A replica (each item of `replicas`)\n",
        _table(["field", "meaning"], [[f"`{k}`", v] for k, v in REPLICA_FIELDS.items()]),
        "\nAdded by `ftrun status`:\n",
        _table(["field", "meaning"], [[f"`{k}`", v] for k, v in DERIVED_REPLICA_FIELDS.items()]),
        "\nA field written by a newer ftrun that this `ftrun status` does not know is left out, not an error; "
        "a state file that cannot be read shows as `phase: \"unreadable\"` with its `problem`.\n",
    ])


# ---------------------------------------------------------------- the ftrun.ft API


def _docstring_markdown(doc: str) -> str:
    """A docstring as Markdown: its indented blocks (examples) fenced as Python."""
    out: list = []
    for para in doc.strip().split("\n\n"):
        lines = para.split("\n")
        if all(line.startswith("    ") or not line.strip() for line in lines):
            out.append("```python\n" + "\n".join(line[4:] for line in lines) + "\n```")
        else:
            out.append(" ".join(line.strip() for line in lines))
    return "\n\n".join(out) + "\n"


def _signature(fn: Any) -> str:
    import ast

    returns = f" -> {ast.unparse(fn.returns)}" if fn.returns is not None else ""
    return f"ftrun.ft.{fn.name}({ast.unparse(fn.args)}){returns}"


def _class_section(name: str, module: str) -> list:
    """A class ftrun/ft.py imports (`from ftrun.worker.ft.X import Name`): its constructor, its
    docstring, and its own properties (its methods are its torch base's, said in its docstring)."""
    import ast

    tree = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)
    if cls is None:
        raise RuntimeError(f"ftrun/ft.py imports {name} from {module}, which defines no such class")
    init = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    args = ""
    if init is not None:
        init.args.args = init.args.args[1:]  # self
        args = ast.unparse(init.args)
    full = {a.asname or a.name: f"{n.module}.{a.name}" for n in tree.body if isinstance(n, ast.ImportFrom)
            for a in n.names}
    bases = ", ".join(full.get(ast.unparse(b), ast.unparse(b)) for b in cls.bases)
    parts = [f"## `ft.{name}` {{#{name.lower()}}}\n", "```python", f"class ftrun.ft.{name}({args})  # a {bases}",
             "```\n", _docstring_markdown(ast.get_docstring(cls) or "(no docstring)")]
    members = []
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_") and ast.get_docstring(node) and \
                any(ast.unparse(d) == "property" for d in node.decorator_list):
            members.append(f"- `{node.name}`: {' '.join(ast.get_docstring(node).split())}")
    if members:
        parts += ["\n".join(members) + "\n"]
    return parts


def ft_api_page() -> str:
    """Every public name of ftrun/ft.py (its __all__, in that order): a function's signature and
    docstring, or a class's (defined where ft.py imports it from), read from the source with ast."""
    import ast

    tree = ast.parse((ROOT / "ftrun" / "ft.py").read_text())
    public: list = []
    imported: Dict[str, str] = {}
    functions: Dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            public = list(ast.literal_eval(node.value))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ftrun."):
            imported.update({alias.name: node.module for alias in node.names if alias.asname is None})
        elif isinstance(node, ast.FunctionDef):
            functions[node.name] = node
    parts = ["# The `ftrun.ft` API\n", GENERATED,
             "What a training script calls under `ftrun --ft`, rendered from the docstrings of `ftrun/ft.py` "
             "and of the classes it names "
             "(`help(ftrun.ft.X)` says the same). How to use it: [Fault tolerance](../guides/fault-tolerance.md), "
             "[Porting a torchrun script to --ft](../guides/porting-to-ft.md) and "
             "[Sharded replicas](../guides/sharded-replicas.md).\n",
             _docstring_markdown(ast.get_docstring(tree) or "")]
    for name in public:
        if name in functions:
            node = functions[name]
            parts += [f"## `ft.{name}` {{#{name.lower()}}}\n", "```python", _signature(node), "```\n",
                      _docstring_markdown(ast.get_docstring(node) or "(no docstring)")]
        elif name in imported:
            parts += _class_section(name, imported[name])
        else:
            raise RuntimeError(f"ftrun/ft.py's __all__ names what it neither defines nor imports: {name}")
    return "\n".join(parts)


PAGES: Dict[str, Any] = {
    "reference/options.md": options_page,
    "reference/cli.md": cli_page,
    "reference/hooks.md": hooks_page,
    "reference/environment.md": environment_page,
    "reference/exit-codes.md": exit_codes_page,
    "reference/recipes.md": recipes_page,
    "reference/status-json.md": status_json_page,
    "reference/ft-api.md": ft_api_page,
}


def stale(docs: Path = ROOT / "docs") -> Dict[str, str]:
    """{page: its fresh text} for every committed page that differs from what the code renders now:
    the reference pages, the guides' `<!-- diff: A B -->` blocks (scripts/docs_hooks.py) and the
    benchmark pages' plots (scripts/docs_plots.py, when matplotlib is there to draw them)."""
    import docs_hooks

    fresh = {path: render() for path, render in PAGES.items()}
    try:  # the benchmark pages' plots, drawn from their tables (the docs extra's matplotlib)
        import docs_plots
        fresh.update(docs_plots.plots(docs))
    except ImportError:
        pass
    for md in sorted(docs.rglob("*.md")):
        rel = md.relative_to(docs).as_posix()
        if rel not in fresh and docs_hooks.MARKER.search(md.read_text()):
            fresh[rel] = docs_hooks.fill(md.read_text())
    return {rel: text for rel, text in fresh.items()
            if not (docs / rel).is_file() or (docs / rel).read_text() != text}


def main(argv: Sequence[str]) -> int:
    if list(argv) not in ([], ["--write"], ["--check"]):
        print("usage: python scripts/docs_reference.py [--write | --check]", file=sys.stderr)
        return 2
    changed = stale()
    if argv == ["--write"]:
        for rel, text in changed.items():
            (ROOT / "docs" / rel).parent.mkdir(parents=True, exist_ok=True)
            (ROOT / "docs" / rel).write_text(text)
            print(f"wrote docs/{rel}")
        return 0
    for rel in changed:
        print(f"stale: docs/{rel} (python scripts/docs_reference.py --write)")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main(sys.argv[1:]))
