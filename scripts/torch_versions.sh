#!/usr/bin/env bash
# Run the quick tier against the torch releases ftrun claims to support, each in a scratch
# venv of its own that is removed at the end (also on failure or ^C).
#
#   scripts/torch_versions.sh                 # the oldest torch pyproject.toml accepts and the newest pip serves
#   scripts/torch_versions.sh 2.13.0 2.14.1   # these releases
#   scripts/torch_versions.sh -- -k console   # extra arguments after -- go to pytest
#
# pip picks the CPU build where the index has one (the local 2.13.0+cpu wheel outranks 2.13.0);
# where only the CUDA build exists (PyPI's Linux wheels) it is installed with its CUDA packages,
# several GB, and runs on CPU all the same: too large for every CI run, so run this by hand, and
# in every change to ftrun/worker/patches.py or the group code (ftrun/worker/ft/member/group.py).
# Exit status: 0 only when every release passed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
versions=()
pytest_args=()
while [ $# -gt 0 ]; do
  if [ "$1" = "--" ]; then shift; pytest_args=("$@"); break; fi
  versions+=("$1"); shift
done

scratch=$(mktemp -d /tmp/ftrun-torch-versions.XXXXXX)
trap 'rm -rf "$scratch"' EXIT
trap 'exit 130' INT TERM

if [ ${#versions[@]} -eq 0 ]; then
  # The floor of pyproject.toml's "torch>=X.Y", as X.Y.0.
  floor=$(sed -n 's/^ *"torch>=\([0-9.]*\)".*/\1/p' pyproject.toml)
  [ -n "$floor" ] || { echo "torch_versions: no \"torch>=...\" floor in pyproject.toml" >&2; exit 2; }
  case "$floor" in *.*.*) ;; *) floor="$floor.0" ;; esac
  # The newest release pip would install here (its index and any constraints in force).
  newest=$("$PY" -m pip install --dry-run --no-deps --ignore-installed -q --report - torch 2>/dev/null |
    "$PY" -c 'import json, sys; print(json.load(sys.stdin)["install"][0]["metadata"]["version"])') ||
    { echo "torch_versions: pip could not say which torch is the newest" >&2; exit 2; }
  versions=("$floor" "${newest%%+*}")
fi

results=()
status=0
for v in "${versions[@]}"; do
  venv="$scratch/venv-$v"
  log="$scratch/pytest-$v.log"
  echo "== torch $v: installing into a scratch venv"
  t0=$(date +%s)
  "$PY" -m venv "$venv"
  if ! "$venv/bin/pip" install -q --disable-pip-version-check "torch==$v" numpy >"$scratch/pip-$v.log" 2>&1 ||
     ! "$venv/bin/pip" install -q --disable-pip-version-check -e ".[test]" >>"$scratch/pip-$v.log" 2>&1; then
    tail -n 5 "$scratch/pip-$v.log"
    results+=("$(printf '%-10s %-24s %s' "$v" "-" "install failed")")
    status=1; rm -rf "$venv"; continue
  fi
  t1=$(date +%s)
  build=$("$venv/bin/python" -c 'import torch; print(torch.__version__, "cuda " + torch.version.cuda if torch.version.cuda else "cpu")')
  size=$(du -sh "$venv" | cut -f1)
  echo "== torch $build ($size installed in $((t1 - t0)) s): the quick tier"
  # Not tests/test_docs.py: the docs build runs in the repository's .venv (scripts/docs.sh), never
  # in this scratch venv, so it says nothing about the torch under test.
  "$venv/bin/python" -m pytest -q -p no:cacheprovider -m quick --ignore=tests/test_docs.py tests \
    ${pytest_args[@]+"${pytest_args[@]}"} 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  t2=$(date +%s)
  summary=$(grep -E '^[=]* *[0-9]+ (passed|failed)|(passed|failed|error).* in [0-9.]+s' "$log" | tail -n 1 | tr -d '=' | sed 's/^ *//')
  [ "$rc" = 0 ] || status=1
  results+=("$(printf '%-10s %-24s %-6s %s (tests %d s)' "$v" "$build" "$([ "$rc" = 0 ] && echo pass || echo FAIL)" "$summary" $((t2 - t1)))")
  rm -rf "$venv"
done

echo
echo "torch      build                    result"
printf '%s\n' "${results[@]}"
exit $status
