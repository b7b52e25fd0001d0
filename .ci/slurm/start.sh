#!/bin/bash
# start.sh -- the project's own SLURM cluster on this machine's loopback, for the integration
# tests (tests/test_slurm.py) and for trying run.sh / run_benchmarks.py without a real cluster.
# As root (prefix sudo if you are not root; a container may have no sudo):
#
#     .ci/slurm/start.sh                        # install if needed, configure, start
#     export SLURM_CONF=/tmp/project-slurm/etc/slurm.conf
#     sbatch --wait --nodes=2 --ntasks-per-node=2 --cpus-per-task=1 run.sh --device cpu \
#         --dataset synthetic
#     .ci/slurm/stop.sh [--purge]
#
# Debian 12's SLURM 22.05 (slurmctld, slurmd, slurm-client, munge), run as root without systemd:
# one controller and one slurmd per emulated node (node1, node2), all on 127.0.0.1, each node
# with fake GPUs. Torch sees no GPU here, and main.py refuses GPUs it cannot see rather than
# fall back to the CPU unasked: jobs pass --device cpu and train on CPU with gloo, a rank per
# "GPU".
#
# The cluster is self-contained: its configuration lives in $PROJECT_SLURM_DIR/etc, not in
# /etc/slurm, and it listens on its own ports, so a system SLURM (or another test cluster) on
# the same machine is left alone. Clients find it through SLURM_CONF, which jobs inherit.
# Starting is idempotent: a cluster that is already up is only reported.
#
# Settings (environment):
#   PROJECT_SLURM_DIR   configuration, state, logs, fake GPUs        /tmp/project-slurm
#   PROJECT_SLURM_NODES emulated nodes                              2
#   PROJECT_SLURM_CPUS  CPUs per node (may exceed the real cores)    32: run.sh's defaults fit
#   PROJECT_SLURM_GPUS  fake GPUs per node                          4
#   PROJECT_SLURM_PORT  slurmctld port; slurmd ports follow it      6917
set -euo pipefail

DIR=${PROJECT_SLURM_DIR:-/tmp/project-slurm}
NODES=${PROJECT_SLURM_NODES:-2}
CPUS=${PROJECT_SLURM_CPUS:-32}
GPUS=${PROJECT_SLURM_GPUS:-4}
PORT=${PROJECT_SLURM_PORT:-6917}
PACKAGES=(slurmctld slurmd slurm-client munge)
export SLURM_CONF=$DIR/etc/slurm.conf
HOSTS_TAG="# project-slurm"   # marks our /etc/hosts line, so stop.sh removes only that

