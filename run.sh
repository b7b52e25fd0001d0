#!/bin/bash
#SBATCH --job-name=cifar10
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=8
#SBATCH --time=00:30:00
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=train_%j.log
#SBATCH --error=train_%j.err
#
# run.sh -- train with main.py: as a SLURM batch job, or on this machine through torchrun.
#
#     sbatch -A ACCOUNT run.sh                         # 1 node x 4 GPUs, one task per GPU
#     sbatch -A ACCOUNT --nodes=2 run.sh --strategy fsdp --epochs 5
#     sbatch -A ACCOUNT --ntasks-per-node=1 --gpus-per-node=1 run.sh
#     bash run.sh --dataset synthetic --epochs 1       # no SLURM: torchrun, one process per GPU
#
# Arguments after the script go to main.py. Options before it go to sbatch and override the
# #SBATCH lines above, and so do SBATCH_* variables (SBATCH_ACCOUNT, SBATCH_PARTITION,
# SBATCH_TIMELIMIT, SBATCH_RESERVATION, ...): no account or reservation is written here.
# The job runs in the directory it was submitted from, so submit from the repository (or set
# REPO_DIR); train_<job id>.log and train_<job id>.err are written there, a pair per job (an
# earlier job's error line is then never read as this one's). Inside an allocation (salloc),
# `bash run.sh` launches with srun too.
#
# Preemption and time limits: two minutes before the limit (up to 30 s earlier: SLURM checks
# every 30 s) SLURM sends SIGUSR1 to this script (--signal=B:USR1@120; change the seconds with
# sbatch --signal=B:USR1@300). The script passes
# it to srun, which forwards it to every task; the ranks agree on a step, save a checkpoint
# and exit; the script then requeues the job (--requeue), which starts again with the same job
# id, resumes from checkpoints/<job id> (--resume auto) and appends to its logs
# (--open-mode=append). Sites and tools differ on the warning signal: SIGUSR2 does the same
# (sbatch --signal=B:USR2@120). SIGTERM (scancel, the time limit) reaches the tasks as a
# SIGTERM, never through srun (which would SIGKILL them): they save a checkpoint and exit, and
# the job ends, not requeued. Without SLURM, SIGUSR1, SIGUSR2, SIGTERM and SIGINT (Ctrl-C) to
# this script reach every rank: each stops with a checkpoint (exit status 3). A second Ctrl-C,
# a second or more after the first, ends every rank at once. See docs/checkpoints.md.
#
# Variables (sbatch passes the submitting shell's environment on to the job):
#   EDF       run every task in this container, with CSCS's Container Engine
#             (srun --environment=$EDF), e.g. EDF=$PWD/edf.toml sbatch run.sh
#   PYTHON    the interpreter; default: the container's python with EDF, else the active
#             virtual environment's, else the repository's .venv, else python3 on PATH
#   NPROC     without SLURM: processes to start; default one per visible GPU, 2 on CPU
#   REPO_DIR  where main.py is, if the job is not submitted from the repository
#   SAMPLES_DIR  where the samplers write (default logs); SAMPLE_EVERY their interval (5 s)
#   MAX_REQUEUES  how often a job may requeue itself on SLURM's warning (default 10)
set -euo pipefail

fail() {
    echo "error: $*" >&2
    exit 2
}

# In a batch job SLURM runs a copy of this script from its spool directory; the job starts in
# the directory it was submitted from.
find_repo() {
    local here dir
    here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
    for dir in "${REPO_DIR:-}" "$here" "${SLURM_SUBMIT_DIR:-}"; do
        if [ -n "$dir" ] && [ -f "$dir/main.py" ]; then
            echo "$dir"
            return
        fi
    done
    fail "cannot find main.py: submit from the repository's directory, or set REPO_DIR"
}

# Each task changes into the repository first: a container starts in the image's working
# directory, not in the job's. main.py itself reads its rank, world size and rendezvous point
# from SLURM's variables (distributed_utils.py): nothing about them is decided here.
# shellcheck disable=SC2016  # expanded by each task, not here
TASK_SETUP='cd "$1" && shift && exec "$@"'

