# Sourced by scripts/demo and scripts/test: create .venv if needed and install hivetrain with its dependencies.
# On a machine without an NVIDIA GPU it installs the CPU build of torch (never the multi-GB CUDA packages).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
TORCH_VERSION="${HIVETRAIN_TORCH_VERSION:-2.13.0}"

if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
  echo "hivetrain needs Python >= 3.10 (found $("$PY" --version 2>&1)); set PYTHON=/path/to/python3.11" >&2
  exit 2
fi
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating virtual environment in .venv"
  "$PY" -m venv .venv
fi
VPY="$ROOT/.venv/bin/python"
PIP=("$VPY" -m pip --disable-pip-version-check)

if ! "$VPY" -c 'import torch' 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "[setup] NVIDIA GPU found: installing torch==$TORCH_VERSION with CUDA from PyPI"
    "${PIP[@]}" install "torch==$TORCH_VERSION"
  elif "${PIP[@]}" install -q --no-index "torch==$TORCH_VERSION" 2>/dev/null; then
    echo "[setup] installed torch==$TORCH_VERSION (CPU) from a local wheel"
  elif "${PIP[@]}" install -q --timeout 30 --retries 1 --index-url https://download.pytorch.org/whl/cpu "torch==$TORCH_VERSION"; then
    echo "[setup] installed torch==$TORCH_VERSION (CPU build)"
  else
    echo "[setup] no CPU build of torch==$TORCH_VERSION reachable; install torch yourself (CPU build) and rerun" >&2
    exit 2
  fi
fi

# Reinstall the project only when its dependency list changed.
STAMP=.venv/.hivetrain-installed
WANT="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "[setup] installing hivetrain and its dependencies"
  "${PIP[@]}" install -q -e ".[dev]" 2>&1 | grep -v "is ignored: it is neither" || true
  "$VPY" -c 'import hivetrain, hivemind, transformers' # fail loudly if the install did not work
  echo "$WANT" > "$STAMP"
fi
export PATH="$ROOT/.venv/bin:$PATH"
