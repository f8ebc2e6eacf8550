#!/usr/bin/env bash
# A Slurm cluster on this machine, for trying scripts/slurm.sbatch without a real cluster
# (developers and tests; run as root). Debian's packages, a minimal slurm.conf in a state
# folder, and the daemons started and stopped by their own pids: nothing else on the
# machine is touched.
#
#   bash scripts/slurm_dev_cluster.sh install   # apt-get install slurmctld slurmd slurm-client munge
#   eval "$(bash scripts/slurm_dev_cluster.sh start)"   # prints: export SLURM_CONF=...
#   sbatch --wait ... ; squeue ; sinfo
#   bash scripts/slurm_dev_cluster.sh stop
#
# One node (this machine) by default. Several nodes: the hosts of scripts/netns_hosts.py,
# a slurmd on each (the controller on the first), named in SLURM_DEV_HOSTS as
# NAME:ADDRESS:NAMESPACE,... Slurm's commands then run on a host, where the controller's
# address is reached:
#
#   python3 scripts/netns_hosts.py up
#   export SLURM_DEV_HOSTS=nodea:10.231.0.1:nh0-nodea,nodeb:10.231.0.2:nh0-nodeb
#   eval "$(bash scripts/slurm_dev_cluster.sh start)"
#   python3 scripts/netns_hosts.py run nodea sbatch --nodes=2 ...
#
# State: $SLURM_DEV_DIR (default /tmp/slurm-dev). Ports: SLURM_DEV_PORT and the next one.
set -euo pipefail

DIR=${SLURM_DEV_DIR:-/tmp/slurm-dev}
PORT=${SLURM_DEV_PORT:-6917}
CONF="$DIR/slurm.conf"
HOSTS=${SLURM_DEV_HOSTS:-}

# on NAMESPACE NAME CMD...: CMD on that host (its network, hosts file and hostname); here,
# on this machine, when NAMESPACE is empty. Not `ip netns exec`: it mounts a new /sys,
# without the cgroup file systems that slurmd needs; the hosts file is bound by hand.
on() {
  local ns=$1 name=$2; shift 2
  if [ -z "$ns" ]; then "$@"; return; fi
  nsenter --net="/run/netns/$ns" unshare --mount --uts -- sh -c \
    'mount --bind "/etc/netns/$1/hosts" /etc/hosts && echo "$2" > /proc/sys/kernel/hostname && shift 2 && exec "$@"' \
    sh "$ns" "$name" "$@"
}

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
  local host cpus mem nodes names first_ns="" ctl_addr="" entry name addr ns entries=()
  host=$(hostname -s)
  cpus=$(getconf _NPROCESSORS_ONLN)   # not nproc: it obeys OMP_NUM_THREADS
  mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 512 ))
  # The nodes: this machine, or the hosts named in SLURM_DEV_HOSTS (each claims all the
  # cores and memory: they share this machine's, as test hosts do).
  nodes="NodeName=$host CPUs=$cpus RealMemory=$mem State=UNKNOWN"
  names=$host
  if [ -n "$HOSTS" ]; then
    nodes="" names=""
    IFS=, read -ra entries <<< "$HOSTS"
    for entry in "${entries[@]}"; do
      IFS=: read -r name addr ns <<< "$entry"
      [ -n "$ns" ] || die "SLURM_DEV_HOSTS: expected NAME:ADDRESS:NAMESPACE, got $entry"
      ip netns pids "$ns" >/dev/null 2>&1 || die "no network namespace $ns (scripts/netns_hosts.py up)"
      nodes+="NodeName=$name NodeAddr=$addr NodeHostname=$name CPUs=$cpus RealMemory=$mem State=UNKNOWN"$'\n'
      names+="${names:+,}$name"
      if [ -z "$first_ns" ]; then first_ns=$ns host=$name ctl_addr=$addr; fi
    done
  fi

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
SlurmctldHost=$host${ctl_addr:+($ctl_addr)}
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$DIR/munge/munge.socket,cred_expire=20
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
JobRequeue=1
SchedulerType=sched/builtin
$nodes
PartitionName=debug Nodes=$names Default=YES MaxTime=INFINITE State=UP
EOF
  export SLURM_CONF=$CONF
  on "$first_ns" "$host" slurmctld -f "$CONF"
  if [ -z "$HOSTS" ]; then
    mkdir -p "$DIR/spool/$host"
    slurmd -f "$CONF"
  else
    for entry in "${entries[@]}"; do
      IFS=: read -r name addr ns <<< "$entry"
      mkdir -p "$DIR/spool/$name"
      on "$ns" "$name" slurmd -f "$CONF" -N "$name"
    done
  fi
  local count up=0
  count=$(tr ',' '\n' <<< "$names" | wc -l)
  for _ in $(seq 60); do
    up=$(on "$first_ns" "$host" sinfo -h -N -o %T 2>/dev/null | grep -cE '^(idle|mixed|allocated)' || true)
    if [ "$up" -ge "$count" ]; then
      echo "export SLURM_CONF=$CONF"; return 0
    fi
    sleep 0.5
  done
  die "$((count - up)) of $count nodes did not come up; see $DIR/slurmctld.log and $DIR/slurmd-*.log"
}

stop() {
  local file pid
  for file in "$DIR"/slurmd-*.pid "$DIR/slurmctld.pid" "$DIR/munge/munged.pid"; do
    if [ -f "$file" ]; then
      pid=$(cat "$file")
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
      rm -f "$file"
    fi
  done
}

case "${1:-}" in
  install) install ;;
  start) start ;;
  stop) stop ;;
  *) die "usage: $0 install|start|stop" ;;
esac
