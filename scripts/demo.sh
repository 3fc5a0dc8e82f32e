#!/usr/bin/env bash
# Set up (scripts/setup.sh) and train the bundled example on 4 CPU workers under ftrun.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/ftrun --nproc 4 scripts/train_ddp.py --steps 200 --print-every 50 "$@"