# What the GPUs and the training processes did while the job ran, sampled on each node every
# SAMPLE_EVERY seconds until it is sent SAMPLER_STOP (see stop_sampler), TERM or INT:
# gpu_<tag>_<host>.csv (nvidia-smi, where there is one) and cpu_<tag>_<host>.csv (CPU seconds
# and resident memory of this run's ranks, found by the SAMPLE_TAG=<tag> in their environment,
# from /proc). collect_results.py summarises them. Appends: a requeued job goes on.
sample_node() {
    local dir=$1 tag=$2 every=$3 host gpu_pid="" pid cmdline program ranks stat ppid rss tick
    host=${SLURMD_NODENAME:-$(hostname -s)}   # SLURM's name: emulated nodes share a host
    tick=$(getconf CLK_TCK)
    mkdir -p "$dir"
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=timestamp,index,utilization.gpu,memory.used,memory.total,power.draw \
            --format=csv,nounits -l "$every" >>"$dir/gpu_${tag}_$host.csv" 2>/dev/null &
        gpu_pid=$!
    fi
    local cpu_csv=$dir/cpu_${tag}_$host.csv
    [ -s "$cpu_csv" ] || echo "time_s,pid,cpu_s,rss_mb" >"$cpu_csv"
    trap '[ -z "$gpu_pid" ] || kill "$gpu_pid" 2>/dev/null; exit 0' "$SAMPLER_STOP" TERM INT
    while true; do
        ranks=" "
        for pid in $(pgrep -u "$(id -u)" -f '[m]ain[.]py'); do
            # This run's ranks only: not another run's, not srun or a shell with main.py among
            # its arguments, not torchrun. The command line is read once: torchrun ending as
            # training ends leaves an empty one, which reads as no rank, not as one.
            grep -qsxz "SAMPLE_TAG=$tag" "/proc/$pid/environ" || continue
            cmdline=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null) || continue
            program=${cmdline%% *}
            [[ ${program##*/} == python* && $cmdline != *distributed.run* ]] || continue
            ranks+="$pid "
        done
        for pid in $ranks; do
            # Fields of /proc/PID/stat after "(comm)": ppid is the 2nd, utime and stime the
            # 12th and 13th. A DataLoader worker (--loader classic) is a fork of its rank, with
            # its command line and environment: a process whose parent is a rank is no rank.
            stat=$(sed 's/.*) //' "/proc/$pid/stat" 2>/dev/null) || continue
            read -r _ ppid _ <<<"$stat"
            [[ $ranks == *" $ppid "* ]] && continue
            rss=$(awk '/^VmRSS:/ { print $2 }' "/proc/$pid/status" 2>/dev/null)
            [ -n "$rss" ] || continue   # it has ended: its memory is gone
            echo "$stat" | awk -v t="$(date +%s.%N)" -v pid="$pid" -v rss="$rss" \
                -v tick="$tick" '{ printf "%.3f,%s,%.2f,%.1f\n", t, pid, ($12 + $13) / tick,
                                   rss / 1024 }' >>"$cpu_csv"
        done
        sleep "$every" &
        wait $! || true   # a stop signal ends the wait at once, not after the sleep
    done
}

# The samplers end on a signal that srun passes on to its tasks: they exit 0, so the step ends
# as completed. A SIGTERM would make srun cancel the step, and write "CANCELLED AT" and "task 0:
# Killed" into the job's stderr, where they read as a crash of training. Should the signal be
# lost (srun had not yet set up its handlers), SIGTERM ends it after STOP_GRACE seconds.
SAMPLER_STOP=USR2
STOP_GRACE=10
stop_sampler() {
    local pid=$1 waited=0
    kill -s "$SAMPLER_STOP" "$pid" 2>/dev/null || return 0   # it may have ended by itself
    while kill -0 "$pid" 2>/dev/null && [ "$waited" -lt "$STOP_GRACE" ]; do
        sleep 1
        waited=$((waited + 1))
    done
    kill -TERM "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
}

# A stop signal to the batch shell: USR1 or USR2 is SLURM's warning of the time limit (the
# job requeues once its tasks have saved); TERM is scancel's or the time limit's own (the job
# ends). srun passes USR1 and USR2 on to every task; a SIGTERM it would turn into a SIGKILL of
# its tasks ("forcing job termination"), so TERM goes to the tasks through scancel, which
# signals every step but this batch shell's.
on_stop_signal() {
    local sig=$1
    signalled=yes   # see wait_through_signals
    stopping=$sig
    [ "$sig" = TERM ] || requeue=yes
    [ -n "$srun_pid" ] || return 0
    if [ "$sig" = TERM ]; then
        scancel --signal=TERM "$SLURM_JOB_ID" 2>/dev/null || true
    else
        kill -s "$sig" "$srun_pid" 2>/dev/null || true
    fi
}

run_slurm() {
    # SLURM's warning may come at any time from here on, even before the tasks start (it is
    # sent at the controller's first 30-second check past the warning time): remember it, and
    # pass it to srun once srun runs.
    local srun_pid="" sampler_pid="" status=0 requeue=no stopping=""
    trap 'on_stop_signal USR1' USR1
    trap 'on_stop_signal USR2' USR2
    local in_container=no
    [ -n "${EDF:-}" ] && in_container=yes
    PYTHON=$(pick_python "$REPO" "$in_container")

    # Recommended by CSCS for PyTorch with NCCL: abort the job on an NCCL error instead of
    # hanging; keep GPU-aware MPICH out of NCCL's way (it can deadlock); no JIT cache on the
    # shared file system. One OpenMP thread per CPU the task owns.
    export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
    export MPICH_GPU_SUPPORT_ENABLED=${MPICH_GPU_SUPPORT_ENABLED:-0}
    export CUDA_CACHE_DISABLE=${CUDA_CACHE_DISABLE:-1}
    export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}
    ulimit -c 0   # a crashing rank would leave a core file the size of its memory
    # sbatch passes the submitting shell's variables on: a torchrun's there, left over, would
    # win over SLURM's in main.py (distributed_utils.read_ranks) and make every task rank 0.
    unset RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT

    # Since SLURM 22.05, srun does not always inherit --cpus-per-task from sbatch: pass it on.
    # --kill-on-bad-exit: when one rank dies, stop the others rather than let them wait.
    local srun_args=(--kill-on-bad-exit=1)
    [ -n "${SLURM_CPUS_PER_TASK:-}" ] && srun_args+=(--cpus-per-task="$SLURM_CPUS_PER_TASK")
    [ "$in_container" = yes ] && srun_args+=(--environment="$EDF")

    echo "run.sh: job $SLURM_JOB_ID: ${SLURM_NTASKS:-?} tasks on $SLURM_JOB_NUM_NODES node(s)" \
         "($SLURM_JOB_NODELIST), $PYTHON${EDF:+ in $EDF}"
    # Bad input fails here, in one process on this node, rather than in every task. The
    # container's Python is reachable only through srun: there, the tasks find it themselves.
    # --resume auto comes first, here and below: the user's own --resume wins.
    if [ "$in_container" = no ]; then
        # shellcheck disable=SC2086  # no task count: main.py's default
        "$PYTHON" main.py --resume auto "$@" --check ${SLURM_NTASKS:-} || return
    fi
    # A SIGTERM before now ended this script (nothing had started); from now on it is caught.
    trap 'on_stop_signal TERM' TERM
    if [ -z "$stopping" ]; then
        # One sampler per node, beside the tasks (--overlap: it takes none of their resources).
        export SAMPLE_TAG=$SLURM_JOB_ID
        local sampler_code
        sampler_code="$(declare -p SAMPLER_STOP; declare -f sample_node); sample_node \"\$@\""
        srun --overlap --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" \
            --ntasks-per-node=1 bash -c "$sampler_code" sampler \
            "$SAMPLES_DIR" "$SAMPLE_TAG" "$SAMPLE_EVERY" &
        sampler_pid=$!
        # In the background, so that this shell can take SLURM's warning while the tasks train.
        srun "${srun_args[@]}" bash -c "$TASK_SETUP" task "$REPO" "$PYTHON" -u main.py \
            --resume auto "$@" &
        srun_pid=$!
        wait_through_signals "$srun_pid" || status=$?
        stop_sampler "$sampler_pid"
    fi
    trap - USR1 USR2 TERM
    # A line that outlives the job: SLURM forgets finished jobs after a while.
    if [ -n "$srun_pid" ]; then
        echo "run.sh: job $SLURM_JOB_ID exit status $status"
    elif [ "$requeue" = yes ]; then
        echo "run.sh: job $SLURM_JOB_ID was warned of its time limit before its tasks started"
    else
        echo "run.sh: job $SLURM_JOB_ID was sent SIGTERM before its tasks started"
        status=143
    fi
    [ "$requeue" = no ] || requeue_after_warning "$status" "${srun_pid:+started}"
    return "$status"
}

