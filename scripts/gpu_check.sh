#!/usr/bin/env bash
# GPU check, for a CUDA machine (not run in CI). Two modes (scripts/gpu_check.py):
#  - full, where torch >= 2.14.1 and TorchTitan 0.3 are installed: stock llama3_debugmodel
#    on Zephon's data on 1 GPU (nccl, bf16, the default FlexAttention with Zephon's document
#    positions), a resume at another gradient-accumulation split (local batch 8 x 2 -> 16 x 1),
#    zephon verify + compare; step time and data wait from TorchTitan's metrics;
#  - engine, where torch is older (the borrowed GPU machine: torch 2.11, no network) or
#    TorchTitan 0.3 is missing: says so, then runs the engine without TorchTitan: the Zephon
#    loader into pinned memory and onto the GPU, a plain PyTorch bf16 model step, and data
#    wait against one preallocated (synthetic) batch; step time and data wait of both.
# Writes logs and JSON to $OUT (default /tmp/gpu_check).
#   bash scripts/gpu_check.sh [--dry-run] [--mode auto|full|engine] [engine sizes: --steps N ...]
#   ZEPHON_DEVICE=cpu bash scripts/gpu_check.sh   # the engine check on the CPU (tested)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OUT
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
fi
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" \
  | tee -a "$OUT/gpu.txt"
t0=$(date +%s)
$PY scripts/gpu_check.py "$@" 2>&1 | tee "$OUT/gpu_check.txt"
rc=${PIPESTATUS[0]}
echo "gpu_check: exit $rc, $(( $(date +%s) - t0 )) s (logs in $OUT)"
exit "$rc"
