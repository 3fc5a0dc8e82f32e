"""Recipes: YAML files holding run options, loaded with yaml.safe_load and checked.

A recipe is a mapping of the keys in ftrun.config.OPTIONS. Loading reports a
bad recipe as one ConfigError line naming the file, the line and the key.
This module must never import torch, and never run anything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Tuple

import yaml

from ftrun.errors import ConfigError

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"


def find_recipe(name_or_path: str) -> Path:
    """A path as given, else a bundled recipe by name (with or without .yaml)."""
    p = Path(name_or_path)
    if p.exists():
        return p
    for cand in (RECIPES_DIR / name_or_path, RECIPES_DIR / f"{name_or_path}.yaml"):
        if cand.is_file():
            return cand
    raise ConfigError(f"recipe {name_or_path!r} not found: no such file, and no bundled recipe of that name (see ftrun recipes)")


def load_recipe(name_or_path: str) -> Tuple[Dict[str, Any], str]:
    """(mapping, display name) for a recipe file or bundled recipe name."""
    path = find_recipe(name_or_path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a recipe must be a mapping of option: value")
    return data, str(path)


def recipes_main(name: "str | None") -> int:
    """`ftrun recipes [NAME]`."""
    if name:
        print(find_recipe(name).read_text(), end="")
        return 0
    for p in sorted(RECIPES_DIR.glob("*.yaml")):
        print(p.stem)
    return 0


def validate_main(file: str) -> int:
    """`ftrun validate FILE`: 0 if the recipe is good; a ConfigError otherwise."""
    from ftrun.config import build_config

    data, name = load_recipe(file)
    build_config({"script": data.get("script") or "<script>"}, data, name, check_paths=False)
    print(f"{name}: ok")
    return 0
