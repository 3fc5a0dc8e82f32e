#!/usr/bin/env bash
# Set up (scripts/setup.sh), then show what --ft is for: 3 replicas of the bundled example
# (scripts/train_ft.py) train; one is killed with SIGKILL mid-run; it restarts alone and heals
# from a peer while the others keep training; all end bitwise identical (scripts/demo_ft.py
# runs it, finds the replica's pid with `ftrun status --json`, and checks each claim).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python scripts/demo_ft.py "$@"
