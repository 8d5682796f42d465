#!/usr/bin/env bash
# Preemption on SLURM, step by step, on this machine's one-node SLURM cluster (started here if
# SLURM_CONF is not set, and stopped again): an uninterrupted job, then the same job signalled
# mid-run as SLURM signals a job it preempts; it checkpoints, is requeued, resumes, and must end
# with the same parameters. Run from a checkout: bash recipes/slurm_preemption.sh
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
WORK="${1:-$(mktemp -d)}"
say() { echo "== $*"; }
started=""
if [ -z "${SLURM_CONF:-}" ]; then
  say "starting the local SLURM cluster (scripts/local-slurm.sh start)"
  eval "$(bash "$ROOT/scripts/local-slurm.sh" start)"
  started=1
fi
cleanup() { if [ -n "$started" ]; then say "stopping the cluster"; bash "$ROOT/scripts/local-slurm.sh" stop; fi; }
trap cleanup EXIT

say "1. the uninterrupted job: python -m dtf +recipe=slurm_preemption"
"$PY" -m dtf +recipe=slurm_preemption trainer.progress=off "hydra.run.dir=$WORK/straight" | grep -E "^dtf: (submitted|final)"

say "2. the same job, to be preempted"
"$PY" -m dtf +recipe=slurm_preemption "hydra.run.dir=$WORK/preempted" >"$WORK/preempted.log" 2>&1 &
driver=$!
until grep -q "epoch 2 step" "$WORK/preempted.log" 2>/dev/null; do
  kill -0 "$driver" 2>/dev/null || { cat "$WORK/preempted.log"; exit 1; }
  sleep 0.5
done
job="$(grep -oE 'submitted SLURM job [0-9]+' "$WORK/preempted.log" | grep -oE '[0-9]+$')"
say "3. job $job is training (epoch 2): scancel --signal=USR1 $job"
scancel --signal=USR1 "$job"
until grep -q "requeued SLURM job" "$WORK/preempted.log"; do sleep 0.5; done
grep -E "^dtf: stopped" "$WORK/preempted.log"
# SLURM holds a requeued job for about 2 minutes before it may start again; skip the wait (not
# within the second of the requeue: slurmd refuses a credential from the second the old one was revoked).
sleep 1.1
until [ "$(squeue -h -j "$job" -o %T)" = PENDING ]; do sleep 0.2; done
say "4. the job is requeued (PENDING); letting it start now instead of after SLURM's hold"
scontrol update "JobId=$job" StartTime=now
wait "$driver"
grep -E "^dtf: (resumed|final)" "$WORK/preempted.log"

say "5. the final parameters"
"$PY" - "$WORK" <<'PY'
import json, sys
work = sys.argv[1]
straight = json.load(open(f"{work}/straight/summary.json"))
preempted = json.load(open(f"{work}/preempted/summary.json"))
same = straight["params_sha256"] == preempted["params_sha256"]
print(f"uninterrupted: {straight['params_sha256'][:16]}  test loss {straight['final_test_loss']:.6g}")
print(f"preempted:     {preempted['params_sha256'][:16]}  test loss {preempted['final_test_loss']:.6g}  "
      f"(resumed from step {preempted['resumed_from_step']}, SLURM restarts {preempted['slurm_restarts']})")
print("the same parameters, bit for bit" if same else "DIFFERENT parameters")
sys.exit(0 if same else 1)
PY
