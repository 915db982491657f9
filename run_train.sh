#!/usr/bin/env bash
# Launch TorchTitan training with Zephon data, in TorchTitan's style.
#   NGPU=4 CONFIG_FILE=train_configs/llama3_8b.toml ./run_train.sh --training.steps 100
# Environment: NGPU (processes per node; default: the GPU count, or 2 CPU processes
# without GPUs), CONFIG_FILE, LOG_RANK (ranks whose output is shown), NNODES (with
# RDZV_ENDPOINT=host:port of one node, the same on every node; RDZV_ID optional),
# TRAIN_FILE. Extra arguments are config overrides.
# Relative paths on the command line (and CONFIG_FILE) are taken from the folder you run
# this from; paths inside TOML files from the repository, where it runs (TorchTitan's rule:
# the working directory). When a worker refuses to start or stops (a Zephon message, no
# traceback), that message is printed again last, after torchrun's failure summary; the
# exit status is torchrun's.
# On first use it creates .venv and installs the project (a few minutes).
set -euo pipefail
export ZEPHON_LAUNCH_DIR="$PWD"
cd "$(dirname "$0")"

if [ -z "${VIRTUAL_ENV:-}" ] && [ -z "${ZEPHON_NO_VENV:-}" ]; then
  if [ ! -x .venv/bin/python ] || [ "$(cat .venv/.zephon-installed 2>/dev/null)" != "$(sha256sum requirements-lock.txt | cut -c1-64)" ]; then
    echo "[run_train] first use (or requirements-lock.txt changed): installing torchtitan_zephon (a few minutes)..."
    bash scripts/setup_env.sh
  fi
  # shellcheck disable=SC1091
  source .venv/bin/activate
fi

CONFIG_FILE=${CONFIG_FILE:-"$PWD/train_configs/debug_model.toml"}
TRAIN_FILE=${TRAIN_FILE:-"torchtitan_zephon.train"}
if [ -z "${NGPU:-}" ]; then
  NGPU=$(python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
  if [ "$NGPU" = "0" ]; then
    NGPU=2
    echo "[run_train] no GPU found: running $NGPU CPU processes (gloo)"
  fi
fi
LOG_RANK=${LOG_RANK:-0}
NNODES=${NNODES:-1}
if [ -z "${OMP_NUM_THREADS:-}" ] &&
  ! python -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  export OMP_NUM_THREADS=1
fi

if [ "$NNODES" != "1" ] && [ -z "${RDZV_ENDPOINT:-}" ]; then
  echo "[run_train] NNODES=$NNODES needs RDZV_ENDPOINT=host:port of one of the nodes (the same" \
    "on every node), e.g. RDZV_ENDPOINT=node0:29500" >&2
  exit 2
fi
RDZV_ARGS=(--rdzv_backend c10d --rdzv_endpoint="${RDZV_ENDPOINT:-localhost:0}")
if [ "$NNODES" != "1" ]; then
  RDZV_ARGS+=(--rdzv_id "${RDZV_ID:-zephon}")
fi

# The first worker that refuses or stops writes its message here (torchrun's summary
# follows it, and --local-ranks-filter hides the other ranks' output).
ZEPHON_ERROR_FILE=$(mktemp "${TMPDIR:-/tmp}/zephon-error.XXXXXX")
export ZEPHON_ERROR_FILE
trap 'rm -f "$ZEPHON_ERROR_FILE"' EXIT

# CONFIG_FILE is a TOML job (TorchTitan 0.2.2's spelling, translated onto 0.3's config);
# with --module M --config FN (a config registry function) it is not passed.
CONFIG_ARGS=(--job.config_file "$CONFIG_FILE")
for arg in "$@"; do
  case "$arg" in --module | --module=* | --config | --config=*) CONFIG_ARGS=() ;; esac
done

status=0
PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-"expandable_segments:True"} \
torchrun --nproc_per_node="$NGPU" --nnodes="$NNODES" "${RDZV_ARGS[@]}" \
  --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
  -m "$TRAIN_FILE" "${CONFIG_ARGS[@]}" "$@" || status=$?
if [ "$status" != 0 ] && [ -s "$ZEPHON_ERROR_FILE" ]; then
  echo >&2
  cat "$ZEPHON_ERROR_FILE" >&2
fi
exit "$status"
