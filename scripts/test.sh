#!/usr/bin/env bash
# The project's test command (README Quickstart, CI): sets up .venv on first use,
# then lint, the import contract (lint-imports: pyproject.toml [tool.importlinter])
# and the default test suite (about 24 min on 2 shared cores, more on slower machines: mostly real torchrun jobs; `-m slow` for more).
# Extra arguments go to pytest, e.g. scripts/test.sh tests/order -x
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ]; then
  if [ ! -x .venv/bin/python ] || [ ! -f .venv/.zephon-installed ]; then
    echo "[test] first use: creating .venv and installing torchtitan_zephon (a few minutes)..."
    bash scripts/setup_env.sh
  elif [ "$(cat .venv/.zephon-installed)" != "$(sha256sum requirements-lock.txt | cut -c1-64)" ]; then
    echo "[test] requirements-lock.txt changed since .venv was set up: installing the pinned" \
      "versions (TorchTitan 0.3.0, torch 2.14.1)..."
    bash scripts/setup_env.sh
  elif [ ! -x .venv/bin/lint-imports ]; then
    echo "[test] .venv has no lint-imports (added to the test extra): installing it..."
    bash scripts/setup_env.sh
  elif ! .venv/bin/python -c "import obstore, moto" 2>/dev/null; then
    echo "[test] .venv has no obstore / moto (the remote and test extras): installing them..."
    bash scripts/setup_env.sh
  fi
  # shellcheck disable=SC1091
  source .venv/bin/activate
fi
export OMP_NUM_THREADS=1
echo "[test] ruff check"
ruff check .
echo "[test] lint-imports (the import contract in pyproject.toml)"
if ! command -v lint-imports >/dev/null; then
  echo "[test] lint-imports not found (the test extra installs it):" \
    "pip install -c requirements-lock.txt -e '.[test]'" >&2
  exit 1
fi
# The contract is checked on this checkout, whatever copy of the package is installed.
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" lint-imports --no-cache --no-logo
echo "[test] pytest (CPU, tiny models; end-to-end tests launch real torchrun jobs)"
exec python -m pytest -q -p no:cacheprovider --durations=15 "$@"
