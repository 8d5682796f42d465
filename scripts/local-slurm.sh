#!/usr/bin/env bash
# A real one-node SLURM cluster on this machine, for trying launcher=slurm and for CI.
#   scripts/local-slurm.sh start   installs slurm-wlm and munge with apt if missing, writes a
#                                   config in $DTF_SLURM_DIR (default /tmp/dtf-slurm), starts munged,
#                                   slurmctld and slurmd from a clean state (no jobs or node state of
#                                   an earlier cluster), and prints the line to eval:
#                                   export SLURM_CONF=...
#   scripts/local-slurm.sh stop    cancels the cluster's jobs and waits until they are gone, stops what
#                                   start started (by the PIDs it recorded), then kills any job process
#                                   (slurmstepd and what runs under it, srun included) that outlived them
#   scripts/local-slurm.sh start-node N   starts node N's slurmd again after it died (a machine that
#                                   comes back), keeping the cluster's jobs and state; SLURM returns
#                                   the node to service when it registers (ReturnToService=2)
# $DTF_SLURM_PORT (default 6817) is slurmctld's port, slurmd's is the next one: a second cluster in
# another $DTF_SLURM_DIR with other ports runs beside the first (the tests use one to stop and start).
# Needs root (or sudo) for apt and for the daemons. Nothing listens beyond 127.0.0.1's host name.
# DTF_SLURM_HOSTS="dtf-h1 dtf-h2" (hosts of scripts/local-hosts.sh): a node on each, slurmctld
# on the first; the cluster's commands (sbatch, squeue, python -m dtf launcher=slurm) then run on
# one of the hosts: scripts/local-hosts.sh run dtf-h1 <command>.
set -euo pipefail

DIR="${DTF_SLURM_DIR:-/tmp/dtf-slurm}"
PORT="${DTF_SLURM_PORT:-6817}"
CONF="$DIR/slurm.conf"
export SLURM_CONF="$CONF" # for the squeue/scancel/sinfo calls below
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
read -r -a HOSTS <<<"${DTF_SLURM_HOSTS:-}"
if [ "${#HOSTS[@]}" -gt 0 ]; then
  NODES=("${HOSTS[@]}")
  address() { awk -v h="$1" '$2 == h { print $1 }' "/etc/netns/$1/hosts"; }
  on() { local h="$1"; shift; $SUDO ip netns exec "$h" "$@"; }
  ctl() { on "${HOSTS[0]}" "$@"; } # the controller is reached from the hosts only
  # `ip netns exec` mounts a sysfs of the host's own, without the cgroup tree slurmd reads: it
  # gets one (v1, as this machine's) in the mount namespace the command runs in; nothing outside
  # it changes.
  on_node() {
    local h="$1"
    shift
    # shellcheck disable=SC2016
    $SUDO ip netns exec "$h" sh -c 'mount -t tmpfs cgroup_root /sys/fs/cgroup &&
      for c in cpu cpuacct cpuset memory devices freezer pids; do
        mkdir -p "/sys/fs/cgroup/$c" && mount -t cgroup -o "$c" cgroup "/sys/fs/cgroup/$c"
      done && mkdir -p /sys/fs/cgroup/systemd &&
      mount -t cgroup -o none,name=systemd cgroup /sys/fs/cgroup/systemd && exec "$@"' sh "$@"
  }
  # slurmctld runs where its own host name is SlurmctldHost: the hosts share the machine's name
  controller_name() { hostname -s; }
else
  NODES=(localhost)
  address() { echo 127.0.0.1; }
  on() { shift; $SUDO "$@"; }
  ctl() { "$@"; }
  on_node() { on "$@"; }
  controller_name() { echo localhost; }
fi

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
SlurmctldHost=$(controller_name)($(address "${NODES[0]}"))
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
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
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
# Jobs get the nodes in the order listed (the lowest Weight first): a 2-node job runs on the first two.
$(w=0; for n in "${NODES[@]}"; do w=$((w + 1)); echo "NodeName=$n NodeAddr=$(address "$n") CPUs=$cpus Weight=$w State=UNKNOWN"; done)
PartitionName=debug Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
}