log() { echo "[start.sh] $*"; }
die() {
    echo "[start.sh] error: $*" >&2
    for f in "$DIR"/log/*.log; do [ -f "$f" ] && { echo "--- $f" >&2; tail -n 15 "$f" >&2; }; done
    exit 1
}
node_names() { seq -f "node%g" 1 "$NODES"; }

# Polls a condition every 0.2 s for up to $1 seconds.
wait_for() {
    local seconds=$1; shift
    local i
    for ((i = 0; i < seconds * 5; i++)); do "$@" && return 0; sleep 0.2; done
    return 1
}
# Without its configuration file, scontrol would retry for a minute before giving up.
controller_up() { [ -f "$SLURM_CONF" ] && scontrol ping 2>/dev/null | grep -q 'is UP'; }
idle_nodes() { sinfo --noheader --Node --states=idle --format=%N 2>/dev/null | sort -u | wc -l; }
all_nodes_idle() { [ "$(idle_nodes)" = "$NODES" ]; }
responding_nodes() { sinfo --noheader --Node --responding --format=%N 2>/dev/null | sort -u | wc -l; }
all_nodes_up() { [ "$(responding_nodes)" = "$NODES" ]; }

install_packages() {
    local missing=() p
    for p in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' \
            || missing+=("$p")
    done
    [ "${#missing[@]}" = 0 ] && return
    command -v apt-get >/dev/null \
        || die "cannot install ${missing[*]}: no apt-get (Debian 12 expected)"
    log "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null 2>&1 || die "apt-get update failed"
    apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null 2>&1 \
        || die "apt-get install ${missing[*]} failed"
}

munge_works() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

# One munged serves every SLURM on the machine; start it only if none answers, and remember
# that we did, so that stop.sh stops only what this script started.
start_munge() {
    munge_works && return
    if [ ! -s /etc/munge/munge.key ]; then
        install -d -o munge -g munge -m 0700 /etc/munge
        mungekey --create --keyfile=/etc/munge/munge.key
        chown munge:munge /etc/munge/munge.key
        chmod 0400 /etc/munge/munge.key
    fi
    install -d -o munge -g munge -m 0755 /run/munge
    runuser -u munge -- /usr/sbin/munged </dev/null >"$DIR/log/munged.log" 2>&1 \
        || die "munged failed to start"
    touch "$DIR/munged.started_by_us"
    wait_for 10 munge_works || die "munge does not work"
}

# SLURM drops GPU GRES without device files, and a device must be a character device for
# CUDA_VISIBLE_DEVICES to be set: copies of /dev/null (major 1, minor 3) stand in for GPUs.
make_fake_gpus() {
    local i
    mkdir -p "$DIR/gpu"
    for ((i = 0; i < GPUS; i++)); do
        [ -c "$DIR/gpu/nvidia$i" ] || mknod -m 0666 "$DIR/gpu/nvidia$i" c 1 3
    done
}

write_config() {
    local mem_mb=$(($(awk '/^MemTotal:/ {print $2}' /proc/meminfo) / 1024 / NODES))
    local gres="" gres_types=""
    if [ "$GPUS" -gt 0 ]; then gres="Gres=gpu:$GPUS"; gres_types="GresTypes=gpu"; fi
    mkdir -p "$DIR/etc"
    cat >"$SLURM_CONF" <<CONF
# Written by .ci/slurm/start.sh: a test cluster of $NODES emulated nodes on 127.0.0.1.
ClusterName=project
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$PORT
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$DIR/state/ctld
SlurmdSpoolDir=$DIR/state/%n
SlurmctldPidFile=$DIR/state/slurmctld.pid
SlurmdPidFile=$DIR/state/slurmd_%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd_%n.log
# No cgroups in a container: plain process tracking, no CPU binding (CPUs are oversubscribed).
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
# No accounting database, so no sacct: finished jobs are kept in a text file for debugging.
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/log/jobcomp.log
MailProg=/bin/true
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Start jobs as soon as they are submitted (the default waits up to 3 s).
SchedulerParameters=batch_sched_delay=0
# Believe the CPU counts below although the machine has fewer cores.
SlurmdParameters=config_overrides
# Refuse impossible requests at submission instead of leaving them pending forever.
EnforcePartLimits=ALL
ReturnToService=2
InactiveLimit=0
KillWait=5
# sbatch --wait polls every MinJobAge/2 s (at least 2); the default 300 makes it poll at
# 2, 10, 42, 74... s. Finished jobs then leave scontrol/squeue after a few seconds.
MinJobAge=4
$gres_types
NodeName=node[1-$NODES] NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((PORT + 1))-$((PORT + NODES)) CPUs=$CPUS Sockets=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=$mem_mb $gres State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
    if [ "$GPUS" -gt 0 ]; then
        printf 'AutoDetect=off\nName=gpu File=%s/gpu/nvidia[0-%d]\n' "$DIR" $((GPUS - 1)) \
            >"$DIR/etc/gres.conf"
    else
        rm -f "$DIR/etc/gres.conf"
    fi
}

# MASTER_ADDR is the job's first node name, so node names must resolve (to loopback).
add_hosts_line() {
    local others
    others=$(grep -v "$HOSTS_TAG\$" /etc/hosts || true)
    # Rewritten in place rather than with sed -i: /etc/hosts may be a bind mount.
    printf '%s\n127.0.0.1 %s %s\n' "$others" "$(node_names | paste -sd' ')" "$HOSTS_TAG" >/etc/hosts
}

start_daemons() {
    /usr/sbin/slurmctld -f "$SLURM_CONF" </dev/null >>"$DIR/log/slurmctld.log" 2>&1 \
        || die "slurmctld failed to start"
    wait_for 20 controller_up || die "slurmctld does not answer"
    local n
    for n in $(node_names); do
        /usr/sbin/slurmd -f "$SLURM_CONF" -N "$n" </dev/null >>"$DIR/log/slurmd_$n.log" 2>&1 \
            || die "slurmd for $n failed to start"
    done
    wait_for 60 all_nodes_idle || { sinfo -N >&2 || true; die "nodes did not become idle"; }
}

check_settings() {
    local name
    for name in NODES CPUS PORT; do
        [[ "${!name}" =~ ^[1-9][0-9]*$ ]] || die "PROJECT_SLURM_$name must be a positive integer"
    done
    [[ "$GPUS" =~ ^[0-9]+$ ]] || die "PROJECT_SLURM_GPUS must be a whole number"
}

[ "$(id -u)" = 0 ] || die "must run as root (it installs packages and starts daemons)"
check_settings
install_packages
if controller_up && all_nodes_up; then
    log "already running (SLURM_CONF=$SLURM_CONF)"
    exit 0
fi
"$(dirname "${BASH_SOURCE[0]}")/stop.sh" >/dev/null 2>&1 || true   # leftovers of a partial start
rm -rf "$DIR/state" "$DIR/log"
mkdir -p "$DIR/state/ctld" "$DIR/log"
start_munge
make_fake_gpus
write_config
add_hosts_line
start_daemons
timeout 60 srun --nodes="$NODES" --ntasks-per-node=1 true \
    || die "a first srun over all nodes failed"
log "$NODES nodes up: $(node_names | paste -sd' ') ($CPUS CPUs, $GPUS fake GPUs each)"
log "to use it: export SLURM_CONF=$SLURM_CONF"
