"""build_config: the RunConfig of a run, from the command line, a recipe, PET_* and Slurm, validated.

Every option is declared once in ftrun.options; here the sources are merged
with one precedence (command line > recipe > PET_* > Slurm > defaults), each
value is read by its option, and the result is one RunConfig. The node layout
(torchrun's launch modes) is resolved by ftrun.layout, the checks of bad input
are ftrun.checks, those of this machine ftrun.preflight; each problem is one
ConfigError that carries the key it is about.
This module must never import torch (the CLI and `ftrun validate` use it), and
never write, start or run anything: it only reads its sources.
"""

from __future__ import annotations

import difflib
import os
from typing import Any, Dict, Mapping, Optional, Tuple

from ftrun.checks import hang_after_s, validate
from ftrun.errors import CLI, ConfigError
from ftrun.hookspec import parse_hook
from ftrun.layout import resolve_layout, resolve_nproc, slurm_layout
from ftrun.machine import store_listen_addr
from ftrun.options import HOOK_OPTIONS, NEGATED, OPTIONS, OptionError, pet_values
from ftrun.run_config import DEFAULT_MAX_RESTARTS, DEFAULT_MAX_RESTARTS_FT, RunConfig

# RunConfig (ftrun.run_config), hang_after_s and store_listen_addr stay importable from here.
__all__ = ["OPTIONS", "RunConfig", "build_config", "validate", "closest", "hang_after_s", "store_listen_addr"]


def _hook_pets(pets: Mapping[str, Tuple[Any, str]]) -> Tuple[Dict[str, Any], Dict[str, str]]:
    """The hook the PET_ variables give, as a recipe's `hook:` mapping (typed as the command line
    types it), and the variable each key came from."""
    raw: Dict[str, Any] = {}
    names: Dict[str, str] = {}
    for key, (value, name) in pets.items():
        if key == "hook":
            raw["name"], names["name"] = str(value).strip(), name
        elif key in HOOK_OPTIONS:
            opt = HOOK_OPTIONS[key]
            if key in NEGATED:
                raw[key] = False
            else:
                try:
                    raw[key] = opt.parse(value)
                except OptionError as e:
                    raise ConfigError(f"environment: {name}={value!r} {e.problem}; fix it or unset {name}",
                                      key=f"hook.{key}", problem=e.problem) from None
            names[key] = name
    return raw, names


def closest(word: str, choices) -> str:
    """' (did you mean X?)' for the closest known word, or ''."""
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.5)
    return f" (did you mean {match[0]!r}?)" if match else ""


def _read(key: str, value: Any, source: str) -> Any:
    """One option's value from one source, or the one-line error saying where it came from."""
    opt = OPTIONS[key]
    try:
        return opt.parse(value)
    except OptionError as e:
        if source == CLI:
            raise ConfigError(f"{CLI}: {opt.flag} {e.problem}", key=key, problem=e.problem) from None
        if source.startswith("PET_"):
            raise ConfigError(f"environment: {source}={value!r} {e.problem}; fix it or unset {source}",
                              key=key, problem=e.problem) from None
        raise ConfigError(f"{source}: {key}: {e.problem}", key=key, problem=e.problem) from None


