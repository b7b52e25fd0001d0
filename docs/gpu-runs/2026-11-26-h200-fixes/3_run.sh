#!/bin/bash
# Third GPU run: peak_mem of graphed runs measured from the capture's own peak.
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo $(($(date +%s) - T0)); }
{ echo "== peak test t=$(el)"
  timeout 80 python3 -m pytest tests/test_gpu.py -n 3 -p no:cacheprovider -q -rA -s \
    -k "peak_mem_is_an_eager or graphed_run_trains_as_the_eager or one_gpu_run_prints_nothing" 2>&1 | grep -E "passed|failed|peak_mem|^E " | head -30
} > "$OUT/4_peak.log" 2>&1
KEEP='epoch|time|peak_mem|reserved_mem|t_compute|t_comm|breakdown'
for run in "256 eager cnn" "256 graphs cnn" "256 eager resnet18" "256 graphs resnet18"; do
  set -- $run; flag=""; [ "$2" = graphs ] && flag="--cuda-graphs"
  echo "== ddp b=$1 $2 $3 t=$(el)"
  timeout 40 python3 main.py --dataset synthetic --train-samples 20000 --val-samples 2000 --augment --epochs 2 \
    --batch-size "$1" --strategy ddp --model "$3" --no-checkpoint --print-every 100000 $flag 2>&1 |
    grep -E "METRIC|rror|arning" | tr ' ' '\n' | grep -E "^(\[METRIC\]|($KEEP)=)|rror|arning" | tr '\n' ' '
  echo
done > "$OUT/5_peak_epochs.log" 2>&1
echo "== end t=$(el)" >> "$OUT/5_peak_epochs.log"
