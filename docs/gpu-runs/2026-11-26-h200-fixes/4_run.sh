#!/bin/bash
# Fourth GPU run: peak_mem of replay epochs floored at the capture's peak.
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
{ timeout 60 python3 -m pytest tests/test_gpu.py -n 2 -p no:cacheprovider -q -rA \
    -k "peak_mem_is_an_eager or graphed_run_resumes_exactly" 2>&1 | grep -E "passed|failed|peak_mem|^E " | head -20
  for flag in "" "--cuda-graphs"; do
    echo "== cnn b256 $flag"
    timeout 30 python3 main.py --dataset synthetic --train-samples 20000 --val-samples 2000 --augment --epochs 2 \
      --batch-size 256 --no-checkpoint --print-every 100000 $flag 2>&1 | grep -oE "epoch=[0-9]+|peak_mem=[0-9]+MB|reserved_mem=[0-9]+" | tr '\n' ' '; echo
  done
} > "$OUT/6_peak.log" 2>&1
