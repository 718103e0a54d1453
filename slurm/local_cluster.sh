#!/usr/bin/env bash
# A SLURM cluster on localhost from Debian's slurmctld, slurmd and munge, without systemd.
#
#   bash slurm/local_cluster.sh start  [--nodes 1|2]   # idempotent: ok when already up
#   bash slurm/local_cluster.sh status
#   bash slurm/local_cluster.sh stop
#
# Runs as root. One node: n1. Two nodes on this one host: n1 and n2, each slurmd with its
# own port, spool dir, log and pid file (`slurmd -N n1`, `slurmd -N n2`). Partition `debug`
# (default, OverSubscribe=YES). Each node advertises more CPUs than the machine has
# (SLURM_LOCAL_CPUS, default 8) so several tasks fit; RealMemory SLURM_LOCAL_MEM_MB (4000).
# Config: /etc/slurm/slurm.conf; state: /var/spool/slurm*; logs: /var/log/slurm/.
set -euo pipefail

CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
LOG_DIR=/var/log/slurm
RUN_DIR=/run/slurm
CTLD_PID=$RUN_DIR/slurmctld.pid
MUNGE_PID=/run/munge/munged.pid
CPUS=${SLURM_LOCAL_CPUS:-8}
MEM_MB=${SLURM_LOCAL_MEM_MB:-4000}
BASE_PORT=${SLURM_LOCAL_PORT:-6817}   # slurmctld; slurmd of node i: BASE_PORT + i
TIMEOUT_S=${SLURM_LOCAL_TIMEOUT_S:-60}
HOST=$(hostname -s)

log() { echo "local_cluster: $*"; }
die() { echo "local_cluster: ERROR: $*" >&2; exit 1; }

usage() { echo "usage: $0 start|stop|status [--nodes 1|2]" >&2; exit 2; }