# SLURM warned that the time limit is near. Requeue unless the tasks finished anyway (they
# started, status 0) or the job has been requeued MAX_REQUEUES times: a time limit too short for
# start-up would warn every restart at once, forever. Any other status requeues: a warning that
# lands while Python is still starting kills the tasks before they can catch it.
requeue_after_warning() {
    local status=$1 tasks=$2 restarts=${SLURM_RESTART_COUNT:-0}
    if [ "$tasks" = started ] && [ "$status" -eq 0 ]; then
        echo "run.sh: job $SLURM_JOB_ID finished before its time limit; not requeued"
    elif [ "$restarts" -ge "$MAX_REQUEUES" ]; then
        echo "error: job $SLURM_JOB_ID stopped before its time limit but was requeued" \
             "$restarts times already (MAX_REQUEUES=$MAX_REQUEUES): not again; to go on," \
             "submit it anew with --resume and the folder its last [CHECKPOINT] line names" >&2
    else
        echo "run.sh: job $SLURM_JOB_ID stopped before its time limit; requeueing it" \
             "($((restarts + 1)) of at most $MAX_REQUEUES)"
        scontrol requeue "$SLURM_JOB_ID"
    fi
}

# The process's own exit status. `wait` returns early, with 128 + the signal's number, when a
# trapped signal arrives (the stop traps, on_stop_signal and signal_ranks, set signalled=yes):
# wait again, also where the process ended meanwhile (a task that saved and exited at once):
# `wait` still reports its status, where asking whether it runs would lose it.
wait_through_signals() {
    local status
    signalled=yes
    while [ "$signalled" = yes ]; do
        signalled=no
        status=0
        wait "$1" || status=$?
    done
    return "$status"
}

