#!/usr/bin/env bash
# A real MLflow tracking server on 127.0.0.1: a SQLite backend store and a local artifact store
# (served by the server itself), run from the mlflow package in the project's venv.
#   scripts/local-mlflow.sh start   starts it on a free port and prints: export MLFLOW_TRACKING_URI=http://127.0.0.1:PORT
#   scripts/local-mlflow.sh stop    stops what start started (by the process group it recorded)
# DTF_MLFLOW_DIR (default /tmp/dtf-mlflow) holds the database, the artifacts, the PID and the log;
# DTF_MLFLOW_PORT picks the port (default: a free one).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
DIR="${DTF_MLFLOW_DIR:-/tmp/dtf-mlflow}"

log() { echo "local-mlflow: $*" >&2; }
healthy() { "$PY" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + "/health", timeout=2)' "$1" 2>/dev/null; }
# shellcheck source=scripts/local-server.sh
source "$ROOT/scripts/local-server.sh"

start() {
  if running; then
    log "already running"
    echo "export MLFLOW_TRACKING_URI=$(cat "$DIR/uri")"
    return
  fi
  "$PY" -c 'import mlflow' 2>/dev/null || { log "mlflow is not installed: pip install 'dtf[mlflow]'"; exit 1; }
  local port="${DTF_MLFLOW_PORT:-}" uri
  [ -n "$port" ] || port="$(free_port)"
  uri="http://127.0.0.1:$port"
  mkdir -p "$DIR/artifacts"
  # setsid: the server and its workers are one process group, which stop ends as a whole
  # No job runner (MLflow's GenAI jobs, a dozen processes and tens of seconds to start): tracking only.
  MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false setsid "$PY" -m mlflow server --host 127.0.0.1 --port "$port" --workers 1 \
    --backend-store-uri "sqlite:///$DIR/mlflow.db" --artifacts-destination "$DIR/artifacts" \
    >"$DIR/server.log" 2>&1 </dev/null &
  echo $! >"$DIR/server.pid"
  echo "$uri" >"$DIR/uri"
  wait_up "$uri" 0.5
  log "tracking server $uri (store $DIR)"
  echo "export MLFLOW_TRACKING_URI=$uri"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
