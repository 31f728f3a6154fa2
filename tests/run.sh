#!/usr/bin/env bash
# Installs everything the test suite needs on a fresh Debian machine, then runs it.
# Usage: bash tests/run.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"

# --- system packages: redis-server for the Redis tests, promtool (prometheus) for the alert rules ---
need_apt=()
command -v redis-server >/dev/null || need_apt+=(redis-server)
command -v promtool >/dev/null || need_apt+=(prometheus)
if [ ${#need_apt[@]} -gt 0 ]; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}"
fi

# --- the project and its test dependencies ---
python3 -m pip install -q -e '.[test]'

# --- static checks ---
python3 -m ruff check gateway tests loadtests
python3 -m mypy

# --- the suite ---
python3 -m pytest -q "$@"