alive() {  # alive PIDFILE -> the pid in it is a running process
  [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

nodes_in_conf() {
  [ -f "$CONF" ] || { echo 0; return; }
  grep -c '^NodeName=n[0-9]' "$CONF" || true
}

node_names() { local n=$1 i; for ((i = 1; i <= n; i++)); do echo "n$i"; done; }

last_logs() {
  local f
  for f in "$LOG_DIR"/slurmctld.log "$LOG_DIR"/slurmd.*.log /var/log/munge/munged.log; do
    [ -f "$f" ] || continue
    echo "---- last lines of $f" >&2
    tail -n 15 "$f" >&2
  done
}

ensure_root() { [ "$(id -u)" -eq 0 ] || die "run as root (the daemons need it)"; }

ensure_binaries() {
  local b
  for b in munged slurmctld slurmd sinfo srun; do
    command -v "$b" >/dev/null 2>&1 || die "$b not found: run 'bash slurm/install.sh' first"
  done
}

start_munge() {
  install -d -o munge -g munge -m 0700 /etc/munge
  install -d -o munge -g munge -m 0755 /run/munge
  install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge
  if [ ! -s /etc/munge/munge.key ]; then
    log "creating a munge key"
    if command -v mungekey >/dev/null 2>&1; then
      mungekey --create --keyfile=/etc/munge/munge.key --force
    else
      dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
    fi
  fi
  chown munge:munge /etc/munge/munge.key
  chmod 0400 /etc/munge/munge.key
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    return 0  # a munged is already serving this key
  fi
  log "starting munged"
  runuser -u munge -- munged --pid-file="$MUNGE_PID" || { last_logs; die "munged did not start"; }
  local i
  for ((i = 0; i < 20; i++)); do
    munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return 0
    sleep 0.25
  done
  last_logs
  die "munge does not answer (munge -n | unmunge)"
}

ensure_hosts() {  # the node names must resolve
  local n
  for n in "$@"; do
    getent hosts "$n" >/dev/null 2>&1 || { echo "127.0.0.1 $n" >>/etc/hosts; log "added $n to /etc/hosts"; }
  done
}

write_conf() {
  local nodes=$1 i names
  names=$(node_names "$nodes" | paste -sd, -)
  install -d -m 0755 "$CONF_DIR" "$LOG_DIR" "$RUN_DIR" /var/spool/slurmctld /var/spool/slurmd
  local tmp
  tmp=$(mktemp)
  {
    echo "# Written by slurm/local_cluster.sh ($nodes node(s) on $HOST); rewritten on every start."
    cat <<CONF
ClusterName=local
SlurmctldHost=$HOST
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$BASE_PORT
AuthType=auth/munge
# A requeued job waits cred_expire seconds before it may start again (default 120), then for
# the next scheduling pass (every 60 s by default): a preempted run on this one-box cluster
# resumes after ~10 s instead.
AuthInfo=cred_expire=10
CryptoType=crypto/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd/%n
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$RUN_DIR/slurmd.%n.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=10
MinJobAge=600
Waittime=0
CONF
    for ((i = 1; i <= nodes; i++)); do
      echo "NodeName=n$i NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((BASE_PORT + i)) CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN"
    done
    echo "PartitionName=debug Nodes=$names Default=YES OverSubscribe=YES MaxTime=INFINITE State=UP"
  } >"$tmp"
  install -m 0644 "$tmp" "$CONF"
  rm -f "$tmp"
  for ((i = 1; i <= nodes; i++)); do install -d -m 0755 "/var/spool/slurmd/n$i"; done
}

running_nodes() {  # nodes whose slurmd is alive
  local n c=0
  for n in $(node_names 8); do alive "$RUN_DIR/slurmd.$n.pid" && c=$((c + 1)); done
  echo $c
}

is_up() {  # is_up N -> slurmctld answers and N nodes are idle/mixed/allocated
  local nodes=$1 ok
  alive "$CTLD_PID" || return 1
  scontrol ping >/dev/null 2>&1 || return 1
  ok=$(sinfo -h -N -p debug -o '%N %t' 2>/dev/null | awk '$2 ~ /^(idle|mix|alloc)/' | wc -l)
  [ "$ok" -eq "$nodes" ]
}

wait_idle() {
  local nodes=$1 t0=$SECONDS
  while ((SECONDS - t0 < TIMEOUT_S)); do
    if is_up "$nodes"; then return 0; fi
    sleep 1
  done
  echo "local_cluster: ERROR: after ${TIMEOUT_S}s the nodes are not idle; sinfo says:" >&2
  sinfo -N -l >&2 2>&1 || true
  last_logs
  exit 1
}

do_start() {
  local nodes=$1
  ensure_root
  ensure_binaries
  if [ "$(nodes_in_conf)" -eq "$nodes" ] && [ "$(running_nodes)" -eq "$nodes" ] && is_up "$nodes"; then
    log "already up ($nodes node(s)):"
    sinfo
    return 0
  fi
  if alive "$CTLD_PID" || [ "$(running_nodes)" -gt 0 ]; then
    log "running with another layout or unhealthy: restarting"
    do_stop
  fi
  start_munge
  # shellcheck disable=SC2046
  ensure_hosts "$HOST" $(node_names "$nodes")
  write_conf "$nodes"
  log "starting slurmctld"
  # -c: a clean start (no state carried over from another layout); -i: ignore stale state errors
  slurmctld -c -i || { last_logs; die "slurmctld did not start"; }
  local t0=$SECONDS
  until scontrol ping >/dev/null 2>&1; do
    ((SECONDS - t0 < TIMEOUT_S)) || { last_logs; die "slurmctld does not answer scontrol ping"; }
    sleep 0.5
  done
  local n
  for n in $(node_names "$nodes"); do
    log "starting slurmd -N $n"
    slurmd -N "$n" || { last_logs; die "slurmd -N $n did not start"; }
  done
  wait_idle "$nodes"
  log "up in $((SECONDS - t0))s:"
  sinfo
}

stop_pidfile() {  # stop_pidfile NAME PIDFILE: TERM, wait, then KILL the process it names
  local name=$1 f=$2 pid i
  [ -s "$f" ] || return 0
  pid=$(cat "$f")
  if kill -0 "$pid" 2>/dev/null; then
    log "stopping $name (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 40; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$f"
}

do_stop() {
  ensure_root
  local f
  for f in "$RUN_DIR"/slurmd.*.pid; do
    [ -e "$f" ] || continue
    stop_pidfile "slurmd $(basename "$f" .pid | sed 's/^slurmd\.//')" "$f"
  done
  stop_pidfile slurmctld "$CTLD_PID"
  # munged stays up: it is harmless and other tools may use it.
  log "stopped"
}

do_status() {
  local nodes
  nodes=$(nodes_in_conf)
  if [ "$nodes" -gt 0 ] && is_up "$nodes"; then
    log "up ($nodes node(s))"
    sinfo
    return 0
  fi
  log "not up (slurmctld $(alive "$CTLD_PID" && echo running || echo stopped), $(running_nodes) slurmd running, $nodes node(s) configured)"
  return 1
}

cmd=${1:-}
[ -n "$cmd" ] || usage
shift
NODES=1
while [ $# -gt 0 ]; do
  case $1 in
    --nodes) NODES=${2:-}; shift 2 ;;
    --nodes=*) NODES=${1#--nodes=}; shift ;;
    *) usage ;;
  esac
done
case $NODES in 1 | 2) ;; *) die "--nodes must be 1 or 2 (got '$NODES')" ;; esac

case $cmd in
  start) do_start "$NODES" ;;
  stop) do_stop ;;
  status) do_status ;;
  *) usage ;;
esac
