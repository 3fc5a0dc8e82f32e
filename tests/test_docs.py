"""The docs: the site builds with warnings as errors, its generated references cover the code, and
nothing in the README or the site links outside the repository.

The reference pages are rendered from the code (scripts/docs_reference.py); these tests hold the
registries they are rendered from to the code itself: every option `ftrun run --help` lists, every
FTRUN_ variable the code names, every field of the state file, every exit status constant.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, run_ftrun

sys.path.insert(0, str(ROOT / "scripts"))

import docs_reference  # noqa: E402

DOCS = ROOT / "docs"
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _markdown_files():
    return [ROOT / "README.md"] + sorted(DOCS.rglob("*.md"))


def test_site_builds_with_warnings_as_errors(tmp_path):
    """scripts/docs.sh builds the whole site (mkdocs --strict: a broken link, a missing page or a
    broken anchor fails), with every generated reference page and every benchmark plot."""
    out = tmp_path / "site"
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "docs.sh"), "--out", str(out)], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for page in docs_reference.PAGES:
        assert (out / page.replace(".md", ".html")).is_file(), page
    api = (out / "reference" / "ft-api.html").read_text()  # the API page, from the docstrings
    assert 'id="steps"' in api and "<code>ft.steps</code>" in api
    plots = sorted(p.name for p in (out / "benchmarks" / "plots").glob("*.svg"))
    assert len(plots) >= 9 and all((out / "benchmarks" / "plots" / p).stat().st_size > 5000 for p in plots), plots
    # No page of the built site links or loads anything from outside it (fonts, the theme's site).
    outside = []
    for html in out.rglob("*.html"):
        for m in re.finditer(r'(?:href|src)="(https?:[^"]*)"', html.read_text()):
            outside.append(f"{html.relative_to(out)}: {m.group(1)}")
    assert not outside, outside[:10]


@pytest.mark.quick
def test_no_link_points_outside_the_repository():
    """Every Markdown link of the README and of docs/ is relative and lands on a file of the
    repository: the reference pages and the plots included, so that the docs read in a clone."""
    bad = []
    for md in _markdown_files():
        text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)
        for target in LINK.findall(text):
            path = target.split("#")[0]
            if re.match(r"[a-z]+:", target) or target.startswith("/"):
                bad.append(f"{md.relative_to(ROOT)}: {target} (not a link into the repository)")
            elif path:
                resolved = (md.parent / path).resolve()
                inside = ROOT in resolved.parents
                if not inside or not resolved.exists():
                    bad.append(f"{md.relative_to(ROOT)}: {target}")
    assert not bad, bad
    assert "DESIGN.md" not in "".join(p.read_text() for p in _markdown_files())


@pytest.mark.quick
def test_the_generated_pages_in_the_repository_are_current():
    """The reference pages, the guides' diffs and the benchmark plots are committed under docs/, so
    that they read in a clone: each is what the code (and the files a diff shows) renders now."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "docs_reference.py"), "--check"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    api = (DOCS / "reference" / "ft-api.md").read_text()
    assert ":::" not in api and "ftrun.ft.DataLoader(" in api and "ftrun.ft.redo()" in api
    assert "**75**" in (DOCS / "reference" / "exit-codes.md").read_text()
    porting = (DOCS / "guides" / "porting-to-ft.md").read_text()
    assert porting.count("```diff\n--- tests/ported/") >= 2 and "import ftrun.ft as ft" in porting


@pytest.mark.quick
def test_readme_is_short_and_keeps_the_test_command():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    assert "scripts/test.sh" in readme  # .ci/run calls it


