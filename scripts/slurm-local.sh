#!/usr/bin/env bash
# A one-node Slurm cluster on this machine (munged + slurmctld + slurmd), for the tests and for
# trying `flux-hpc sbatch` on a laptop. Config, state, logs and the munge key live in one directory
# (default /tmp/flux-slurm, or $FLUX_SLURM_DIR); the daemons are stopped by PID.
#
#   bash scripts/slurm-local.sh start    # idempotent; then: export SLURM_CONF=/tmp/flux-slurm/slurm.conf
#   bash scripts/slurm-local.sh status
#   bash scripts/slurm-local.sh stop
#
# Needs the Debian packages slurm-wlm and munge (scripts/setup.sh installs them) and root, as the
# daemons run as root here.
set -euo pipefail

dir="${FLUX_SLURM_DIR:-/tmp/flux-slurm}"
conf="$dir/slurm.conf"
host="$(hostname -s)"
export SLURM_CONF="$conf"

say() { printf '\033[1m[slurm-local]\033[0m %s\n' "$*" >&2; }

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

write_config() {
    local cpus mem
    cpus="$(nproc)"
    mem=$(( $(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo) - 2048 ))
    cat > "$conf" <<CONF
# Written by scripts/slurm-local.sh: a single-node cluster for tests.
ClusterName=fluxlocal
SlurmctldHost=$host
SlurmctldPort=16817
SlurmdPort=16818
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket,cred_expire=10
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
JobRequeue=1
MinJobAge=3600
KillWait=10
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName=$host CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
}

start() {
    if alive "$dir/slurmctld.pid" && alive "$dir/slurmd.pid" && alive "$dir/munge/munged.pid"; then
        say "already running ($conf)"
        echo "export SLURM_CONF=$conf"
        return
    fi
    stop quiet
    for cmd in munged slurmctld slurmd sbatch; do
        command -v "$cmd" >/dev/null || { say "$cmd not found: run scripts/setup.sh"; exit 1; }
    done
    mkdir -p "$dir"/{spool,state,log,munge}
    chmod 700 "$dir/munge"
    [ -f "$dir/munge/munge.key" ] || {
        dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
        chmod 400 "$dir/munge/munge.key"
    }
    munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.socket" \
        --pid-file="$dir/munge/munged.pid" --log-file="$dir/log/munged.log" \
        --seed-file="$dir/munge/munged.seed"
    write_config
    slurmctld -f "$conf"
    slurmd -f "$conf"
    for _ in $(seq 60); do
        state="$(sinfo -h -o %T 2>/dev/null || true)"
        if [ "$state" = idle ] || [ "$state" = mixed ] || [ "$state" = allocated ]; then
            say "up: node $host $state ($conf)"
            echo "export SLURM_CONF=$conf"
            return
        fi
        sleep 0.5
    done
    say "the node did not come up; logs in $dir/log"
    tail -n 20 "$dir"/log/*.log >&2 || true
    exit 1
}

stop() {
    for pidfile in "$dir/slurmd.pid" "$dir/slurmctld.pid" "$dir/munge/munged.pid"; do
        if alive "$pidfile"; then
            pid="$(cat "$pidfile")"
            kill "$pid"
            for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            kill -9 "$pid" 2>/dev/null || true
        fi
        rm -f "$pidfile"
    done
    [ "${1:-}" = quiet ] || say "stopped"
}

status() {
    if alive "$dir/slurmctld.pid"; then
        sinfo
        squeue
    else
        say "not running"
        exit 1
    fi
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) status ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
