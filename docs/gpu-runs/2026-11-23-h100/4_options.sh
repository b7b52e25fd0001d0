#!/bin/bash
# Where does the 1-GPU step time go? (device diagnostic, not part of the project)
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
M="python3 -m torch.distributed.run --standalone --nproc_per_node=1 main.py --dataset synthetic --train-samples 50000 --val-samples 1024 --batch-size 256 --epochs 3 --print-every 1000000000 --no-checkpoint --augment"
run() { echo "== $*"; timeout 120 $M "$@" 2>&1 | grep -E "METRIC|Error|error" | tail -1 | tr ' ' '\n' | grep -E "^(time|throughput|data_wait|t_compute|t_data|t_comm|t_wait|peak_mem|strategy|precision)=" | tr '\n' ' '; echo; }
run --strategy single
run --strategy ddp
run --strategy fsdp
run --strategy fsdp2
run --strategy ddp --precision tf32
run --strategy ddp --precision bf16
run --strategy ddp --precision bf16 --channels-last
run --strategy ddp --compile
run --strategy fsdp --precision bf16
for s in single ddp fsdp fsdp2; do
  timeout 120 $M --strategy $s --epochs 1 --profile > /dev/null 2>&1
done
cp logs/profiles/*.json $OUT/ 2>/dev/null; ls -la $OUT
