#!/usr/bin/env bash
# A private one-node SLURM cluster on this machine (localhost, 2 CPUs, no cgroups), for the
# tests and for trying the sbatch scripts of docs/clusters.md. Needs root and Debian's
# slurm-wlm and munge (scripts/slurm/install.sh).
#
#   bash scripts/slurm/local-cluster.sh start DIR   # config, state, logs under DIR
#   export SLURM_CONF=DIR/slurm.conf                 # then srun, sbatch, squeue, scontrol
#   bash scripts/slurm/local-cluster.sh stop DIR
#
# Its own munged (its own key and socket), slurmctld and slurmd, on free ports: a SLURM or
# munge already running on the machine is left alone.
set -euo pipefail
action=${1:-}
dir=${2:-}
if [ -z "$action" ] || [ -z "$dir" ]; then
  echo "usage: $0 start|stop DIR" >&2
  exit 2
fi

stop() {  # the daemons this script started in DIR (their pid files), all at once
  local name pid pids=()
  for name in slurmd slurmctld munged; do
    if [ -f "$dir/run/$name.pid" ]; then
      pid=$(cat "$dir/run/$name.pid")
      kill "$pid" 2>/dev/null && pids+=("$pid")
      rm -f "$dir/run/$name.pid"
    fi
  done
  for _ in $(seq 100); do
    alive "${pids[@]}" || return 0
    sleep 0.1
  done
  for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
}

alive() {  # whether any of these processes still runs
  local pid
  for pid in "$@"; do kill -0 "$pid" 2>/dev/null && return 0; done
  return 1
}

if [ "$action" = stop ]; then
  stop
  exit 0
fi
if [ "$action" != start ]; then
  echo "unknown action $action: start or stop" >&2
  exit 2
fi
if [ "$(id -u)" != 0 ]; then
  echo "the local SLURM cluster runs its daemons as root (SlurmUser=root): run as root" >&2
  exit 1
fi
for tool in munged slurmctld slurmd srun scontrol; do
  command -v "$tool" >/dev/null || { echo "$tool not found: run scripts/slurm/install.sh (as root)" >&2; exit 1; }
done

mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
mkdir -p "$dir/munge" "$dir/state" "$dir/spool" "$dir/log" "$dir/run"
chmod 0700 "$dir" "$dir/munge" "$dir/state" "$dir/spool" "$dir/log" "$dir/run"
host=$(hostname -s)
read -r ctld_port slurmd_port < <(python3 - <<'PY'
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))
PY
)

# munge: a key of its own, a socket of its own.
if [ ! -f "$dir/munge/munge.key" ]; then
  dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
  chmod 0400 "$dir/munge/munge.key"
fi
socket="$dir/munge/munge.socket"
munged --force --socket="$socket" --key-file="$dir/munge/munge.key" \
  --pid-file="$dir/run/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munge/seed"

cat > "$dir/slurm.conf" <<CONF
ClusterName=gradsync-local
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$socket
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
ReturnToService=2
SlurmdParameters=config_overrides
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
PlugStackConfig=$dir/plugstack.conf
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=300
KillWait=5
NodeName=$host NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=local Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
: > "$dir/plugstack.conf"

export SLURM_CONF="$dir/slurm.conf"
slurmctld -f "$SLURM_CONF" -i  # -i: ignore state left by an earlier start in DIR
slurmd -f "$SLURM_CONF" -N "$host"
for _ in $(seq 300); do
  state=$(sinfo -h -n "$host" -o %t 2>/dev/null || true)
  case "$state" in
    idle|mix|alloc) echo "SLURM_CONF=$SLURM_CONF"; exit 0 ;;
  esac
  sleep 0.1
done
echo "the local SLURM node did not become idle within 30 s (state: ${state:-none}); logs in $dir/log" >&2
stop
exit 1
