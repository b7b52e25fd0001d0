#!/bin/bash
# Diagnostic GPU run: graphed peak_mem step by step; a one-GPU run's stderr; the new t_* breakdown.
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo $(($(date +%s) - T0)); }
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv; python3 -c "import torch; print(torch.__version__, torch.version.cuda)"; git log -1 --format=%H 2>/dev/null; } > "$OUT/0_env.txt" 2>&1
{
for ms in "cnn new" "cnn one" "resnet18 new"; do set -- $ms; m=$1; s=$2; { echo "== mem $m streams=$s t=$(el)"; timeout 60 python3 .gpu/diag_mem.py $s $m 2>&1 | grep -v "^\[W" | cut -c1-300; }; done
} > "$OUT/1_mem.log" 2>&1
{
echo "== stderr of a one-GPU eager run t=$(el)"
timeout 60 python3 main.py --dataset synthetic --train-samples 2048 --val-samples 256 --epochs 1 --batch-size 64 --no-checkpoint --print-every 100000 >/dev/null 2>"$OUT/stderr_eager.txt"; echo "rc=$? bytes=$(wc -c <"$OUT/stderr_eager.txt")"; head -c 1500 "$OUT/stderr_eager.txt"
echo "== stderr of a one-GPU graphed run t=$(el)"
timeout 60 python3 main.py --dataset synthetic --train-samples 2048 --val-samples 256 --epochs 1 --batch-size 64 --no-checkpoint --print-every 100000 --cuda-graphs >/dev/null 2>"$OUT/stderr_graphs.txt"; echo "rc=$? bytes=$(wc -c <"$OUT/stderr_graphs.txt")"; head -c 1500 "$OUT/stderr_graphs.txt"
} > "$OUT/2_stderr.log" 2>&1
KEEP='epoch|time|peak_mem|reserved_mem|data_wait|t_compute|t_data|t_comm|t_wait|breakdown'
for run in "ddp 256 eager" "ddp 256 graphs" "ddp 32 eager" "ddp 32 graphs" "single 256 eager"; do set -- $run; s=$1; b=$2; mode=$3; {
  flag=""; [ "$mode" = graphs ] && flag="--cuda-graphs"
  echo "== $s b=$b $mode t=$(el)"
  timeout 45 python3 main.py --dataset synthetic --train-samples 50000 --val-samples 10000 --augment --epochs 3 --batch-size $b --strategy $s --no-checkpoint --print-every 100000 $flag 2>&1 | grep -E "METRIC|rror" | tr ' ' '\n' | grep -E "^(\[METRIC\]|($KEEP)=)|rror" | tr '\n' ' '; echo
}; done > "$OUT/3_breakdown.log" 2>&1
echo "== fsdp2 b256 t=$(el)" >> "$OUT/3_breakdown.log"
timeout 45 python3 main.py --dataset synthetic --train-samples 50000 --val-samples 10000 --augment --epochs 2 --batch-size 256 --strategy fsdp2 --no-checkpoint --print-every 100000 2>&1 | grep -E "METRIC|rror" | tr ' ' '\n' | grep -E "^(\[METRIC\]|($KEEP)=)|rror" | tr '\n' ' ' >> "$OUT/3_breakdown.log"
echo "== end t=$(el)" >> "$OUT/3_breakdown.log"
