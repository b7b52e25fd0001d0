#!/bin/bash
# Dated GPU record after the session-5 changes: benchmark.py at the default and a larger batch,
# then the GPU tests touched by them.
export PYTHONUNBUFFERED=1
set -o pipefail
{ date -u; python3 benchmark.py; } 2>&1 | tee $OUT/benchmark.log
{ date -u; python3 benchmark.py --batch-size 1024; } 2>&1 | tee $OUT/benchmark_b1024.log
{ date -u; timeout 330 python3 -m pytest tests/test_gpu.py -m gpu -rs -v -p no:cacheprovider \
   -k "precision or data_wait or deterministic or checkpoint or peak_memory or profile"; } 2>&1 | tee $OUT/gpu_tests.log
