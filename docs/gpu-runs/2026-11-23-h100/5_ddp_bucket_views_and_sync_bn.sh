#!/bin/bash
# DDP with and without gradient_as_bucket_view, alternating, one GPU; then the --sync-bn test.
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
date -u
rm -rf /tmp/old && cp -r . /tmp/old && sed -i 's/, gradient_as_bucket_view=True//' /tmp/old/ddp_utils.py
grep -n "return DDP" ddp_utils.py /tmp/old/ddp_utils.py
A="--strategy ddp --dataset synthetic --train-samples 50000 --val-samples 1024 --batch-size 256 --epochs 3 --print-every 1000000000 --no-checkpoint --augment"
one() { (cd $1 && timeout 100 python3 -m torch.distributed.run --standalone --nproc_per_node=1 main.py $A 2>&1 | grep METRIC | tail -1 | tr ' ' '\n' | grep -E "^(time|peak_mem|state_mem|t_data|t_compute|t_comm)=" | tr '\n' ' '); echo; }
for i in 1 2 3; do echo -n "views: "; one .; echo -n "copies: "; one /tmp/old; done
timeout 120 python3 -m pytest tests/test_gpu.py -rs -v -p no:cacheprovider -k "sync_batchnorm or comm_benchmark" 2>&1 | tail -6
