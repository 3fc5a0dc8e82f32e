#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Lightning is a test-only dependency, installed without ever changing torch;
# its test is skipped (with the reason) when it cannot be installed.
if [ "${FTRUN_SKIP_LIGHTNING:-0}" != "1" ] && ! .venv/bin/python -c "import lightning" >/dev/null 2>&1; then
  TV=$(.venv/bin/python -c 'import torch; print(torch.__version__.split("+")[0])')
  # (pip's own status decides; a filter's exit status would say "failed" for a silent success)
  if ! .venv/bin/python -m pip install -q --disable-pip-version-check lightning "torch==$TV" >/tmp/ftrun-pip-lightning.log 2>&1; then
    echo "test: lightning not installable here ($(tail -n 1 /tmp/ftrun-pip-lightning.log)); its test will be skipped"
  fi
fi
exec .venv/bin/python -m pytest -q -p no:cacheprovider tests "$@"
