"""Recipes: YAML files holding run options, loaded with yaml.safe_load and checked.

A recipe is a mapping of the keys in ftrun.config.OPTIONS. Values come from
yaml.safe_load; line numbers come from a second, read-only walk of the
yaml.compose() node tree, so every bad recipe is reported as ONE ConfigError
line naming the file, the line and the key (the CLI turns it into exit 2).
This module must never import torch, never run anything, and never use a YAML
loader that can build arbitrary Python objects.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Tuple

import yaml

from ftrun.errors import ConfigError

if TYPE_CHECKING:
    from ftrun.config import RunConfig

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass
class Recipe:
    """A recipe read from disk: safe_load values plus the line of every key."""

    path: Path
    data: Dict[str, Any]
    lines: Dict[str, int] = field(default_factory=dict)  # "nproc" or "hook.rank" -> 1-based line
    texts: Dict[str, str] = field(default_factory=dict)  # top-level key -> its scalar value as written

    def line(self, key: str) -> int:
        return self.lines.get(key) or self.lines.get(key.split(".")[0]) or 1

    def error(self, key: Optional[str], message: str) -> ConfigError:
        where = f"{self.path}:{self.line(key) if key else 1}"
        return ConfigError(f"{where}: {key}: {message}" if key else f"{where}: {message}")


# ---------------------------------------------------------------------------
# Finding and reading


def bundled_recipes() -> List[Path]:
    return sorted(RECIPES_DIR.glob("*.yaml"))


def find_recipe(name_or_path: str) -> Path:
    """A path as given, else a bundled recipe by name (with or without .yaml)."""
    p = Path(name_or_path)
    if p.exists():
        if p.is_dir():
            raise ConfigError(f"recipe {name_or_path!r} is a folder; give a .yaml file or a bundled recipe name")
        return p
    if "/" not in name_or_path:
        for cand in (RECIPES_DIR / name_or_path, RECIPES_DIR / f"{name_or_path}.yaml"):
            if cand.is_file():
                return cand
    from ftrun.config import closest

    names = [b.stem for b in bundled_recipes()]
    hint = closest(Path(name_or_path).stem, names) or (f" (bundled: {', '.join(names)})" if names else "")
    raise ConfigError(f"recipe {name_or_path!r} not found: no such file, and no bundled recipe of that name{hint}")


def read_recipe(path: Path) -> Recipe:
    """Parse a recipe file: shape and YAML only (no option checks yet)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: recipe file not found") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file (a recipe is UTF-8 YAML)") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read recipe: {e.strerror or e}") from None

    try:
        data = yaml.safe_load(text)
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        # An error at the end of the stream is marked one line past the last; point at the last.
        line = min(mark.line + 1 if mark else 1, max(1, len(text.splitlines())))
        near = _key_near(text, line)
        problem = (e.problem or e.context or "syntax error").strip()
        raise ConfigError(f"{path}:{line}: invalid YAML{f' near key {near!r}' if near else ''}: {problem}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}:1: invalid YAML: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None

    if data is None:
        raise ConfigError(f"{path}:1: empty recipe; write option: value lines, e.g. 'nproc: 2' (see ftrun recipes)")
    if not isinstance(data, dict) or not isinstance(root, yaml.MappingNode):
        kind = type(data).__name__ if not isinstance(data, list) else "list"
        raise ConfigError(f"{path}:1: a recipe must be a mapping of option: value lines, not a {kind}")

    recipe = Recipe(path=path, data=data)
    _collect_lines(recipe, root, prefix="")
    return recipe


def _collect_lines(recipe: Recipe, node: yaml.MappingNode, prefix: str) -> None:
    """Record each key's line; reject duplicate and non-text keys (safe_load would silently keep the last)."""
    seen: Dict[str, int] = {}
    for key_node, value_node in node.value:
        line = key_node.start_mark.line + 1
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag != "tag:yaml.org,2002:str":
            shown = getattr(key_node, "value", "?")
            raise ConfigError(f"{recipe.path}:{line}: key {shown!r}: keys must be option names (text)")
        name = prefix + key_node.value
        if name in seen:
            raise ConfigError(f"{recipe.path}:{line}: {name}: duplicate key (first set on line {seen[name]}); keep one")
        seen[name] = line
        recipe.lines[name] = line
        if not prefix and isinstance(value_node, yaml.ScalarNode):
            recipe.texts[name] = value_node.value
        # Nested keys matter only one level down, for hook parameters and env names.
        if not prefix and isinstance(value_node, yaml.MappingNode):
            _collect_lines(recipe, value_node, prefix=name + ".")


def _key_near(text: str, line: int) -> Optional[str]:
    """The top-level key at or above `line` (1-based), to point at the broken entry."""
    lines = text.splitlines()
    for i in range(min(line, len(lines)) - 1, -1, -1):
        m = re.match(r"^([A-Za-z_][\w-]*)\s*:", lines[i])
        if m:
            return m.group(1)
    return None


# ---------------------------------------------------------------------------
# Checking each key


def _describe(value: Any) -> str:
    if value is None:
        return "nothing"
    if isinstance(value, (dict, list)):
        return f"a {'mapping' if isinstance(value, dict) else 'list'}"
    return repr(value)


def check_recipe(recipe: Recipe) -> Dict[str, Any]:
    """Check every key's type and range on its own (through ftrun.options); return the mapping build_config takes.

    Cross-key checks (node_rank < nnodes, ...) are left to build_config, since
    command-line flags may still change the other keys; `ftrun validate` runs
    them on the recipe as it stands.
    """
    from ftrun.config import closest
    from ftrun.options import OPTIONS

    out: Dict[str, Any] = {}
    for key, value in recipe.data.items():
        opt = OPTIONS.get(key)
        if opt is None or not opt.recipe:
            dashed = key.replace("-", "_").lstrip("_")
            known = [k for k, o in OPTIONS.items() if o.recipe]
            hint = f" (did you mean {dashed!r}?)" if dashed in known else closest(key, known)
            raise recipe.error(key, f"unknown key{hint}")
        if value is None:
            continue  # `key:` with no value means "the default", as for a flag not given
        if isinstance(value, int) and ":" in recipe.texts.get(key, ""):
            # YAML 1.1 reads 2:4 as the base-60 number 124; `nnodes: 2:4` means MIN:MAX.
            value = recipe.texts[key]
        out[key] = _check_value(recipe, key, value)
    return out


def _check_value(recipe: Recipe, key: str, value: Any) -> Any:
    """The value as written (build_config reads it again, as it reads every source), once it passes its check."""
    from ftrun.options import OPTIONS, OptionError

    err = recipe.error
    if key == "hook":
        return _check_hook(recipe, value)
    if key == "env":
        return _check_env(recipe, value)
    if key == "args":
        if not isinstance(value, list):
            raise err(key, f"must be a list of script arguments, e.g. [--epochs, 3], not {_describe(value)}")
        for item in value:
            if isinstance(item, bool) or not isinstance(item, (str, int, float)):
                raise err(key, f"each argument must be text or a number (quote {item!r} if you mean the word)")
        return [str(a) for a in value]
    opt = OPTIONS[key]
    if opt.is_flag and not isinstance(value, bool):
        raise err(key, f"must be true or false, not {_describe(value)}")
    if isinstance(value, float) and value != value:
        raise err(key, "must be a number, not .nan")
    try:
        opt.parse(value)
    except OptionError as e:
        raise err(key, e.problem) from None
    return value


def _check_env(recipe: Recipe, value: Any) -> Dict[str, str]:
    if not isinstance(value, dict):
        raise recipe.error("env", f"must be a mapping of NAME: value, not {_describe(value)}")
    out: Dict[str, str] = {}
    for name, v in value.items():
        key = f"env.{name}"
        if not isinstance(name, str) or not _ENV_NAME.match(name):
            raise recipe.error(key, "not a valid environment variable name (letters, digits and _, not starting with a digit)")
        # YAML turns yes/no/on/off into booleans: the worker would see 'True'; make the user say what they mean.
        if isinstance(v, bool):
            raise recipe.error(key, f"is {v!r} as YAML reads it; quote it (e.g. \"1\" or \"true\") to pass text")
        if v is None or not isinstance(v, (str, int, float)):
            raise recipe.error(key, f"must be text or a number, not {_describe(v)}")
        out[name] = str(v)
    return out


def _check_hook(recipe: Recipe, value: Any) -> Dict[str, Any]:
    """The hook mapping, checked by ftrun.hookspec.parse_hook; an error lands on the line of the key it names."""
    from ftrun.hookspec import parse_hook

    if isinstance(value, str):
        value = {"name": value}  # `hook: fp16` is shorthand for `hook: {name: fp16}`
    if not isinstance(value, dict):
        raise recipe.error("hook", f"must be a hook name or a mapping such as {{name: powersgd, rank: 1}}, not {_describe(value)}")
    if "name" not in value or value["name"] is None:
        raise recipe.error("hook", "needs a 'name:' (allreduce, fp16, bf16, powersgd, batched-powersgd, localsgd, noop)")
    raw = {k: v for k, v in value.items() if v is not None}
    try:
        parse_hook(raw, "")
    except ConfigError as e:
        raise _hook_error(recipe, e) from None
    return raw


def _hook_error(recipe: Recipe, e: ConfigError) -> ConfigError:
    where_key = f"hook.{e.key}" if e.key and f"hook.{e.key}" in recipe.lines else "hook"
    return ConfigError(f"{recipe.path}:{recipe.line(where_key)}: {where_key}: {e.problem}", key=where_key,
                       problem=e.problem)


# ---------------------------------------------------------------------------
# Entry points


def load_recipe(name_or_path: str) -> Tuple[Dict[str, Any], str]:
    """(checked mapping, display name) for a recipe file or bundled recipe name.

    Raises ConfigError (one line: file, line, key) for anything wrong in the
    recipe on its own.
    """
    recipe = read_recipe(find_recipe(name_or_path))
    return check_recipe(recipe), str(recipe.path)


def config_with_recipe(typed: Mapping[str, Any], name_or_path: Optional[str], check_paths: bool = True,
                       check_script: bool = True) -> "RunConfig":
    """RunConfig from the flags the user typed and an optional recipe (what `ftrun --recipe` runs).

    Like load_recipe + build_config; a problem whose key took its value from the
    recipe (even one that shows only once recipe and command line are merged) is
    placed on that key's line.
    """
    from ftrun.config import build_config

    if not name_or_path:
        return build_config(typed, None, None, check_paths=check_paths, check_script=check_script)
    recipe = read_recipe(find_recipe(name_or_path))
    data = check_recipe(recipe)
    try:
        return build_config(typed, data, str(recipe.path), check_paths=check_paths, check_script=check_script)
    except ConfigError as e:
        from ftrun.config import OPTIONS

        key = e.key or ""
        if key in OPTIONS:
            if key in data and typed.get(key) is None:
                raise recipe.error(key, e.problem) from None
        elif key and key in (data.get("hook") or {}) and key not in (typed.get("hook") or {}):
            raise recipe.error(f"hook.{key}", e.problem) from None
        raise


def validate_recipe(name_or_path: str) -> Tuple[Recipe, "RunConfig"]:
    """Every check `ftrun --recipe` would make here, with nothing started: (recipe, RunConfig).

    That includes the machine (folders, addresses, ports, torch, a live run of the same id) and,
    when the recipe names a script, the script (found from the working directory and compiled,
    as a run would); a recipe without one is checked for everything else."""
    recipe = read_recipe(find_recipe(name_or_path))
    data = check_recipe(recipe)
    script = data.get("script")
    # The recipe's own script is taken from the recipe, so a problem with it lands on its line.
    cfg = config_with_recipe({} if script else {"script": "<script>"}, str(recipe.path), check_script=bool(script))
    return recipe, cfg


def recipe_description(path: Path) -> str:
    """The recipe's `description:` line, or why it cannot be read (listing never fails)."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        return f"(unreadable: {type(e).__name__})"
    if isinstance(data, dict) and isinstance(data.get("description"), str):
        return data["description"].strip()
    return ""


def recipes_main(name: Optional[str] = None) -> int:
    """`ftrun recipes [NAME]`: list the bundled recipes, or print one as written."""
    from rich.console import Console

    if name:
        path = find_recipe(name)
        text = path.read_text(encoding="utf-8")
        if sys.stdout.isatty():
            from rich.syntax import Syntax

            Console().print(Syntax(text, "yaml", theme="ansi_dark", background_color="default"))
        else:
            sys.stdout.write(text)  # as written, so `ftrun recipes X > mine.yaml` makes a copy to edit
        return 0

    from rich.table import Table

    # Piped output keeps one line per recipe (grep-able); a terminal gets its own width.
    console = Console(width=None if sys.stdout.isatty() else 400)
    paths = bundled_recipes()
    if not paths:
        console.print(f"no bundled recipes in {RECIPES_DIR}")
        return 0
    table = Table(box=None, show_header=True, header_style="bold", pad_edge=False)
    table.add_column("recipe", style="cyan", no_wrap=True)
    table.add_column("description")
    for p in paths:
        table.add_row(p.stem, recipe_description(p))
    console.print(table)
    console.print("[dim]ftrun recipes NAME prints one; ftrun --recipe NAME SCRIPT runs it[/dim]", highlight=False)
    return 0


def validate_main(file: str) -> int:
    """`ftrun validate FILE`: exit 0 if the recipe is good; ConfigError (exit 2) otherwise. Starts nothing."""
    from rich.console import Console

    recipe, cfg = validate_recipe(file)
    keys = ", ".join(k for k in recipe.data if k != "description") or "no options"
    hook = cfg.hook.describe() if cfg.hook is not None else "none"
    Console(highlight=False, soft_wrap=True).print(f"[green]ok[/green] {recipe.path}: {keys}; hook: {hook}")
    return 0
