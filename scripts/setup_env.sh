#!/usr/bin/env bash
# Create .venv and install torchtitan_zephon with the pinned versions CI uses
# (requirements-lock.txt): TorchTitan 0.3.0 on torch 2.14.1, the lowest torch it
# works on. Idempotent; run by ./run_train.sh and scripts/test.sh on first use and
# whenever requirements-lock.txt changed since.
# Needs only Python >= 3.11 (TorchTitan 0.3 requires it; 3.11 tested).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "[setup] $PYTHON is Python $("$PYTHON" -c 'import platform; print(platform.python_version())'):" \
    "TorchTitan 0.3 needs Python >= 3.11; set PYTHON=/path/to/python3.11" >&2
  exit 1
fi
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $PYTHON"
  "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
source .venv/bin/activate
t0=$(date +%s)
# torch first, on its own: the largest download (the CUDA build, about 2.9 GB with its
# CUDA libraries from PyPI; it also runs on CPU). Same pin as requirements-lock.txt.
echo "[setup] installing torch 2.14.1"
python -m pip install --disable-pip-version-check --progress-bar off -q \
  -c requirements-lock.txt "torch==2.14.1"
echo "[setup] installing torchtitan 0.3.0 and the pinned dependencies"
python -m pip install --disable-pip-version-check --progress-bar off -q \
  -c requirements-lock.txt -e ".[test,remote]"
# The marker holds the lock's digest: scripts/test.sh and ./run_train.sh set up again
# when requirements-lock.txt changes (e.g. a .venv made for TorchTitan 0.2.2).
sha256sum requirements-lock.txt | cut -c1-64 >.venv/.zephon-installed
echo "[setup] done in $(( $(date +%s) - t0 )) s"