# A process that still runs: kill -0 also succeeds on a zombie, and here (a container whose
# init does not reap) the daemons' exited children stay zombies.
alive() {
  local state
  state="$(ps -o stat= -p "$1" 2>/dev/null)" || return 1
  [ -n "$state" ] && [ "${state:0:1}" != Z ]
}

running() { [ -f "$DIR/run/$1.pid" ] && alive "$(cat "$DIR/run/$1.pid")"; }
all_slurmd_running() {
  local n
  for n in "${NODES[@]}"; do running "slurmd-$n" || return 1; done
}

# Waits up to $1 seconds for command $2... to succeed.
wait_until() {
  local deadline=$((SECONDS + $1))
  shift
  until "$@"; do
    [ "$SECONDS" -lt "$deadline" ] || return 1
    sleep 0.2
  done
}

none_alive() {
  local pid
  for pid in "$@"; do alive "$pid" && return 1; done
  return 0
}

start_munge() {
  local pid
  for pid in $(pgrep -x munged || true); do alive "$pid" && return; done
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

# This cluster's slurmstepd processes (one per job step), alive or orphaned by a dead slurmd: slurmd
# passes its environment on to them, and start gives slurmd DTF_SLURM_DIR as a mark.
stepds() {
  local pid
  for pid in $(pgrep -x slurmstepd || true); do
    if alive "$pid" && $SUDO tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qxF "DTF_SLURM_DIR=$DIR"; then
      echo "$pid"
    fi
  done
}

# The PIDs given and all their descendants, one a line.
tree_of() {
  local frontier=("$@") next=() pid
  while [ "${#frontier[@]}" -gt 0 ]; do
    printf '%s\n' "${frontier[@]}"
    next=()
    for pid in "${frontier[@]}"; do mapfile -t -O "${#next[@]}" next < <(pgrep -P "$pid" || true); done
    frontier=("${next[@]}")
  done
}

no_jobs() { [ -z "$(ctl squeue -h -o %i 2>/dev/null)" ]; }

# Cancels every job of the cluster and waits until none is listed (COMPLETING included: its
# slurmstepd is still cleaning up). A stop that only ended the daemons would leave job steps
# running, and the saved controller state would bring the job back at the next start.
cancel_jobs() {
  running slurmctld || return 0
  local jobs=()
  mapfile -t jobs < <(ctl squeue -h -o %i 2>/dev/null || true)
  [ "${#jobs[@]}" -gt 0 ] || return 0
  log "cancelling job(s) ${jobs[*]}"
  # As SLURM ends a job: SIGTERM (dtf's ranks stop cleanly), SIGKILL only after KillWait (30 s).
  ctl scancel "${jobs[@]}" 2>/dev/null || true
  wait_until 10 no_jobs && return
  # Sooner than that: SIGKILL to everything under the steps (scancel refuses a job already
  # cancelled); their slurmstepd sees them gone and ends the job.
  local steps=() pids=()
  mapfile -t steps < <(stepds)
  if [ "${#steps[@]}" -gt 0 ]; then
    mapfile -t pids < <(tree_of "${steps[@]}" | grep -vxF -f <(printf '%s\n' "${steps[@]}"))
    log "killing what still runs in the job steps: ${pids[*]}"
    [ "${#pids[@]}" -eq 0 ] || $SUDO kill -KILL "${pids[@]}" 2>/dev/null || true
  fi
  wait_until 20 no_jobs || log "job(s) still listed: $(ctl squeue -h -o '%i %T' | tr '\n' ' ')"
}

# Kills job processes that outlived the daemons (what cancel_jobs could not end, or a cluster that
# died without stop), each step's whole process tree at once, and waits until they are gone.
reap_steps() {
  local steps=() pids=()
  mapfile -t steps < <(stepds)
  [ "${#steps[@]}" -gt 0 ] || return 0
  mapfile -t pids < <(tree_of "${steps[@]}")
  log "killing job processes left behind: ${pids[*]}"
  $SUDO kill -KILL "${pids[@]}" 2>/dev/null || true
  wait_until 10 none_alive "${pids[@]}" || log "still alive after SIGKILL: ${pids[*]}"
}

stop_daemon() {
  local pid
  [ -f "$DIR/run/$1.pid" ] || return 0
  pid="$(cat "$DIR/run/$1.pid")"
  alive "$pid" || return 0
  $SUDO kill "$pid" 2>/dev/null || true
  wait_until 15 none_alive "$pid" || { $SUDO kill -KILL "$pid" 2>/dev/null || true; }
}

start() {
  if running slurmctld && all_slurmd_running; then
    log "already running"
    echo "export SLURM_CONF=$CONF"
    return
  fi
  install
  mkdir -p "$DIR/run"
  stop_cluster # whatever an earlier cluster in $DIR left: a daemon, a job step
  # A clean state: no saved jobs (which would hold the node), no node state, no step sockets.
  rm -rf "$DIR/state" "$DIR/spool"
  write_conf
  start_munge
  local n
  for n in "${NODES[@]}"; do mkdir -p "$DIR/spool/$n"; done
  on "${NODES[0]}" slurmctld -f "$CONF"
  for n in "${NODES[@]}"; do on_node "$n" env DTF_SLURM_DIR="$DIR" slurmd -f "$CONF" -N "$n"; done
  for _ in $(seq 1 60); do
    if [ "$(ctl sinfo -h -N -o %t 2>/dev/null | grep -cE '^(idle|mix|alloc)')" -ge "${#NODES[@]}" ]; then
      log "cluster up: $(ctl sinfo -h -o '%P %D %c %t')"
      echo "export SLURM_CONF=$CONF"
      return
    fi
    sleep 1
  done
  log "the node(s) did not come up; see $DIR/log/"
  tail -n 20 "$DIR"/log/slurm*.log >&2 || true
  exit 1
}

start_node() {
  local n="$1"
  printf '%s\n' "${NODES[@]}" | grep -qxF "$n" || { log "no node $n in this cluster (${NODES[*]})"; exit 2; }
  running slurmctld || { log "the cluster is not running: start it first"; exit 1; }
  if running "slurmd-$n"; then
    log "slurmd on $n already runs"
    return
  fi
  on_node "$n" env DTF_SLURM_DIR="$DIR" slurmd -f "$CONF" -N "$n"
  wait_until 120 node_responds "$n" || { log "node $n did not come back; see $DIR/log/slurmd-$n.log"; exit 1; }
  log "node $n back: $(ctl sinfo -h -N -n "$n" -o '%N %t')"
}

# The node answers the controller: in service (idle, mix, alloc) or ending the jobs it had when it
# died (comp, until every node of theirs has answered); not down, nor marked with * (not responding).
node_responds() { ctl sinfo -h -N -n "$1" -o %t 2>/dev/null | grep -qE '^(idle|mix|alloc|comp)$'; }

stop_cluster() {
  cancel_jobs
  local n
  for n in "${NODES[@]}"; do stop_daemon "slurmd-$n"; done
  stop_daemon slurmd # a cluster started by an earlier version of this script
  stop_daemon slurmctld
  reap_steps
}

stop() {
  stop_cluster
  if [ -f "$DIR/run/munged.started" ]; then
    $SUDO kill "$(cat "$DIR/run/munged.started")" 2>/dev/null || true
    rm -f "$DIR/run/munged.started"
  fi
  log "stopped"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  start-node) start_node "${2:?usage: $0 start-node NODE}" ;;
  *) echo "usage: $0 start|stop|start-node NODE" >&2; exit 2 ;;
esac
