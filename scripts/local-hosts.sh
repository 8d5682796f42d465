#!/usr/bin/env bash
# Several "hosts" on this machine: Linux network namespaces dtf-h1..dtf-hN, each with its own
# network stack and address from 198.18.0.0/15 (reserved for network benchmarking, RFC 2544, so
# never a real network's), joined by a bridge. Nothing is routed out of them: the bridge has no
# address, no route leads anywhere else, and each namespace reaches only the others (and itself).
# The filesystem is shared by all of them, as NFS or Lustre is on a cluster.
#   scripts/local-hosts.sh start N   makes N hosts (default 2) and prints: export DTF_HOSTS="dtf-h1 dtf-h2"
#   scripts/local-hosts.sh stop      removes exactly what start made
#   scripts/local-hosts.sh run H CMD...   runs CMD on host H (ip netns exec: its network, its /etc/hosts)
#   scripts/local-hosts.sh shape RATE [DELAY]   shapes every host's link, both ways, with tc: RATE
#       (tc's units: 10mbit, 1gbit) by tbf, DELAY (5ms) by netem underneath; `shape off` unshapes.
#       What runs inside one host (its loopback) is never shaped: a host's ranks talk at memory speed.
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

# The qdiscs of one host's link: eth0 inside it (what it sends), its veth on the bridge (what it receives).
shape_host() {
  local h="$1" rate="$2" delay="$3" burst="$4"
  local devices=("ip netns exec $h tc qdisc %s dev eth0" "tc qdisc %s dev ${h}v")
  for dev in "${devices[@]}"; do
    # shellcheck disable=SC2086,SC2059
    $(printf "$dev" del) root 2>/dev/null || true
    [ "$rate" = off ] && continue
    if [ -n "$delay" ]; then
      # shellcheck disable=SC2086,SC2059
      $(printf "$dev" add) root handle 1: netem delay "$delay" limit 100000 2>/dev/null || {
        log "tc's netem is not in this kernel ($(uname -r)): DELAY cannot be shaped here, only RATE"
        return 1
      }
      # shellcheck disable=SC2086,SC2059
      $(printf "$dev" add) parent 1: handle 2: tbf rate "$rate" burst "$burst" latency 1s
    else
      # shellcheck disable=SC2086,SC2059
      $(printf "$dev" add) root tbf rate "$rate" burst "$burst" latency 1s
    fi
  done
}

shape() {
  local rate="${1:?usage: $0 shape RATE [DELAY] | shape off}" delay="${2:-}"
  [ -f "$DIR/hosts" ] || { log "no hosts: start them first"; exit 1; }
  command -v tc >/dev/null || { log "needs tc (iproute2)"; exit 1; }
  local burst=0
  if [ "$rate" != off ]; then
    # tbf's burst: 5 ms at the rate (at least 16 KB), which the kernel's timer needs at high rates
    burst=$(python3 -c "import sys,re;m=re.fullmatch(r'([0-9.]+)([kmg]?)bit',sys.argv[1]);assert m;b=float(m[1])*{'':1,'k':1e3,'m':1e6,'g':1e9}[m[2]]/8*0.005;print(max(16384,int(b)))" "$rate" 2>/dev/null) \
      || { log "RATE is tc's, e.g. 10mbit, 100mbit, 1gbit (got $rate)"; exit 2; }
  fi
  while read -r h; do
    shape_host "$h" "$rate" "$delay" "$burst" || { [ "$rate" = off ] || shape off; exit 1; }
  done <"$DIR/hosts"
  if [ "$rate" = off ]; then log "links unshaped"; else log "links shaped: $rate${delay:+, $delay delay}, both ways"; fi
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
  shape) shift; shape "$@" ;;
  *) echo "usage: $0 start [N] | stop | run HOST CMD... | shape RATE [DELAY] | shape off" >&2; exit 2 ;;
esac
