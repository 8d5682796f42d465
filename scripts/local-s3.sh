#!/usr/bin/env bash
# An S3-compatible server on 127.0.0.1: moto's server mode (moto[server]), as s3fs's own test suite
# runs it. Anything that speaks S3 over HTTP (s3fs, boto3, pyarrow's S3FileSystem) talks to it as to
# AWS; it keeps the buckets in memory, checks no signatures, and logs every request it serves.
#   scripts/local-s3.sh start   starts it on a free port and prints the exports that point S3 clients at it:
#                               AWS_ENDPOINT_URL=http://127.0.0.1:PORT, and a key and secret it accepts
#   scripts/local-s3.sh stop    stops what start started (by the process group it recorded)
# DTF_S3_DIR (default /tmp/dtf-s3) holds the PID, the endpoint and the request log;
# DTF_S3_PORT picks the port (default: a free one). Moto's own settings pass through the
# environment: INITIAL_NO_AUTH_ACTION_COUNT=0 makes it check every request's signature, as AWS does.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
DIR="${DTF_S3_DIR:-/tmp/dtf-s3}"

log() { echo "local-s3: $*" >&2; }
running() { [ -f "$DIR/server.pid" ] && kill -0 "$(cat "$DIR/server.pid")" 2>/dev/null; }
# up once it answers HTTP at all (one that checks signatures answers an unsigned request with an error)
healthy() {
  "$PY" - "$1" 2>/dev/null <<'PYEOF'
import sys, urllib.error, urllib.request
try:
    urllib.request.urlopen(sys.argv[1] + "/", timeout=2)
except urllib.error.HTTPError:
    pass
PYEOF
}
exports() {
  # moto takes any key: these name the server's, so that no client reaches for real credentials
  echo "export AWS_ENDPOINT_URL=$1"
  echo "export AWS_ACCESS_KEY_ID=dtf-local"
  echo "export AWS_SECRET_ACCESS_KEY=dtf-local"
  echo "export AWS_DEFAULT_REGION=us-east-1"
}

start() {
  if running; then
    log "already running"
    exports "$(cat "$DIR/endpoint")"
    return
  fi
  "$PY" -c 'import moto.server' 2>/dev/null || { log "moto's server is not installed: pip install 'moto[server]'"; exit 1; }
  local port="${DTF_S3_PORT:-}" endpoint
  if [ -z "$port" ]; then
    port="$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  fi
  endpoint="http://127.0.0.1:$port"
  mkdir -p "$DIR"
  # setsid: the server is a process group of its own, which stop ends as a whole
  setsid "$PY" -m moto.server -H 127.0.0.1 -p "$port" >"$DIR/server.log" 2>&1 </dev/null &
  echo $! >"$DIR/server.pid"
  echo "$endpoint" >"$DIR/endpoint"
  for _ in $(seq 1 120); do
    if healthy "$endpoint"; then
      log "S3 endpoint $endpoint (requests logged in $DIR/server.log)"
      exports "$endpoint"
      return
    fi
    running || break
    sleep 0.25
  done
  log "the server did not come up; see $DIR/server.log"
  tail -n 20 "$DIR/server.log" >&2 || true
  stop
  exit 1
}

stop() {
  if running; then
    local pid
    pid="$(cat "$DIR/server.pid")"
    kill -- "-$pid" 2>/dev/null || kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
  fi
  rm -f "$DIR/server.pid"
  log "stopped"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
