#!/bin/bash
# Second GPU run of 2026-11-26's session: the GPU tests in parallel (make test-gpu's -n 8), then
# benchmark.py, then eager vs graphed epochs (t_* breakdown, peak_mem). Each stage has its limit.
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo $(($(date +%s) - T0)); }
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch,sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.nccl.version())"
  git log -1 --format=%H 2>/dev/null; git status --short | head; nproc; } > "$OUT/0_env.txt" 2>&1
echo "== gpu tests t=$(el)" > "$OUT/1_gpu_tests.log"
timeout 200 python3 -m pytest tests -m gpu -rs -v -n 8 -p no:cacheprovider --durations=15 \
  --junitxml="$OUT/1_gpu_tests.xml" >> "$OUT/1_gpu_tests.log" 2>&1
echo "== rc=$? t=$(el)" >> "$OUT/1_gpu_tests.log"
echo "== benchmark.py t=$(el)" > "$OUT/2_benchmark.log"
timeout 130 python3 benchmark.py >> "$OUT/2_benchmark.log" 2>&1
echo "== rc=$? t=$(el)" >> "$OUT/2_benchmark.log"
KEEP='epoch|time|peak_mem|reserved_mem|data_wait|t_compute|t_data|t_comm|t_wait|breakdown'
for run in "ddp 256 eager cnn" "ddp 256 graphs cnn" "ddp 32 eager cnn" "ddp 32 graphs cnn" "ddp 256 graphs resnet18"; do
  set -- $run; flag=""; [ "$3" = graphs ] && flag="--cuda-graphs"
  echo "== $1 b=$2 $3 $4 t=$(el)"
  timeout 50 python3 main.py --dataset synthetic --train-samples 50000 --val-samples 10000 --augment --epochs 3 \
    --batch-size "$2" --strategy "$1" --model "$4" --no-checkpoint --print-every 100000 $flag 2>&1 |
    grep -E "METRIC|rror|arning" | tr ' ' '\n' | grep -E "^(\[METRIC\]|($KEEP)=)|rror|arning" | tr '\n' ' '
  echo
done > "$OUT/3_epochs.log" 2>&1
echo "== end t=$(el)" >> "$OUT/3_epochs.log"
