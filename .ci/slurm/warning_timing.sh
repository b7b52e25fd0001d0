#!/bin/bash
# warning_timing.sh -- when does SLURM's time-limit warning (sbatch --signal) really arrive?
# Submits one 1-minute job per warning time given (default 20 40 55 seconds) to the project's
# cluster and prints how many seconds after its start each batch script got SIGUSR1. The
# controller checks time limits every 30 s and warns at its first check past
# limit - warning - 30 s, so the answer depends on that check's phase, not only on the warning.
# docs/performance.md and tests/test_slurm.py's requeue test rely on these numbers.
#
#     .ci/slurm/start.sh && export SLURM_CONF=/tmp/project-slurm/etc/slurm.conf   # as root
#     .ci/slurm/warning_timing.sh [SECONDS ...]
set -euo pipefail
[ $# -gt 0 ] || set -- 20 40 55
out=$(mktemp -d)
# shellcheck disable=SC2016  # expanded in the job
job='start=$(date +%s.%N)
trap '\''awk -v s="$start" -v t="$(date +%s.%N)" "BEGIN { printf \"%.1f\n\", t - s }"'\'' USR1
for _ in $(seq 70); do sleep 1; done'
ids=()
for warning in "$@"; do
    ids+=("$(sbatch --parsable --time=00:01:00 --signal="B:USR1@$warning" \
        --output="$out/$warning.txt" --wrap "$job")")
done
# The jobs end at their limit (70 s of sleep in 60 s): wait until none is left.
while squeue -h -j "$(IFS=,; echo "${ids[*]}")" 2>/dev/null | grep -q .; do sleep 5; done
for warning in "$@"; do
    echo "--signal=B:USR1@$warning on a 60 s job: warned $(head -n 1 "$out/$warning.txt") s" \
         "after the start (asked: $((60 - warning)) s)"
done
rm -rf "$out"