@pytest.mark.quick
def test_every_option_run_help_lists_is_in_the_options_reference():
    proc = run_ftrun(["run", "--help"], env={"COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr
    # The option column: "  --rdzv-backend, --rdzv_backend static|c10d   help..." (help text wraps below it).
    listed = set()
    for line in proc.stdout.splitlines():
        m = re.match(r"\s{2}(-{1,2}[a-z][\w-]*(?:, -{1,2}[a-z][\w-]*)*)", line)
        if m:
            listed |= set(m.group(1).split(", "))
    assert {"--nproc", "--ft", "--dry-run", "--recipe", "-m"} <= listed, listed
    page = docs_reference.options_page()
    missing = sorted(f for f in listed - {"--help", "-h"} if f"`{f}`" not in page)
    assert not missing, missing


def test_the_reference_pages_render_every_registry():
    from ftrun.envvars import VARIABLES
    from ftrun.exits import EXIT_STATUSES
    from ftrun.options import OPTIONS_LIST
    from ftrun.status.state import REPLICA_FIELDS, RUN_FIELDS

    env = docs_reference.environment_page()
    assert all(f"`{v.name}`" in env for v in VARIABLES)
    codes = docs_reference.exit_codes_page()
    assert all(f"**{e.code}**" in codes for e in EXIT_STATUSES)
    recipes = docs_reference.recipes_page()
    assert all(f"`{o.key}`" in recipes for o in OPTIONS_LIST if o.recipe)
    status = docs_reference.status_json_page()
    assert all(f"`{k}`" in status for k in list(RUN_FIELDS) + list(REPLICA_FIELDS))
    assert "--max-restarts" in docs_reference.cli_page()


@pytest.mark.quick
def test_every_ftrun_variable_in_the_code_is_in_the_registry():
    """ftrun/envvars.py lists every FTRUN_ name that ftrun/ and the project's shell scripts use, and
    nothing else: the reference page of environment variables cannot drift."""
    from ftrun.envvars import BY_NAME, VARIABLES

    sources = [p for p in (ROOT / "ftrun").rglob("*.py") if p.name != "envvars.py"]
    sources += sorted((ROOT / "scripts").glob("*.sh")) + [ROOT / ".ci" / "run"]
    used = set()
    for path in sources:
        used |= set(re.findall(r"\bFTRUN_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    assert not used - set(BY_NAME), sorted(used - set(BY_NAME))
    listed = {v.name for v in VARIABLES if v.name.startswith("FTRUN_")}
    assert not listed - used, sorted(listed - used)
    assert len(BY_NAME) == len(VARIABLES)


@pytest.mark.quick
def test_every_variable_a_worker_gets_is_in_the_registry(tmp_path):
    """What ftrun.supervisor.workers.env sets in a worker, for a run that sets the most, is documented."""
    from ftrun.config import build_config
    from ftrun.envvars import BY_NAME
    from ftrun.supervisor.workers.env import common_env, worker_env

    cfg = build_config({"script": "x.py", "nproc": "2", "ft": True, "checkpoint_dir": str(tmp_path),
                        "step_timeout": "30", "virtual_local_rank": True, "hook": {"name": "fp16"}},
                       check_paths=False, environ={})
    common = common_env(cfg, "127.0.0.1", 29500, {})
    env = worker_env(common, cfg, 1, 0)
    assert not set(env) - set(BY_NAME), sorted(set(env) - set(BY_NAME))


def test_every_state_file_field_is_documented():
    from ftrun.status.state import REPLICA_FIELDS, RUN_FIELDS, ReplicaStatus, RunStatus
    from ftrun.status.view import DERIVED_REPLICA_FIELDS, DERIVED_RUN_FIELDS, snapshot, unreadable

    assert [f.name for f in dataclasses.fields(RunStatus)] == list(RUN_FIELDS)
    assert [f.name for f in dataclasses.fields(ReplicaStatus)] == list(REPLICA_FIELDS)
    status = RunStatus(run_id="r", script="x.py", argv=[], started=1.0, pid=-1, hook=None, policy="group restart",
                       max_restarts=0, nproc=1, replicas=[ReplicaStatus(rank=0, local_rank=0, last_heartbeat=1.0)],
                       checkpoint={"step": 1, "time": 1.0})
    shown = snapshot(Path("state.json"), status, now=2.0)
    assert not set(shown) - set(RUN_FIELDS) - set(DERIVED_RUN_FIELDS)
    assert not set(shown["replicas"][0]) - set(REPLICA_FIELDS) - set(DERIVED_REPLICA_FIELDS)
    assert not set(unreadable(Path("x/state.json"), "bad")) - set(RUN_FIELDS) - set(DERIVED_RUN_FIELDS)


@pytest.mark.quick
def test_exit_statuses_are_named_and_used_by_name():
    """Every documented status is a constant of ftrun.exits, and no exit in ftrun/ gives a bare number."""
    from ftrun import exits

    for e in exits.EXIT_STATUSES:
        if e.name != "-":
            assert getattr(exits, e.name) == int(e.code.split()[0]), e
    assert (exits.EXIT_SIGINT, exits.EXIT_SIGTERM, exits.EXIT_REQUEUE) == (130, 143, 200)
    bare = []
    for path in (ROOT / "ftrun").rglob("*.py"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if re.search(r"\b(?:os\._exit|sys\.exit)\(\s*\d+\s*\)", code) and '"' not in code:
                bare.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not bare, bare
