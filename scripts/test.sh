#!/usr/bin/env bash
# The project's test command (README Quickstart, CI): sets up .venv on first use,
# then lint + the default test suite (about 10 minutes on 2 cores; `-m slow` for more).
# Extra arguments go to pytest, e.g. scripts/test.sh tests/order -x
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ]; then
  if [ ! -x .venv/bin/python ] || [ ! -f .venv/.zephon-installed ]; then
    echo "[test] first use: creating .venv and installing torchtitan_zephon (a few minutes)..."
    bash scripts/setup_env.sh
  fi
  # shellcheck disable=SC1091
  source .venv/bin/activate
fi
export OMP_NUM_THREADS=1
echo "[test] ruff check"
ruff check .
echo "[test] pytest (CPU, tiny models; end-to-end tests launch real torchrun jobs)"
exec python -m pytest -q -p no:cacheprovider --durations=15 "$@"
