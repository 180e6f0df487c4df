#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for proving the Slurm path for real: starts
# munged, slurmctld and slurmd (all their state, sockets and logs in a temporary directory,
# on free ports), submits jobs/train.sbatch with `sbatch --wait`, prints the job's output and
# stops the cluster again. Needs root and Debian's slurm-wlm and munge packages.
#
#   jobs/slurm_local.sh --install            # apt-get install slurm-wlm munge (about a minute), then stop
#   jobs/slurm_local.sh [hpcdl.train options] # run the training job through sbatch + srun
#
# Environment: RUN_DIR (the job's run directory; default: inside the temporary directory,
# removed at the end), NTASKS (tasks on the node, default 2).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PATH="$PATH:/usr/sbin:/sbin"

if [ "${1:-}" = "--install" ]; then
    if command -v slurmctld >/dev/null && command -v munged >/dev/null; then
        echo "slurm-wlm and munge are already installed"
        exit 0
    fi
    [ "$(id -u)" = 0 ] || { echo "slurm_local.sh --install: needs root (apt-get)" >&2; exit 3; }
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
    echo "installed: $(slurmctld -V)"
    exit 0
fi

for tool in munged slurmctld slurmd sbatch sinfo; do
    command -v "$tool" >/dev/null || { echo "slurm_local.sh: $tool not found; run jobs/slurm_local.sh --install" >&2; exit 3; }
done
[ "$(id -u)" = 0 ] || { echo "slurm_local.sh: needs root (slurmd runs jobs as any user)" >&2; exit 3; }
# the venv the batch script activates
source "$ROOT/jobs/env.sh"

DIR="$(mktemp -d /tmp/hpcdl-slurm.XXXXXX)"
chmod 700 "$DIR"
stop() {
    for d in slurmd slurmctld munged; do
        [ -f "$DIR/$d.pid" ] && kill "$(cat "$DIR/$d.pid")" 2>/dev/null || true
    done
    sleep 1
    rm -rf "$DIR"
}
trap stop EXIT

free_port() { python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
HOST="$(hostname -s)"
dd if=/dev/urandom of="$DIR/munge.key" bs=1024 count=1 2>/dev/null
chmod 400 "$DIR/munge.key"
munged --force --key-file="$DIR/munge.key" --socket="$DIR/munge.sock" --log-file="$DIR/munged.log" \
    --pid-file="$DIR/munged.pid" --seed-file="$DIR/munged.seed"
mkdir -p "$DIR/state" "$DIR/spool"
cat >"$DIR/slurm.conf" <<EOF
ClusterName=hpcdl-local
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
AuthType=auth/munge
AuthInfo=socket=$DIR/munge.sock
SlurmUser=root
SlurmdUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$(getconf _NPROCESSORS_ONLN) State=UNKNOWN
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
export SLURM_CONF="$DIR/slurm.conf"
slurmctld -f "$SLURM_CONF"
slurmd -f "$SLURM_CONF"
for _ in $(seq 60); do
    [ "$(sinfo -h -o %T 2>/dev/null)" = "idle" ] && break
    sleep 0.5
done
if [ "$(sinfo -h -o %T 2>/dev/null)" != "idle" ]; then
    echo "slurm_local.sh: the node did not come up; logs:" >&2
    tail -n 20 "$DIR/slurmctld.log" "$DIR/slurmd.log" >&2
    exit 1
fi
echo "one-node cluster up: $(sinfo -h -o '%P %D node(s) %c CPUs %T')"

cd "$ROOT"
JOB="$(sbatch --parsable --ntasks-per-node="${NTASKS:-2}" --output="$DIR/train-%j.out" jobs/train.sbatch \
    --run-dir "${RUN_DIR:-$DIR/run}" --no-progress "$@")"
echo "submitted job $JOB"
# wait for it (sbatch --wait polls at growing intervals, up to half a minute); a job that
# cannot be scheduled would wait forever, so give up after 10 minutes
state=""
for _ in $(seq 1200); do
    state="$(scontrol show job "$JOB" 2>/dev/null | grep -o 'JobState=[A-Z_]*' | cut -d= -f2)"
    case "$state" in PENDING | CONFIGURING | RUNNING | COMPLETING | "") sleep 0.5 ;; *) break ;; esac
done
code="$(scontrol show job "$JOB" | grep -o ' ExitCode=[0-9]*:[0-9]*' | cut -d= -f2)"
cat "$DIR"/train-*.out
echo "job $JOB: $state, exit code $code"
[ "$state" = "COMPLETED" ]