# Send signal $1 to the ranks, torchrun's (pid $2) child processes.
signal_ranks() {
    local pid
    signalled=yes   # see wait_through_signals
    [ -n "$2" ] || return 0
    for pid in $(pgrep -P "$2"); do
        kill -s "$1" "$pid" 2>/dev/null || true
    done
}

visible_gpus() {
    "$PYTHON" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null \
        || fail "$PYTHON cannot count the GPUs: import torch; torch.cuda.device_count() fails"
}

run_local() {
    PYTHON=$(pick_python "$REPO")
    require_modules "$PYTHON" torch
    local gpus procs
    gpus=$(visible_gpus)
    procs=${NPROC:-$((gpus > 0 ? gpus : 2))}
    [[ "$procs" =~ ^[1-9][0-9]*$ ]] || fail "NPROC must be a positive integer, got '$procs'"
    if [ "$gpus" -gt 0 ] && [ "$procs" -gt "$gpus" ]; then
        fail "NPROC=$procs exceeds the $gpus visible GPU(s): NCCL needs one GPU per process"
    fi
    # Share the cores between the processes, as SLURM's --cpus-per-task would.
    local cores
    cores=$(nproc)
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$((cores > procs ? cores / procs : 1))}
    # Bad input fails here, in one process and a couple of seconds, with main.py's one line.
    "$PYTHON" main.py "$@" --check "$procs" || exit
    # Each rank's stderr and torchrun's own report go to files, so that a failure ends with
    # the failed rank's one line instead of torchrun's report; rank 0's stdout stays here.
    local folder status=0
    folder=$LOGS/torchrun/$(date +%Y%m%d-%H%M%S)-$$
    mkdir -p "$folder"
    echo "run.sh: no SLURM job: $procs process(es) on this machine through torchrun, $PYTHON;" \
         "stderr in $folder"
    export SAMPLE_TAG=local-${folder##*/}
    sample_node "$SAMPLES_DIR" "$SAMPLE_TAG" "$SAMPLE_EVERY" &
    local sampler_pid=$! torchrun_pid=""
    # A stop signal to this script goes to every rank, as srun passes one on to its tasks: not
    # to torchrun, which SIGUSR1 and SIGUSR2 would end, leaving the ranks without it. Ctrl-C
    # (SIGINT) too: the ranks take a SIGINT that comes within a second of theirs from the
    # terminal for the same Ctrl-C (stopping.py). torchrun is told to leave SIGINT alone: it
    # would end with a traceback and pass it on (PET_SIGNALS_TO_HANDLE is torchrun's
    # --signals-to-handle: its default less SIGINT).
    trap 'signal_ranks USR1 "$torchrun_pid"' USR1
    trap 'signal_ranks USR2 "$torchrun_pid"' USR2
    trap 'signal_ranks TERM "$torchrun_pid"' TERM
    trap 'signal_ranks INT "$torchrun_pid"' INT
    # In the background, so that this shell can take a signal while the ranks train.
    PET_SIGNALS_TO_HANDLE=SIGTERM,SIGHUP,SIGQUIT \
        "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$procs" \
        --log-dir "$folder" --redirects 2 main.py "$@" 2>"$folder/torchrun.log" &
    torchrun_pid=$!
    wait_through_signals "$torchrun_pid" || status=$?
    trap - USR1 USR2 TERM INT
    stop_sampler "$sampler_pid"
    [ "$status" -eq 0 ] || report_failure "$folder" "$status"
}

