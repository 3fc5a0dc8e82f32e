#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Lightning is a test-only dependency, installed without ever changing torch;
# its test is skipped (with the reason) when it cannot be installed.
if [ "${FTRUN_SKIP_LIGHTNING:-0}" != "1" ] && ! .venv/bin/python -c "import lightning" >/dev/null 2>&1; then
  TV=$(.venv/bin/python -c 'import torch; print(torch.__version__.split("+")[0])')
  .venv/bin/python -m pip install -q --disable-pip-version-check lightning "torch==$TV" 2>&1 | grep -v "^WARNING: Location" || echo "test: lightning not installable here; its test will be skipped"
fi
exec .venv/bin/python -m pytest -q -p no:cacheprovider tests "$@"
