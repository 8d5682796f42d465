#!/usr/bin/env bash
# Several "hosts" on this machine: Linux network namespaces dtf-h1..dtf-hN, each with its own
# network stack and address from 198.18.0.0/15 (reserved for network benchmarking, RFC 2544, so
# never a real network's), joined by a bridge. Nothing is routed out of them: the bridge has no
# address, no route leads anywhere else, and each namespace reaches only the others (and itself).
# The filesystem is shared by all of them, as NFS or Lustre is on a cluster.
#   scripts/local-hosts.sh start N   makes N hosts (default 2) and prints: export DTF_HOSTS="dtf-h1 dtf-h2"
#   scripts/local-hosts.sh stop      removes exactly what start made
#   scripts/local-hosts.sh run H CMD...   runs CMD on host H (ip netns exec: its network, its /etc/hosts)
# Each host resolves every host's name, and the machine's name to its own address, through
# /etc/netns/<host>/hosts, which `ip netns exec` puts in place of /etc/hosts. Needs root.
# DTF_HOSTS_DIR (default /tmp/dtf-hosts) records what was made.
set -euo pipefail

DIR="${DTF_HOSTS_DIR:-/tmp/dtf-hosts}"
BRIDGE=dtf-br0
NET=198.18.0  # hosts are $NET.1 .. $NET.N, /24

log() { echo "local-hosts: $*" >&2; }

start() {
  local n="${1:-2}"
  if [ -f "$DIR/hosts" ]; then
    log "already running: $(tr '\n' ' ' <"$DIR/hosts")"
    echo "export DTF_HOSTS=\"$(tr '\n' ' ' <"$DIR/hosts" | sed 's/ $//')\""
    return
  fi
  [ "$(id -u)" = 0 ] || { log "needs root (network namespaces)"; exit 1; }
  command -v ip >/dev/null || { log "needs iproute2 (ip)"; exit 1; }
  mkdir -p "$DIR"
  : >"$DIR/made"
  if [ ! -d /etc/netns ]; then mkdir /etc/netns && echo "dir /etc/netns" >>"$DIR/made"; fi
  ip link add "$BRIDGE" type bridge
  echo "link $BRIDGE" >>"$DIR/made"
  ip link set "$BRIDGE" up
  local names=()
  for i in $(seq 1 "$n"); do names+=("dtf-h$i"); done
  local hosts_file="$DIR/etc-hosts"
  {
    echo "127.0.0.1 localhost"
    for i in $(seq 1 "$n"); do echo "$NET.$i dtf-h$i"; done
  } >"$hosts_file"
  for i in $(seq 1 "$n"); do
    local h="dtf-h$i"
    ip netns add "$h"
    echo "netns $h" >>"$DIR/made"
    # veth pair: "eth0" inside the host, dtf-h<i>v on the bridge
    ip link add "${h}v" type veth peer name eth0 netns "$h"
    ip link set "${h}v" master "$BRIDGE" up
    ip -n "$h" addr add "$NET.$i/24" dev eth0
    ip -n "$h" link set eth0 up
    ip -n "$h" link set lo up
    mkdir -p "/etc/netns/$h"
    echo "dir /etc/netns/$h" >>"$DIR/made"
    # `ip netns exec` keeps the machine's host name: on each host it names that host, as on a real
    # one (Java, Spark and gloo look their own name up)
    { cat "$hosts_file"; echo "$NET.$i $(hostname)"; } >"/etc/netns/$h/hosts"
  done
  printf '%s\n' "${names[@]}" >"$DIR/hosts"
  log "hosts ${names[*]} on $NET.1-$NET.$n (bridge $BRIDGE); run a command on one: $0 run dtf-h1 <command>"
  echo "export DTF_HOSTS=\"${names[*]}\""
}

stop() {
  [ -f "$DIR/made" ] || { log "nothing to stop"; return; }
  tac "$DIR/made" | while read -r kind name; do
    case "$kind" in
      netns)
        # what still runs in the host ends with it
        for pid in $(ip netns pids "$name" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
        ip netns del "$name" 2>/dev/null || true
        ;;
      link) ip link del "$name" 2>/dev/null || true ;;
      dir) rm -rf "$name" ;;
    esac
  done
  rm -f "$DIR/made" "$DIR/hosts" "$DIR/etc-hosts"
  log "stopped"
}

run() {
  local h="$1"
  shift
  exec ip netns exec "$h" "$@"
}

case "${1:-}" in
  start) start "${2:-2}" ;;
  stop) stop ;;
  run) shift; run "$@" ;;
  *) echo "usage: $0 start [N] | stop | run HOST CMD..." >&2; exit 2 ;;
esac
