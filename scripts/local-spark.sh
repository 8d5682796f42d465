#!/usr/bin/env bash
# A real Spark standalone cluster on 127.0.0.1: one master and two workers (1 core each), run
# from the pyspark package in the project's venv (Java must be installed).
#   scripts/local-spark.sh start   starts them and prints: export SPARK_MASTER_URL=spark://127.0.0.1:7077
#   scripts/local-spark.sh stop    stops what start started (by the PIDs it recorded)
# DTF_SPARK_DIR (default /tmp/dtf-spark) holds PIDs, logs and the workers' scratch space.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
DIR="${DTF_SPARK_DIR:-/tmp/dtf-spark}"
PORT="${DTF_SPARK_PORT:-7077}"
URL="spark://127.0.0.1:$PORT"
WORKERS=2

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
  export SPARK_HOME="$spark_home" SPARK_LOCAL_IP=127.0.0.1 PYSPARK_PYTHON="$PY"
  nohup "$spark_home/bin/spark-class" org.apache.spark.deploy.master.Master \
    --host 127.0.0.1 --port "$PORT" --webui-port 0 >"$DIR/logs/master.log" 2>&1 &
  echo $! >"$DIR/master.pid"
  for i in $(seq 1 $WORKERS); do
    mkdir -p "$DIR/work$i"
    nohup "$spark_home/bin/spark-class" org.apache.spark.deploy.worker.Worker \
      --host 127.0.0.1 --cores 1 --memory 4g --webui-port 0 --work-dir "$DIR/work$i" "$URL" \
      >"$DIR/logs/worker$i.log" 2>&1 &
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
  for name in worker1 worker2 master; do
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
