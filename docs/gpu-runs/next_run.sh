#!/bin/bash
# What the next GPU should run first, in one call of at most 9 minutes (about 6 on an H200):
# every GPU test (make test-gpu's eight workers), benchmark.py, then the epochs behind the
# open targets (issue 35: graphs by default, FSDP2 captured, gpu_busy): ddp at its default
# (graphed) and eager, fsdp2 graphed and eager, fsdp (FSDP1, eager), at local batch 256 and 32,
# 50,000 augmented images, 3 epochs each. From the repository's root, on a machine whose
# python3 has torch >= requirements.txt's floor:
#
#     OUT=gpu-out bash docs/gpu-runs/next_run.sh
#
# Then copy $OUT into a dated folder here, with this script, and write its README.
set -u
OUT=${OUT:-gpu-out}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T0=$(date +%s)
elapsed() { echo $(($(date +%s) - T0)); }

{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    "$PY" -c "import sys, torch; print(sys.version.split()[0], torch.__version__,
torch.version.cuda, torch.cuda.nccl.version())"
    git log -1 --format=%H
    git status --short
    nproc
} >"$OUT/0_env.txt" 2>&1

echo "== gpu tests t=$(elapsed)" >"$OUT/1_gpu_tests.log"
timeout 240 "$PY" -m pytest tests -m gpu -rs -v -n 8 -p no:cacheprovider --durations=15 \
    --junitxml="$OUT/1_gpu_tests.xml" >>"$OUT/1_gpu_tests.log" 2>&1
echo "== rc=$? t=$(elapsed)" >>"$OUT/1_gpu_tests.log"

echo "== benchmark.py t=$(elapsed)" >"$OUT/2_benchmark.log"
timeout 150 "$PY" benchmark.py >>"$OUT/2_benchmark.log" 2>&1
echo "== rc=$? t=$(elapsed)" >>"$OUT/2_benchmark.log"

# Whole [CONFIG] lines (cuda_graphs=, and a note where a run stays eager) and [METRIC] lines.
for run in "ddp 256" "ddp 256 --no-cuda-graphs" "ddp 32" "ddp 32 --no-cuda-graphs" \
    "fsdp2 256 --cuda-graphs" "fsdp2 256" "fsdp2 32 --cuda-graphs" "fsdp 256"; do
    read -r strategy batch graphs <<<"$run"
    echo "== $strategy batch $batch ${graphs:-default} t=$(elapsed)"
    # shellcheck disable=SC2086  # $graphs: no flag or one
    timeout 60 "$PY" main.py --dataset synthetic --train-samples 50000 --val-samples 10000 \
        --augment --epochs 3 --batch-size "$batch" --strategy "$strategy" --no-checkpoint \
        --print-every 100000 $graphs 2>&1 | grep -E '^\[(CONFIG|METRIC)\]|rror|arning'
done >"$OUT/3_epochs.log" 2>&1
echo "== end t=$(elapsed)" >>"$OUT/3_epochs.log"
