#!/usr/bin/env bash
# A real Spark standalone cluster on 127.0.0.1: one master and two workers (1 core each), run
# from the pyspark package in the project's venv (Java must be installed).
#   scripts/local-spark.sh start   starts them and prints: export SPARK_MASTER_URL=spark://127.0.0.1:7077
#   scripts/local-spark.sh stop    stops what start started (by the PIDs it recorded)
# DTF_SPARK_DIR (default /tmp/dtf-spark) holds PIDs, logs and the workers' scratch space.
# DTF_SPARK_HOSTS="dtf-h1 dtf-h2" (hosts of scripts/local-hosts.sh): the master on the first host,
# one worker on each, every one bound to its host's address; the URL is then spark://<first>:PORT,
# and the driver runs on one of the hosts (scripts/local-hosts.sh run dtf-h1 python -m dtf ...).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
DIR="${DTF_SPARK_DIR:-/tmp/dtf-spark}"
PORT="${DTF_SPARK_PORT:-7077}"
read -r -a HOSTS <<<"${DTF_SPARK_HOSTS:-}"
if [ "${#HOSTS[@]}" -gt 0 ]; then
  WORKERS=${#HOSTS[@]}
  # each host's address, as the hosts resolve it (scripts/local-hosts.sh writes their hosts file)
  address() { awk -v h="$1" '$2 == h { print $1 }' "/etc/netns/$1/hosts"; }
  MASTER_HOST="$(address "${HOSTS[0]}")"
  on() { local h="$1"; shift; exec ip netns exec "$h" "$@"; }
else
  WORKERS=2
  MASTER_HOST=127.0.0.1
  address() { echo 127.0.0.1; }
  on() { shift; exec "$@"; }
fi
URL="spark://$MASTER_HOST:$PORT"

log() { echo "local-spark: $*" >&2; }
running() { [ -f "$DIR/$1.pid" ] && kill -0 "$(cat "$DIR/$1.pid")" 2>/dev/null; }

start() {
  if running master; then
    log "already running"
    echo "export SPARK_MASTER_URL=$URL"
    return
  fi
  command -v java >/dev/null || { log "java is not installed (Spark needs a JRE 8/11/17)"; exit 1; }
  local spark_home
  spark_home="$("$PY" -c 'import os, pyspark; print(os.path.dirname(pyspark.__file__))')"
  mkdir -p "$DIR/logs"
  export SPARK_HOME="$spark_home" PYSPARK_PYTHON="$PY"
  # (a subshell that execs: its PID is the daemon's)
  (trap '' HUP; export SPARK_LOCAL_IP="$MASTER_HOST"; on "${HOSTS[0]:-}" "$spark_home/bin/spark-class" \
    org.apache.spark.deploy.master.Master --host "$MASTER_HOST" --port "$PORT" --webui-port 0) \
    >"$DIR/logs/master.log" 2>&1 &
  echo $! >"$DIR/master.pid"
  for i in $(seq 1 $WORKERS); do
    local host="${HOSTS[$((i - 1))]:-}" addr
    addr="$(address "$host")"
    mkdir -p "$DIR/work$i"
    (trap '' HUP; export SPARK_LOCAL_IP="$addr"; on "$host" "$spark_home/bin/spark-class" \
      org.apache.spark.deploy.worker.Worker --host "$addr" --cores 1 --memory 4g --webui-port 0 \
      --work-dir "$DIR/work$i" "$URL") >"$DIR/logs/worker$i.log" 2>&1 &
    echo $! >"$DIR/worker$i.pid"
  done
  for _ in $(seq 1 90); do
    if [ "$(grep -c 'Registering worker' "$DIR/logs/master.log" 2>/dev/null || true)" -ge $WORKERS ]; then
      log "master $URL with $WORKERS workers of 1 core"
      echo "export SPARK_MASTER_URL=$URL"
      return
    fi
    sleep 1
  done
  log "the cluster did not come up; see $DIR/logs/"
  tail -n 20 "$DIR"/logs/*.log >&2 || true
  stop
  exit 1
}

stop() {
  for name in $(cd "$DIR" 2>/dev/null && ls worker*.pid 2>/dev/null | sed 's/.pid$//') master; do
    if running "$name"; then kill "$(cat "$DIR/$name.pid")" 2>/dev/null || true; fi
    rm -f "$DIR/$name.pid"
  done
  log "stopped"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
