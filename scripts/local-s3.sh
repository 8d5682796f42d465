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
# shellcheck source=scripts/local-server.sh
source "$ROOT/scripts/local-server.sh"

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
  [ -n "$port" ] || port="$(free_port)"
  endpoint="http://127.0.0.1:$port"
  mkdir -p "$DIR"
  # setsid: the server is a process group of its own, which stop ends as a whole
  setsid "$PY" -m moto.server -H 127.0.0.1 -p "$port" >"$DIR/server.log" 2>&1 </dev/null &
  echo $! >"$DIR/server.pid"
  echo "$endpoint" >"$DIR/endpoint"
  wait_up "$endpoint" 0.25
  log "S3 endpoint $endpoint (requests logged in $DIR/server.log)"
  exports "$endpoint"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
