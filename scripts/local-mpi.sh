#!/usr/bin/env bash
# Open MPI's mpirun on this machine, for running Horovod-style scripts on dtf.horovod and for CI.
#   scripts/local-mpi.sh install   installs openmpi-bin with apt if mpirun is missing (once), and
#                                   prints the line to eval: export DTF_MPIRUN="mpirun <flags>"
# The flags are what a one-machine run needs: --oversubscribe (more ranks than cores) and, as
# root, --allow-run-as-root (Open MPI refuses root otherwise). Nothing is started: mpirun starts
# its ranks itself and they end with it. Needs root (or sudo) for apt.
set -euo pipefail

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"

log() { echo "local-mpi: $*" >&2; }

install() {
  if ! command -v mpirun >/dev/null; then
    log "installing openmpi-bin with apt (once)"
    $SUDO apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends openmpi-bin >&2
  fi
  local flags="--oversubscribe"
  [ "$(id -u)" -ne 0 ] || flags="$flags --allow-run-as-root"
  echo "export DTF_MPIRUN=\"$(command -v mpirun) $flags\""
}

case "${1:-}" in
install) install ;;
*)
  echo "usage: $0 install" >&2
  exit 2
  ;;
esac
