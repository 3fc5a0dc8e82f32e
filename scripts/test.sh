#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite. Extra arguments go to pytest.
# --quick: only the quick tier (tests marked `quick`: one or two fast tests of every area,
# under 2 minutes on 2 cores), for everyday work; the whole suite is what CI runs.
# Three pytest-xdist workers run the whole suite (two the quick tier), even on 2 cores: most tests
# wait on real processes (heartbeats, sleeps, restarts) more than they compute, and with two the
# cores stood idle a quarter of the time (1,692 CPU-s in 1,131 s; three: 1,062 s, every test
# passing). `-n 0` (or another count) after the script's name overrides it; tests marked `alone` run after the others, one at a time.
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0
extended=0
args=()
for a in "$@"; do
  if [ "$a" = "--quick" ]; then quick=1; elif [ "$a" = "--extended" ]; then extended=1; else args+=("$a"); fi
done
# --extended: the whole suite and the tests marked `extended` (longer or larger runs of what a test
# of the suite checks: multi-node store moves, the largest FSDP heal, ported scripts trained to the
# end); before a release and after a change to their area. CI runs the suite without them: with them
# it takes about 23 minutes on 2 cores, over CI's 20 (every ftrun run costs 2-3 CPU-s to start).
if [ "$extended" = 1 ]; then tier="extended or not extended"; else tier="not extended"; fi
bash scripts/setup.sh
bash scripts/setup_system.sh  # chromium and prometheus, for the report's and the metrics' tests
# ftrun's own modules compiled once: where PYTHONDONTWRITEBYTECODE is set (this machine's image
# sets it) no process writes a .pyc, and each of the suite's ~2,000 processes that import ftrun
# compiled its modules again (0.16 CPU-s each; .pyc files are still read with it set).
.venv/bin/python -m compileall -q -j 0 ftrun tests/helpers.py tests/conftest.py >/dev/null
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
# datasets (the Hugging Face streaming dataset's test of ft.DataLoader) likewise: test-only, torch
# unchanged; the test builds its stream from a local generator, nothing from a hub.
if [ "${FTRUN_SKIP_DATASETS:-0}" != "1" ] && ! .venv/bin/python -c "import datasets" >/dev/null 2>&1; then
  TV=$(.venv/bin/python -c 'import torch; print(torch.__version__.split("+")[0])')
  if ! .venv/bin/python -m pip install -q --disable-pip-version-check datasets "torch==$TV" >/tmp/ftrun-pip-datasets.log 2>&1; then
    echo "test: datasets not installable here ($(tail -n 1 /tmp/ftrun-pip-datasets.log)); its test will be skipped"
  fi
fi
# The slowest tests are listed at the end: the suite must stay within 20 minutes on 2 cores (docs/development.md
# has the figures of the last fresh-clone run).
# (No path here: pytest takes pyproject's testpaths, or only the paths among the arguments.)
# Two passes: every test but those marked `alone` on three workers, then those one after another (an
# `alone` test among the others waited for both other workers to finish their tests, and they stood
# idle while it ran). Exit status 5 is pytest's "no test selected" (a path with no `alone` test).
status=0
.venv/bin/python -m pytest -q -p no:cacheprovider -n 3 --dist worksteal --durations=15 -m "not alone and ($tier)" \
  ${args[@]+"${args[@]}"} || status=$?
if [ "$status" = 5 ]; then status=0; fi
alone=0
.venv/bin/python -m pytest -q -p no:cacheprovider -n 0 -m "alone and ($tier)" ${args[@]+"${args[@]}"} || alone=$?
if [ "$alone" = 5 ]; then alone=0; fi
if [ "$status" = 0 ]; then status=$alone; fi
exit "$status"
