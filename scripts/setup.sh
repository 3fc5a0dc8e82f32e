#!/usr/bin/env bash
# Set up .venv with ftrun and what it needs. torch is installed first, pinned to
# the local CPU build (2.13.0), and only when no torch is importable: a bare
# `torch` requirement would let pip fetch the newest build with gigabytes of
# CUDA packages. Set FTRUN_TORCH (e.g. "torch==2.5.1") to choose another torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  # numpy with torch: torch warns "Failed to initialize NumPy" when it is first imported without it.
  "$VPY" -m pip install -q --disable-pip-version-check "${FTRUN_TORCH:-torch==2.13.0}" numpy 2>&1 | grep -v "^WARNING: Location" || true
  "$VPY" -c "import torch" || { echo "setup: could not install ${FTRUN_TORCH:-torch==2.13.0}; install torch into .venv yourself and rerun" >&2; exit 1; }
fi
"$VPY" -m pip install -q --disable-pip-version-check -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
"$VPY" -c "import ftrun, torch, typer, rich, psutil, yaml, numpy, setproctitle, prometheus_client" || { echo "setup: dependencies missing after install" >&2; exit 1; }
echo "setup: ready (.venv/bin/ftrun, torch $("$VPY" -c 'import torch; print(torch.__version__)'))"
