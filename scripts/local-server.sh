# shellcheck shell=bash
# What scripts/local-mlflow.sh and scripts/local-s3.sh share, sourced by each once it has set DIR
# (the server's folder), PY (the venv's python), log() and healthy URL: a server started in a
# process group of its own, its PID in $DIR/server.pid and its output in $DIR/server.log.

running() { [ -f "$DIR/server.pid" ] && kill -0 "$(cat "$DIR/server.pid")" 2>/dev/null; }

free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# wait_up URL PAUSE: returns once healthy URL answers (120 tries, PAUSE seconds apart); if the
# server dies or never answers, shows its log's tail, stops it and exits 1.
wait_up() {
  for _ in $(seq 1 120); do
    healthy "$1" && return 0
    running || break
    sleep "$2"
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
