#!/bin/bash
# stop.sh [--purge] -- stop the cluster that .ci/slurm/start.sh started.
#
# Cancels its jobs, then stops its slurmd and slurmctld daemons by their pid files (never by
# name: another SLURM may run on this machine), and munged if start.sh started it.
# --purge also removes $PROJECT_SLURM_DIR (configuration, state, logs, fake GPUs) and the
# /etc/hosts line. The packages stay installed.
set -uo pipefail

DIR=${PROJECT_SLURM_DIR:-/tmp/project-slurm}
export SLURM_CONF=$DIR/etc/slurm.conf
HOSTS_TAG="# project-slurm"

log() { echo "[stop.sh] $*"; }

# The pid in a pid file, if that process is alive and is the daemon we expect.
live_pid() {
    local pid_file=$1 name=$2 pid
    [ -s "$pid_file" ] || return 1
    pid=$(<"$pid_file")
    [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$name" ] && echo "$pid"
}

cancel_jobs() {
    local jobs
    mapfile -t jobs < <(squeue --noheader --format=%i 2>/dev/null)
    [ "${#jobs[@]}" -gt 0 ] || return 0
    log "cancelling jobs ${jobs[*]}"
    scancel "${jobs[@]}" 2>/dev/null
    for _ in $(seq 50); do
        [ -z "$(squeue --noheader --format=%i 2>/dev/null)" ] && break
        sleep 0.2
    done
}

# SIGTERM all at once (each daemon takes a second or two), SIGKILL what is left after 15 s.
stop_pids() {
    local pids=("$@") left p
    [ "${#pids[@]}" -gt 0 ] || return 0
    log "stopping pids ${pids[*]}"
    kill "${pids[@]}" 2>/dev/null
    for _ in $(seq 75); do
        left=()
        for p in "${pids[@]}"; do [ -d "/proc/$p" ] && left+=("$p"); done
        [ "${#left[@]}" = 0 ] && return 0
        sleep 0.2
    done
    log "killing ${left[*]}"
    kill -9 "${left[@]}" 2>/dev/null
}

purge() {
    rm -rf "$DIR"
    if grep -q "$HOSTS_TAG\$" /etc/hosts; then
        local others
        others=$(grep -v "$HOSTS_TAG\$" /etc/hosts)
        printf '%s\n' "$others" >/etc/hosts   # in place: /etc/hosts may be a bind mount
    fi
    log "removed $DIR and the /etc/hosts line"
}

[ "$(id -u)" = 0 ] || { echo "[stop.sh] error: must run as root" >&2; exit 1; }

pids=()
if pid=$(live_pid "$DIR/state/slurmctld.pid" slurmctld); then
    cancel_jobs   # while the controller is there to clean up after them
    pids+=("$pid")
fi
for pid_file in "$DIR"/state/slurmd_*.pid; do
    pid=$(live_pid "$pid_file" slurmd) && pids+=("$pid")
done
if [ -e "$DIR/munged.started_by_us" ]; then
    pid=$(live_pid /run/munge/munged.pid munged) && pids+=("$pid")
    rm -f "$DIR/munged.started_by_us"
fi
stop_pids "${pids[@]}"
[ "${1:-}" = --purge ] && purge
exit 0
