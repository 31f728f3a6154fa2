#!/usr/bin/env bash
# Builds everything the vllm e2e tests need: the engine venv, then the tiny model. Idempotent (both steps
# return at once when already built). Location: $KVGATE_VLLM_CPU_DIR (default <repo>/.vllm-cpu).
#
#   bash tests/e2e/vllm_cpu/setup.sh
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../../.." && pwd)"
ROOT="${KVGATE_VLLM_CPU_DIR:-$REPO/.vllm-cpu}"

bash "$HERE/setup_env.sh"
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$ROOT/venv/bin/python" "$HERE/build_model.py" "$ROOT/tiny-llama"
