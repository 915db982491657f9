#!/usr/bin/env bash
# GPU path check, for a CUDA machine (not run in CI): the debug config on 1 GPU with
# nccl and bf16 (the platform layer must leave TorchTitan untouched), a resume with
# another local batch size / gradient accumulation, zephon verify + compare, and the
# loader benchmark. Writes its logs to $OUT (default /tmp/gpu_check).
#   bash scripts/gpu_check.sh
# Where TorchTitan's own dependencies are missing, put their wheels in .whl/ first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if [ -d .whl ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" | tee -a "$OUT/gpu.txt"
$PY -c "
from torchtitan_zephon.titan import platform
print('platform.apply() ->', platform.apply())
import torchtitan.distributed.utils as d, torchtitan.tools.utils as u
print('set_pg_timeouts:', d.set_pg_timeouts.__module__, '| device_type:', u.device_type)
" | tee -a "$OUT/gpu.txt"

RUN=${RUN:-/tmp/gpu_run}
rm -rf "$RUN"
COMMON=(--job.config_file train_configs/debug_model.toml --model.flavor debugmodel
  --training.seq_len 2048 --training.local_batch_size 8 --training.global_batch_size 16
  --training.mixed_precision_param bfloat16 --training.steps 30 --checkpoint.interval 10
  --zephon.heldout_samples 32 --validation.local_batch_size 8 --debug.no-deterministic)
train() {  # train DUMP LOG [overrides...]
  local dump=$1 log=$2
  shift 2
  $PY -m torch.distributed.run --standalone --nproc_per_node=1 -m torchtitan_zephon.train \
    "${COMMON[@]}" --job.dump_folder "$dump" "$@" >"$log" 2>&1
  echo "exit $? ($log)"
}
t0=$(date +%s)
train "$RUN/ref" "$OUT/ref.log"
grep -E "backend|nccl|Building|step: (1|2|30) " "$OUT/ref.log" | sed 's/\x1b\[[0-9;]*m//g' | head -12
echo "reference run: $(( $(date +%s) - t0 )) s"
cp -r "$RUN/ref" "$RUN/resumed"
rm -rf "$RUN/resumed/checkpoint/step-20" "$RUN/resumed/checkpoint/step-30"
train "$RUN/resumed" "$OUT/resumed.log" --training.local_batch_size 16
grep -E "Zephon: resuming|step: (21|30) " "$OUT/resumed.log" | sed 's/\x1b\[[0-9;]*m//g'
$PY -m torchtitan_zephon verify "$RUN/ref" "$RUN/resumed" | tee "$OUT/verify.txt"
$PY -m torchtitan_zephon compare "$RUN/ref" "$RUN/resumed" --rtol 2e-2 | tee "$OUT/compare.txt"
$PY - <<'PY' | tee "$OUT/step_time.txt"
import statistics
from torchtitan_zephon import runs
for tag in ("time_metrics/end_to_end(s)", "time_metrics/data_loading(%)", "tps"):
    v = runs.read_scalars("/tmp/gpu_run/ref", tag)
    later = [v[s] for s in sorted(v) if s > 3]
    if later:
        print(f"{tag}: median over steps 4..30 = {statistics.median(later):.6g}")
PY
$PY -m torchtitan_zephon bench loader --json --seconds 2 >"$OUT/bench_loader.json" 2>"$OUT/bench_loader.err"
echo "bench loader exit $?"; head -c 1500 "$OUT/bench_loader.json"; echo
echo "total $(( $(date +%s) - t0 )) s"
