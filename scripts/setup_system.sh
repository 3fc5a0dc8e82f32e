#!/usr/bin/env bash
# System packages some tests use, from Debian's packages: chromium (the report page is
# rendered in it, tests/test_report.py) and prometheus (it scrapes a live run,
# tests/test_metrics.py). Installed only as root and only when missing; without them
# (not root, no apt-get, no network) those tests skip and say why.
set -uo pipefail
need=()
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v prometheus >/dev/null 2>&1 || need+=(prometheus)
if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "setup_system: ${need[*]} missing and cannot be installed here (needs root and apt-get); their tests will be skipped"
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
if ! apt-get install -y -q --no-install-recommends "${need[@]}" >/tmp/ftrun-apt.log 2>&1; then
  apt-get update -q >>/tmp/ftrun-apt.log 2>&1 || true
  if ! apt-get install -y -q --no-install-recommends "${need[@]}" >>/tmp/ftrun-apt.log 2>&1; then
    echo "setup_system: could not install ${need[*]} ($(tail -n 1 /tmp/ftrun-apt.log)); their tests will be skipped"
    exit 0
  fi
fi
echo "setup_system: installed ${need[*]}"
