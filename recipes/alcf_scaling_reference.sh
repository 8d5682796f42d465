#!/usr/bin/env bash
# The hand-written DDP loop of benchmarks/raw_ddp.py (what a user would otherwise write: the
# default job's model, data, batch and LR scaling) under torchrun on 1, 2, 4 and 8 ranks, 10
# epochs each: samples/s and efficiency against linear scaling, to read beside the report of
#   python -m dtf -m +recipe=alcf_scaling
# Run from a checkout: bash recipes/alcf_scaling_reference.sh [sizes...]
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
SIZES=("${@:-1 2 4 8}")
read -r -a SIZES <<<"${SIZES[*]}"
for n in "${SIZES[@]}"; do
  "$PY" -m torch.distributed.run --standalone --nproc-per-node "$n" "$ROOT/benchmarks/raw_ddp.py" \
    --epochs 10 --out "$TMP/raw$n.json" >"$TMP/raw$n.log" 2>&1 || { cat "$TMP/raw$n.log" >&2; exit 1; }
done
"$PY" - "$TMP" "${SIZES[@]}" <<'PY'
import json, sys
tmp, sizes = sys.argv[1], [int(n) for n in sys.argv[2:]]
print("| world size | samples/s | efficiency | final train loss |")
print("|---|---|---|---|")
base = None
for n in sizes:
    r = json.load(open(f"{tmp}/raw{n}.json"))
    speed = r["num_steps"] * 32 * n / r["train_seconds"]  # per-rank batch 32, n ranks
    base = base or speed / n
    print(f"| {n} | {speed:,.0f} | {speed / (base * n):.0%} | {r['final_train_loss']:.4g} |")
PY