def build_config(cli: Mapping[str, Any], recipe: Optional[Mapping[str, Any]] = None,
                 recipe_name: Optional[str] = None, check_paths: bool = True,
                 environ: Optional[Mapping[str, str]] = None, check_script: bool = True) -> RunConfig:
    """Merge the sources key by key (command line > recipe > PET_* > Slurm > defaults) and validate.

    `cli` holds only options the user typed (plus `script`/`args` when given),
    as typed; `recipe` is a recipe mapping already checked key by key by
    ftrun.recipe; `environ` defaults to os.environ (PET_* and SLURM_* are read
    from it). check_paths=False skips every check that looks at the machine
    (files, ports, addresses, processes); check_script=False skips only the
    script's (`ftrun validate` of a recipe that names none).
    """
    environ = os.environ if environ is None else environ
    recipe = dict(recipe or {})
    where_recipe = recipe_name or "recipe"
    try:
        pets = pet_values(environ)
    except OptionError as e:
        name = OPTIONS[e.key].pet
        raise ConfigError(f"environment: {name}={environ.get(name)!r} {e.problem}; fix it or unset {name}",
                          key=e.key, problem=e.problem) from None
    slurm = slurm_layout(cli, recipe, pets, environ)
    sources: Dict[str, str] = {}

    def raw(key: str) -> Tuple[Any, str]:
        if cli.get(key) is not None:
            return cli[key], CLI
        if recipe.get(key) is not None:
            return recipe[key], where_recipe
        if key in pets:
            return pets[key]
        if key in slurm:
            return slurm[key], "Slurm (SLURM_* variables)"
        if key == "shutdown_timeout" and environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
            return environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"], "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
        return None, "default"

    def pick(key: str) -> Any:
        value, source = raw(key)
        sources[key] = source
        if value is None:
            return OPTIONS[key].default
        return _read(key, value, source)

    kw: Dict[str, Any] = {}

    # The script: CLI wins; a recipe may carry one (with args) for `ftrun --recipe X`.
    script, _ = raw("script")
    if not script:
        raise ConfigError("no training script given; usage: ftrun [OPTIONS] SCRIPT [ARGS]... (see ftrun --help)")
    # Arguments given on the command line win; without any, the recipe's args
    # apply unless the command line names a different script than the recipe's.
    recipe_script = recipe.get("script")
    same_script = not (cli.get("script") and recipe_script) or os.path.normpath(str(cli["script"])) == os.path.normpath(str(recipe_script))
    if cli.get("args"):
        args = tuple(str(a) for a in cli["args"])
    elif same_script:
        args = tuple(str(a) for a in (recipe.get("args") or ()))
    else:
        args = ()
    kw["script"] = str(script)
    kw["script_args"] = args

    kw["nproc"] = resolve_nproc(pick("nproc"), sources["nproc"])
    for key in ("max_restarts", "min_replicas", "replica_size", "spares", "step_timeout", "shutdown_timeout", "node_rank",
                "master_addr", "master_port", "join_timeout", "ft", "quiet", "verbose", "module", "no_python",
                "log_dir", "ranks", "metrics_port",
                "local_ranks_filter", "role", "signals_to_handle", "virtual_local_rank", "local_addr"):
        kw[key] = pick(key)
    kw["checkpoint_dir"] = pick("checkpoint_dir")
    kw["checkpoint_every"] = pick("checkpoint_every")
    kw["checkpoint_keep"] = pick("checkpoint_keep")
    kw["redirects"] = pick("redirects") or {}
    kw["tee"] = pick("tee") or {}
    if pick("run_path"):
        kw["no_python"] = False  # torchrun: --run-path takes precedence over --no-python
    # Accepted for torchrun; what ftrun does instead is in the reference (docs: Run options).
    for key in ("monitor_interval", "start_method", "event_log_handler", "duplicate_stdout_filters",
                "duplicate_stderr_filters", "logs_specs", "numa_binding"):
        pick(key)
    kw["min_nodes"], kw["max_nodes"] = pick("nnodes")
    kw["nnodes"] = kw["max_nodes"]
    resolve_layout(kw, pick, sources, check_paths)

    # Hook: CLI parameters override the recipe's, key by key, and the recipe's the PET_ variables'.
    hook_pet, pet_names = _hook_pets(pets)
    hook_raw: Dict[str, Any] = dict(recipe.get("hook") or {})
    hook_cli = dict(cli.get("hook") or {})
    if hook_raw.get("name") and hook_pet.get("name") and hook_raw["name"] != hook_pet["name"]:
        hook_pet = {}  # a recipe's other hook replaces the environment's whole hook
    hook_raw = {**hook_pet, **hook_raw}
    if hook_cli.get("name") and hook_raw.get("name") and hook_cli["name"] != hook_raw["name"]:
        hook_raw = {}  # a different hook on the command line replaces the recipe's whole hook
    hook_raw.update(hook_cli)
    if hook_raw:
        def origin(k: str) -> str:
            if k in hook_cli:
                return CLI
            return where_recipe if k in (recipe.get("hook") or {}) else pet_names.get(k, where_recipe)

        where = CLI if hook_cli else origin("name")
        sources["hook"] = where
        sources.update({f"hook.{k}": origin(k) for k in hook_raw if k != "name"})
        if "name" not in hook_raw:
            flags = ", ".join("--" + k.replace("_", "-") for k in hook_raw)
            raise ConfigError(f"{where}: {flags} given without a hook; add --hook NAME (e.g. --hook powersgd)",
                              key="hook")
        kw["hook"] = parse_hook(hook_raw, where)

    env = {str(k): str(v) for k, v in (recipe.get("env") or {}).items()}
    env.update({str(k): str(v) for k, v in (cli.get("env") or {}).items()})
    kw["env"] = env

    if kw.get("max_restarts") is None:
        kw["max_restarts"] = DEFAULT_MAX_RESTARTS_FT if kw.get("ft") else DEFAULT_MAX_RESTARTS
    kw["recipe"] = recipe_name
    kw["sources"] = sources
    # A --no-python command is no Python to fork; FTRUN_ZYGOTE=0 asks for a new process each start.
    kw["use_zygote"] = not kw["no_python"] and environ.get("FTRUN_ZYGOTE", "1") != "0"
    cfg = RunConfig(**kw)
    validate(cfg, check_paths=check_paths, check_script=check_script)
    return cfg
