#!/usr/bin/env bash
# Create .venv and install torchtitan_zephon with the pinned versions CI uses
# (requirements-lock.txt). Idempotent; run by ./run_train.sh and scripts/test.sh
# on first use. Needs only Python >= 3.10 (3.11 tested).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $PYTHON"
  "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
source .venv/bin/activate
t0=$(date +%s)
echo "[setup] installing torch 2.13.0 (CPU wheel where no CUDA is present)"
python -m pip install --disable-pip-version-check --progress-bar off -q "torch==2.13.0"
echo "[setup] installing torchtitan 0.2.2 and the pinned dependencies"
python -m pip install --disable-pip-version-check --progress-bar off -q \
  -c requirements-lock.txt -e ".[test,remote]"
touch .venv/.zephon-installed
echo "[setup] done in $(( $(date +%s) - t0 )) s"
