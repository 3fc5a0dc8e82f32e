#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite. Extra arguments go to pytest.
# --quick: only the quick tier (tests marked `quick`: one or two fast tests of every area,
# under 2 minutes on 2 cores), for everyday work; the whole suite is what CI runs.
# Three pytest-xdist workers run the whole suite (two the quick tier), even on 2 cores: most tests
# wait on real processes (heartbeats, sleeps, restarts) more than they compute, and with two the
# cores stood idle a quarter of the time (1,692 CPU-s in 1,131 s; three: 1,062 s, every test
# passing). `-n 0` (or another count) after the script's name overrides it; tests marked `alone` run while no other test runs (tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0
args=()
for a in "$@"; do
  if [ "$a" = "--quick" ]; then quick=1; else args+=("$a"); fi
done
bash scripts/setup.sh
bash scripts/setup_system.sh  # chromium and prometheus, for the report's and the metrics' tests
if [ "$quick" = 1 ]; then
  exec .venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist worksteal -m quick ${args[@]+"${args[@]}"}
fi
# Lightning is a test-only dependency, installed without ever changing torch;
# its test is skipped (with the reason) when it cannot be installed.
if [ "${FTRUN_SKIP_LIGHTNING:-0}" != "1" ] && ! .venv/bin/python -c "import lightning" >/dev/null 2>&1; then
  TV=$(.venv/bin/python -c 'import torch; print(torch.__version__.split("+")[0])')
  # (pip's own status decides; a filter's exit status would say "failed" for a silent success)
  if ! .venv/bin/python -m pip install -q --disable-pip-version-check lightning "torch==$TV" >/tmp/ftrun-pip-lightning.log 2>&1; then
    echo "test: lightning not installable here ($(tail -n 1 /tmp/ftrun-pip-lightning.log)); its test will be skipped"
  fi
fi
# transformers and accelerate (the Hugging Face Trainer's test) likewise: test-only, torch unchanged.
if [ "${FTRUN_SKIP_HF:-0}" != "1" ] && ! .venv/bin/python -c "import transformers, accelerate" >/dev/null 2>&1; then
  TV=$(.venv/bin/python -c 'import torch; print(torch.__version__.split("+")[0])')
  if ! .venv/bin/python -m pip install -q --disable-pip-version-check transformers accelerate "torch==$TV" >/tmp/ftrun-pip-hf.log 2>&1; then
    echo "test: transformers/accelerate not installable here ($(tail -n 1 /tmp/ftrun-pip-hf.log)); their test will be skipped"
  fi
fi
# The slowest tests are listed at the end: the suite must stay within 20 minutes on 2 cores (18.7 measured
# on a fresh clone, setup included).
# (No path here: pytest takes pyproject's testpaths, or only the paths among the arguments.)
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n 3 --dist worksteal --durations=15 ${args[@]+"${args[@]}"}
