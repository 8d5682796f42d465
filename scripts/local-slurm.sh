#!/usr/bin/env bash
# A real one-node SLURM cluster on this machine, for trying launcher=slurm and for CI.
#   scripts/local-slurm.sh start   installs slurm-wlm and munge with apt if missing, writes a
#                                   config in $DTF_SLURM_DIR (default /tmp/dtf-slurm), starts munged,
#                                   slurmctld and slurmd, and prints the line to eval:
#                                   export SLURM_CONF=...
#   scripts/local-slurm.sh stop    stops what start started (by the PIDs it recorded)
# Needs root (or sudo) for apt and for the daemons. Nothing listens beyond 127.0.0.1's host name.
set -euo pipefail

DIR="${DTF_SLURM_DIR:-/tmp/dtf-slurm}"
CONF="$DIR/slurm.conf"
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"

log() { echo "local-slurm: $*" >&2; }

install() {
  if command -v slurmctld >/dev/null && command -v munged >/dev/null; then return; fi
  log "installing slurm-wlm and munge with apt (once)"
  $SUDO apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends slurm-wlm munge >&2
}

write_conf() {
  mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log" "$DIR/run"
  local cpus
  cpus="$(nproc)"
  cat >"$CONF" <<CONF
ClusterName=dtf-local
SlurmctldHost=localhost
AuthType=auth/munge
CryptoType=crypto/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldPort=6817
SlurmdPort=6818
SchedulerType=sched/backfill
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
# Requeued jobs (preemption, time limit) run again without an operator.
JobRequeue=1
KillWait=30
MinJobAge=300
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
}

start_munge() {
  if pgrep -x munged >/dev/null; then return; fi
  if [ ! -s /etc/munge/munge.key ]; then
    $SUDO mkdir -p /etc/munge
    if command -v mungekey >/dev/null; then $SUDO mungekey -c -f -k /etc/munge/munge.key; else $SUDO create-munge-key -f; fi
  fi
  $SUDO mkdir -p /run/munge /var/log/munge /var/lib/munge
  if id munge >/dev/null 2>&1; then
    $SUDO chown munge:munge /etc/munge/munge.key /run/munge /var/log/munge /var/lib/munge
    $SUDO chmod 400 /etc/munge/munge.key
  fi
  # --force: run even where the key or directories are not owned as munged would like (root, containers)
  $SUDO munged --force --pid-file="$DIR/run/munged.pid"
  for _ in $(seq 1 50); do [ -s "$DIR/run/munged.pid" ] && break; sleep 0.1; done
  cp "$DIR/run/munged.pid" "$DIR/run/munged.started"
}

running() { [ -f "$DIR/run/$1.pid" ] && kill -0 "$(cat "$DIR/run/$1.pid")" 2>/dev/null; }

start() {
  if running slurmctld && running slurmd; then
    log "already running"
    echo "export SLURM_CONF=$CONF"
    return
  fi
  install
  write_conf
  start_munge
  running slurmctld || $SUDO slurmctld -f "$CONF"
  running slurmd || $SUDO slurmd -f "$CONF" -N localhost
  for _ in $(seq 1 60); do
    if SLURM_CONF="$CONF" sinfo -h -o %t 2>/dev/null | grep -qE '^(idle|mix|alloc)'; then
      log "cluster up: $(SLURM_CONF="$CONF" sinfo -h -o '%P %D %c %t')"
      echo "export SLURM_CONF=$CONF"
      return
    fi
    sleep 1
  done
  log "the node did not come up; see $DIR/log/"
  tail -n 20 "$DIR/log/slurmctld.log" "$DIR/log/slurmd.log" >&2 || true
  exit 1
}

stop() {
  for name in slurmd slurmctld; do
    if [ -f "$DIR/run/$name.pid" ]; then
      $SUDO kill "$(cat "$DIR/run/$name.pid")" 2>/dev/null || true
    fi
  done
  if [ -f "$DIR/run/munged.started" ]; then
    $SUDO kill "$(cat "$DIR/run/munged.started")" 2>/dev/null || true
    rm -f "$DIR/run/munged.started"
  fi
  log "stopped"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