# After torchrun failed: the exit status of the rank that failed first, and the first error:
# line of any rank (rank 0's first), printed last. torchrun itself exits 1 whatever the ranks'
# statuses; its report ("Root Cause (first observed failure)") names that rank and its status.
report_failure() {
    local folder=$1 status=$2 rank="" line
    read -r rank status < <(sed -n '/Root Cause/,$p' "$folder/torchrun.log" | awk '
        $1 == "rank" { rank = $3 }
        $1 == "exitcode" { print rank, $3; exit }') || rank=""
    if [ -z "$rank" ]; then   # torchrun failed before any rank did (its report says why)
        echo "error: torchrun failed (exit status $2); its report: $folder/torchrun.log" >&2
        exit "$2"
    fi
    [ "$status" -lt 0 ] && status=$((128 - status))   # killed by a signal, as bash counts it
    if [ "$status" -eq 3 ]; then   # main.py's own: stopped, checkpoint saved (utils.EXIT_STATUS)
        echo "run.sh: stopped by a signal after saving a checkpoint (exit status 3): resumable" >&2
        exit 3
    fi
    line=$(first_error_line "$folder") \
        || line="error: rank $rank ended with exit status $status: $(last_line "$folder" "$rank")"
    echo "run.sh: each rank's stderr and torchrun's report are in $folder" >&2
    echo "$line" >&2
    exit "$status"
}

first_error_line() {   # of the ranks' stderr under torchrun's --log-dir $1, in rank order
    local file
    for file in $(printf '%s\n' "$1"/*/attempt_*/*/stderr.log | sort -V); do
        grep -m 1 '^error: ' "$file" && return
    done
    return 1
}

last_line() {   # of rank $2's stderr under torchrun's --log-dir $1: a traceback's last line
    grep -hv '^\s*$' "$1"/*/attempt_*/"$2"/stderr.log 2>/dev/null | tail -n 1
}

REPO=$(find_repo)
cd "$REPO"
# shellcheck source=pick_python.sh  # pick_python, require_modules: which Python, shared
source "$REPO/pick_python.sh"
LOGS=logs   # layout.LOGS_DIR, relative to the repository (tests/test_docs.py checks it)
SAMPLES_DIR=$(realpath -m "${SAMPLES_DIR:-$LOGS}")
SAMPLE_EVERY=${SAMPLE_EVERY:-5}
[[ "$SAMPLE_EVERY" =~ ^[1-9][0-9]*$ ]] || fail "SAMPLE_EVERY must be whole seconds: '$SAMPLE_EVERY'"
MAX_REQUEUES=${MAX_REQUEUES:-10}
[[ "$MAX_REQUEUES" =~ ^[0-9]+$ ]] || fail "MAX_REQUEUES must be a whole number: '$MAX_REQUEUES'"
if [ -n "${SLURM_JOB_ID:-}" ]; then
    run_slurm "$@"
else
    run_local "$@"
fi
