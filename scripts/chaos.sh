#!/usr/bin/env bash
# Chaos test: a run SIGKILLed N times (some at random moments, some while a checkpoint
# is being written), each time resumed at a random DP degree and local batch size,
# then verified against an uninterrupted reference (zephon verify + compare).
#
#   scripts/chaos.sh --cycles N [--seed S] [--out DIR] [--steps STEPS] [--rtol R]
#
# Prints one verdict line; exit 0 only when no step diverged and losses are within
# the tolerance. See scripts/chaos.py for the details.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ]; then
  if [ ! -x .venv/bin/python ] || [ ! -f .venv/.zephon-installed ]; then
    echo "[chaos] first use: creating .venv (a few minutes)..."
    bash scripts/setup_env.sh
  fi
  # shellcheck disable=SC1091
  source .venv/bin/activate
fi
exec python scripts/chaos.py "$@"
