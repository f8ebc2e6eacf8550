#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for trying scripts/slurm.sbatch without a real
# cluster (developers and tests; run as root). Debian's packages, a minimal slurm.conf in a
# state folder, and the daemons started and stopped by their own pids: nothing else on the
# machine is touched.
#
#   bash scripts/slurm_dev_cluster.sh install   # apt-get install slurmctld slurmd slurm-client munge
#   eval "$(bash scripts/slurm_dev_cluster.sh start)"   # prints: export SLURM_CONF=...
#   sbatch --wait ... ; squeue ; sinfo
#   bash scripts/slurm_dev_cluster.sh stop
#
# State: $SLURM_DEV_DIR (default /tmp/slurm-dev). Ports: SLURM_DEV_PORT and the next one.
set -euo pipefail

DIR=${SLURM_DEV_DIR:-/tmp/slurm-dev}
PORT=${SLURM_DEV_PORT:-6917}
CONF="$DIR/slurm.conf"

die() { echo "slurm_dev_cluster.sh: error: $*" >&2; exit 2; }

install() {
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client munge
}

start() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
    || die "Slurm is not installed: run '$0 install' (Debian packages slurmctld slurmd slurm-client munge)"
  [ "$(id -u)" = 0 ] || die "run as root (the daemons run as root here)"
  if [ -f "$DIR/slurmctld.pid" ] && kill -0 "$(cat "$DIR/slurmctld.pid")" 2>/dev/null; then
    echo "export SLURM_CONF=$CONF"; return 0
  fi
  mkdir -p "$DIR/state" "$DIR/spool" "$DIR/munge"
  local host cpus mem
  host=$(hostname -s)
  cpus=$(getconf _NPROCESSORS_ONLN)   # not nproc: it obeys OMP_NUM_THREADS
  mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 512 ))

  # munge: a key of our own and a daemon of our own on its own socket.
  [ -f "$DIR/munge/munge.key" ] || { dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 2>/dev/null
                                    chmod 400 "$DIR/munge/munge.key"; }
  munged --force --key-file="$DIR/munge/munge.key" --socket="$DIR/munge/munge.socket" \
         --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/munge/munged.log" --seed-file="$DIR/munge/seed"

  # cred_expire=20: a job step's credential lifetime, which is also how long a requeued job
  # waits before it may start again. Slurm's default, 120 s, leaves room for slow prologs on
  # real clusters; 20 s is ample on this one node and shortens the requeue test.
  cat > "$CONF" <<EOF
ClusterName=dev
SlurmctldHost=$host
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$DIR/munge/munge.socket,cred_expire=20
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
JobRequeue=1
SchedulerType=sched/builtin
NodeName=$host CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
  export SLURM_CONF=$CONF
  slurmctld -f "$CONF"
  slurmd -f "$CONF"
  for _ in $(seq 60); do
    if sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
      echo "export SLURM_CONF=$CONF"; return 0
    fi
    sleep 0.5
  done
  die "the node did not come up; see $DIR/slurmctld.log and $DIR/slurmd.log"
}

stop() {
  local name pid
  for name in slurmd slurmctld munge/munged; do
    if [ -f "$DIR/$name.pid" ]; then
      pid=$(cat "$DIR/$name.pid")
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
      rm -f "$DIR/$name.pid"
    fi
  done
}

case "${1:-}" in
  install) install ;;
  start) start ;;
  stop) stop ;;
  *) die "usage: $0 install|start|stop" ;;
esac
