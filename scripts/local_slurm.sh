#!/usr/bin/env bash
# A one-node Slurm cluster on this machine (slurmctld + slurmd + munge), to submit the course's sbatch
# files with the real sbatch / srun / squeue. Debian or Ubuntu, as root:
#
#   apt-get install -y --no-install-recommends slurm-wlm      # slurmctld, slurmd, munge, the client tools
#   bash scripts/local_slurm.sh start                         # writes /etc/slurm/slurm.conf, starts the daemons
#   bash scripts/local_slurm.sh status                        # sinfo: one node, idle
#   COURSE_REAL_SLURM=1 .venv/bin/python -m pytest -q tests/test_cluster_files.py -k real_slurm
#   bash scripts/local_slurm.sh stop
#
# The node has this machine's CPUs and no GPUs, so a job must ask for none (the test submits
# `sbatch --gpus-per-node=0 --cpus-per-task=<cores> ...`; options on the command line override #SBATCH
# lines). Plugins are the ones that need no cgroups (proctrack/linuxproc, task/none), so it also runs in
# containers. A real cluster's slurm.conf is written by its administrators; this one is for learning only.
set -euo pipefail

CONF_DIR=/etc/slurm
STATE_DIR=/var/lib/slurm
LOG_DIR=/var/log/slurm
NODE=$(hostname -s)

write_config() {
    local cpus memory
    cpus=$(nproc)
    memory=$(awk '/MemTotal/ {print int($2 / 1024 * 0.8)}' /proc/meminfo)  # MiB; leave the OS some room
    mkdir -p "$CONF_DIR" "$STATE_DIR/slurmctld" "$STATE_DIR/slurmd" "$LOG_DIR"
    cat > "$CONF_DIR/slurm.conf" <<EOF
# Written by scripts/local_slurm.sh: a one-node cluster for the course's sbatch files.
ClusterName=course
SlurmctldHost=$NODE
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
MpiDefault=none
ReturnToService=2
StateSaveLocation=$STATE_DIR/slurmctld
SlurmdSpoolDir=$STATE_DIR/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName=$NODE CPUs=$cpus RealMemory=$memory State=UNKNOWN
PartitionName=local Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
}

start() {
    command -v slurmctld >/dev/null || { echo "slurmctld not found: apt-get install -y slurm-wlm" >&2; exit 1; }
    write_config
    # munge authenticates every message between the tools and the daemons; it refuses to run as root.
    mkdir -p /run/munge && chown munge:munge /run/munge
    [ -s /etc/munge/munge.key ] || { mungekey --create 2>/dev/null || create-munge-key; }
    pgrep -x munged >/dev/null || runuser -u munge -- munged
    pgrep -x slurmctld >/dev/null || slurmctld
    pgrep -x slurmd >/dev/null || slurmd
    for _ in $(seq 30); do  # the controller needs a moment before it answers
        if scontrol ping 2>/dev/null | grep -q UP && sinfo -h -o %T 2>/dev/null | grep -qE 'idle|mixed'; then
            sinfo
            return 0
        fi
        sleep 1
    done
    echo "Slurm did not come up; see $LOG_DIR/slurmctld.log and $LOG_DIR/slurmd.log" >&2
    exit 1
}

stop() {
    local pidfile
    for pidfile in /run/slurmd.pid /run/slurmctld.pid /run/munge/munged.pid; do  # the daemons we started
        if [ -s "$pidfile" ]; then
            kill "$(cat "$pidfile")" 2>/dev/null || true
            rm -f "$pidfile"
        fi
    done
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) scontrol ping && sinfo ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
