#!/usr/bin/env bash
# Run the framework tests (the Hugging Face Trainer's and Lightning's under --ft) against sets of
# transformers, accelerate and lightning releases, each set in a scratch venv of its own that is
# removed at the end (also on failure or ^C). torch is pinned (torch==$FTRUN_TORCH, 2.13.0 by
# default) in every install, so pip never replaces it with another build (a CUDA one is GBs).
#
#   scripts/framework_versions.sh                     # the newest pip serves, then the previous minor of each
#   scripts/framework_versions.sh newest              # one of the two
#   scripts/framework_versions.sh "transformers==5.23.0 accelerate==1.14.0 lightning==2.5.6"
#   scripts/framework_versions.sh -- -k heals         # extra arguments after -- go to pytest
#
# "previous" is the newest release of the minor before the newest's (transformers 5.24.x -> the
# newest 5.23.x), for each package; pytorch-lightning (the older package name, which a test
# imports) follows lightning. Run it by hand when a new release comes out or ftrun/worker/frameworks
# changes: the tests take 10-30 minutes a set on 2 cores. The table it ends with goes into
# docs/benchmarks/frameworks.md. Exit status: 0 only when every set passed with nothing skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH=${FTRUN_TORCH:-2.13.0}
TESTS=(tests/test_hf_ft.py tests/test_lightning_ft.py tests/test_lightning_ported.py tests/test_accelerate_fabric_ft.py)
sets=()
pytest_args=()
while [ $# -gt 0 ]; do
  if [ "$1" = "--" ]; then shift; pytest_args=("$@"); break; fi
  sets+=("$1"); shift
done
[ ${#sets[@]} -gt 0 ] || sets=(newest previous)

scratch=$(mktemp -d /tmp/ftrun-framework-versions.XXXXXX)
trap 'rm -rf "$scratch"' EXIT
trap 'exit 130' INT TERM

# The newest release of a package pip serves here ("newest"), or the newest of the minor before
# it ("previous"), from `pip index versions` (final releases only; a .postN counts as its release).
release() {
  "$PY" -m pip index versions "$1" 2>/dev/null | "$PY" -c '
import re, sys
which = sys.argv[1]
line = next((l for l in sys.stdin if l.startswith("Available versions:")), "")
found = []
for v in line.split(":", 1)[-1].split(","):
    m = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)(\.post\d+)?", v.strip())
    if m:
        found.append((tuple(int(x) for x in m.groups()[:3]), v.strip()))
found.sort(reverse=True)
if not found:
    sys.exit(1)
if which == "newest":
    print(found[0][1])
else:
    minor = found[0][0][:2]
    print(next(v for key, v in found if key[:2] < minor))
' "$2"
}

pins() {  # a set's name -> its pip requirements
  case "$1" in
    newest|previous)
      local out="" p v
      for p in transformers accelerate lightning; do
        v=$(release "$p" "$1") || { echo "framework_versions: pip could not list $p's releases" >&2; return 1; }
        out="$out $p==$v"
        [ "$p" = lightning ] && out="$out pytorch-lightning==$v"
      done
      echo "${out# }" ;;
    *) echo "$1" ;;
  esac
}

results=()
status=0
for name in "${sets[@]}"; do
  reqs=$(pins "$name") || { status=1; results+=("$(printf '%-9s %-72s %s' "$name" "-" "no releases")"); continue; }
  if [[ "$reqs" == *"lightning=="* && "$reqs" != *"pytorch-lightning=="* ]]; then
    v=$(sed -n 's/.*\blightning==\([^ ]*\).*/\1/p' <<<"$reqs")
    reqs="$reqs pytorch-lightning==$v"
  fi
  tag=$(tr ' =' '_-' <<<"$name" | tr -cd 'A-Za-z0-9_.-' | cut -c1-60)
  venv="$scratch/venv-$tag"
  log="$scratch/pytest-$tag.log"
  echo "== $name: $reqs (torch==$TORCH), installing into a scratch venv"
  t0=$(date +%s)
  "$PY" -m venv "$venv"
  # shellcheck disable=SC2086  # $reqs is a list of requirements
  if ! "$venv/bin/pip" install -q --disable-pip-version-check "torch==$TORCH" numpy >"$scratch/pip-$tag.log" 2>&1 ||
     ! "$venv/bin/pip" install -q --disable-pip-version-check -e ".[test]" $reqs "torch==$TORCH" \
         >>"$scratch/pip-$tag.log" 2>&1; then
    tail -n 5 "$scratch/pip-$tag.log"
    results+=("$(printf '%-9s %-72s %s' "$name" "$reqs" "install failed")")
    status=1; rm -rf "$venv"; continue
  fi
  t1=$(date +%s)
  got=$("$venv/bin/python" -c '
import accelerate, lightning, torch, transformers
print(f"transformers {transformers.__version__}, accelerate {accelerate.__version__}, "
      f"lightning {lightning.__version__}, torch {torch.__version__}")')
  echo "== $got (installed in $((t1 - t0)) s): the framework tests"
  HF_HUB_OFFLINE=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider -p no:xdist -rs "${TESTS[@]}" \
    ${pytest_args[@]+"${pytest_args[@]}"} 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  t2=$(date +%s)
  summary=$(grep -E '(passed|failed|error|skipped).* in [0-9.]+s' "$log" | tail -n 1 | tr -d '=' | sed 's/^ *//')
  # A skipped test ran nothing: a framework that did not import is not a pass.
  if [ "$rc" != 0 ] || grep -q "skipped" <<<"$summary"; then ok=FAIL; status=1; else ok=pass; fi
  results+=("$(printf '%-9s %-72s %-5s %s (%d s)' "$name" "$got" "$ok" "$summary" $((t2 - t1)))")
  rm -rf "$venv"
done

echo
printf '%-9s %-72s %s\n' "set" "versions" "result"
printf '%s\n' "${results[@]}"
exit $status
