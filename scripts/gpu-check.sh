#!/usr/bin/env bash
# The checks that need a GPU, prepared for the day one is at hand: one command, under 5 minutes on
# one GPU (docs/development.md, "A GPU check"):
#   bash scripts/gpu-check.sh        (PYTHON=/path/to/python: the interpreter; default the checkout's .venv)
# Each section runs under its own time limit (timeout: SIGTERM, a run stops at a checkpoint, SIGKILL
# 10 s later), all of them within GPU_CHECK_SECONDS (default 285 s, so that the whole stays under 5
# minutes): a section with less than 20 s left is skipped, and counts as failed.
#   environment       15 s  torch, CUDA, the GPUs, bf16, Triton
#   equivalence       70 s  ddp, zero stages 1-3 and fsdp with trainer.device=cuda on one rank: ddp against
#                           the tests' plain loop (tests/dist/test_equivalence.py), the others against ddp
#   precision/compile 90 s  bf16-mixed, trainer.compile=true, and both on fsdp, against fp32 (deep_mlp)
#   memory            45 s  each rank's torch.cuda.max_memory_allocated against the ZeRO formula: ddp and
#                           fsdp on one rank; with 2 GPUs (80 s) also zero stages 1-3, on 2 ranks
#   overhead          70 s  benchmarks/overhead.py --repeats 3 --epochs 3 --nproc 1 --device cuda: dtf's
#                           step against the hand-written loop and the floor on the GPU, absolute and as ratios
#   two-rank tests    60 s  only with 2 GPUs or more: pytest tests/dist/test_equivalence.py (on CUDA)
# The report is one file: each section's command, exit status, time and key figures, and the last
# lines of a section that failed. It is $GPU_CHECK_REPORT, else $OUT/gpu-check-report.txt where $OUT
# is set, else ./gpu-check-report.txt; each section's whole output is beside it, in <report>-logs/.
# Exit status 0 when every section passed, 1 otherwise. Without a CUDA device: one line, exit status 0.
# GPU_CHECK_DEVICE=cpu runs the same sections on the CPU, to try the script where there is no GPU
# (slowly; its figures say nothing about a GPU).
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 2
PY=${PYTHON:-$REPO/.venv/bin/python}
[ -x "$PY" ] || PY=$(command -v python3)
DEVICE=${GPU_CHECK_DEVICE:-cuda}
TOTAL=${GPU_CHECK_SECONDS:-285}

if ! "$PY" -c 'import torch' 2>/dev/null; then
  echo "gpu-check: $PY cannot import torch: make the venv first (make run), or set PYTHON" >&2
  exit 2
fi
if [ "$DEVICE" = cuda ] && ! "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
  echo "gpu-check: no CUDA device here (torch.cuda.is_available() is false): nothing to check"
  exit 0
fi

# The checkout's dtf (and its tests, whose reference loop the equivalence section uses)
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
REPORT=${GPU_CHECK_REPORT:-${OUT:+$OUT/}gpu-check-report.txt}
LOGS=${REPORT%.txt}-logs
mkdir -p "$LOGS" "$(dirname "$REPORT")"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
GPUS=0
[ "$DEVICE" != cuda ] || GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
RANKS=2  # the memory section's ranks: one per GPU, at most 2
[ "$DEVICE" != cuda ] || [ "$GPUS" -ge 2 ] || RANKS=1
# The lines of a section's output that the report keeps: check.py's, and benchmarks/overhead.py's figures
KEYS='^gpu-check: |^batch [0-9]+, repeat|^(median step time|final train loss|paired ratios|ratio)|[0-9]+ (passed|failed)'
N=0
FAILED=()

section() { # section TITLE SECONDS COMMAND...: runs COMMAND under timeout, adds its result to the report
  local title=$1 limit=$2 left=$((TOTAL - SECONDS)) start=$SECONDS rc log
  shift 2
  N=$((N + 1))
  log="$LOGS/$N-${title//[^a-z0-9]/-}.log"
  if [ "$left" -lt 20 ]; then
    printf '== %s\nskipped: %s s of the %s s left\n\n' "$title" "$left" "$TOTAL" >>"$REPORT"
    echo "gpu-check: $title: skipped (out of time)"
    FAILED+=("$title")
    return
  fi
  [ "$limit" -le "$left" ] || limit=$left
  timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
  rc=$?
  {
    echo "== $title"
    echo "command: $*"
    echo -n "exit status $rc after $((SECONDS - start)) s (limit $limit s)"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then echo ": out of time"; else echo; fi
    grep -E "$KEYS" "$log" | sed -e 's/^gpu-check: //' -e 's/^/  /'
    if [ "$rc" -ne 0 ]; then
      echo "  the last lines of $log:"
      tail -n 20 "$log" | sed 's/^/  | /'
    fi
    echo
  } >>"$REPORT"
  [ "$rc" -eq 0 ] || FAILED+=("$title")
  echo "gpu-check: $title: exit status $rc after $((SECONDS - start)) s"
}

cat >"$WORK/check.py" <<'PY'
"""scripts/gpu-check.sh's sections: check.py environment | equivalence|precision ROOT DEVICE | memory
ROOT DEVICE RANKS. Each prints its key figures as `gpu-check: ...` lines (the report keeps those)
and exits 1 if a check failed."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import torch

failed = False
stopping = False  # the section's time is up (SIGTERM)


def say(line: str, ok: bool | None = None) -> None:
    global failed
    failed |= ok is False
    print(f"gpu-check: {line}{'' if ok is None else ': PASS' if ok else ': FAIL'}", flush=True)


def out_of_time(signum: int, frame: object) -> None:
    global stopping
    stopping = True


def run_dtf(run_dir: Path, *overrides: str, multirun: bool = False) -> bool:
    """python -m dtf (-m) <overrides> in run_dir (a sweep's dir with multirun); its output in run_dir.log."""
    if stopping:
        return False
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    cmd = [sys.executable, "-m", "dtf", *(["-m"] if multirun else []), *overrides, f"{key}={run_dir}"]
    print("$", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    Path(f"{run_dir}.log").write_text(done.stdout + done.stderr)
    print(done.stdout[-1500:] + done.stderr[-1500:], flush=True)
    if done.returncode != 0:
        say(f"{' '.join(overrides)} exited with {done.returncode} (log {run_dir}.log)", False)
    return done.returncode == 0


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def max_diff(a: dict, b: dict) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in b)


def close(a: dict, b: dict, rtol: float, atol: float) -> bool:
    if a.keys() != b.keys():
        return False
    return all(torch.allclose(a[k].double(), b[k].double(), rtol=rtol, atol=atol) for k in b)


def equivalence(root: Path, device: str) -> None:
    """tests/dist/test_equivalence.py's adam-linear case at world size 1 on the device, against the
    tests' own plain loop (on the CPU), and every strategy against DDP (tests/dist/test_strategies.py's
    tolerances). One GPU holds one rank: the 2-rank tests need 2 GPUs (the last section)."""
    from tests.dist.test_equivalence import plain_loop

    common = [
        "launcher.nproc=1",
        f"trainer.device={device}",
        "data.batch_size=32",
        "trainer.max_epochs=2",
        "trainer.progress=off",
        "trainer.dist_timeout_s=60",
    ]
    ok = run_dtf(root / "a", *common, "strategy=ddp,fsdp", multirun=True)
    ok &= run_dtf(root / "b", *common, "strategy=zero", "strategy.stage=1,2,3", multirun=True)
    dirs = {
        "ddp": root / "a/0",
        "fsdp": root / "a/1",
        "zero1": root / "b/0",
        "zero2": root / "b/1",
        "zero3": root / "b/2",
    }
    if not ok or not all((d / "summary.json").exists() for d in dirs.values()):
        say("not every run finished", False)
        return
    train, test, params = plain_loop(world_size=1, batch_size=32, epochs=2, lr=1e-3, optimizer="adam", lr_scale=1.0)
    ddp, ddp_w = summary(dirs["ddp"]), torch.load(dirs["ddp"] / "model.pt", weights_only=True)
    r_train, r_test = rel(ddp["final_train_loss"], train), rel(ddp["final_test_loss"], test)
    good = r_train <= 1e-4 and r_test <= 1e-4 and close(ddp_w, params, 1e-4, 1e-5)
    say(
        f"ddp on {device} against the plain loop (CPU): train loss rel {r_train:.1e}, test loss rel {r_test:.1e}, "
        f"weights max |diff| {max_diff(ddp_w, params):.1e} (tolerance rel 1e-4, weights 1e-4/1e-5)",
        good,
    )
    for name in ("zero1", "zero2", "zero3", "fsdp"):
        s, w = summary(dirs[name]), torch.load(dirs[name] / "model.pt", weights_only=True)
        curves = s["train_loss_per_epoch"] + s["test_loss_per_epoch"]
        reference = ddp["train_loss_per_epoch"] + ddp["test_loss_per_epoch"]
        worst = max(rel(a, b) for a, b in zip(curves, reference, strict=True))
        good = s["steps_per_rank"] == ddp["steps_per_rank"] and close(w, ddp_w, 1e-5, 1e-5)
        say(
            f"{name} on {device} against ddp: loss curves rel {worst:.1e}, weights max |diff| "
            f"{max_diff(w, ddp_w):.1e} (tolerance 1e-5)",
            good and worst <= 1e-5,
        )


def precision(root: Path, device: str) -> None:
    """bf16-mixed and trainer.compile=true against fp32: deep_mlp (2048 wide, ~34 M parameters),
    SGD, per-rank batch 4096, 60 steps, one rank (benchmarks/precision.py's deep_mlp, wider)."""
    steps, batch, width = (60, 4096, 2048) if device == "cuda" else (10, 256, 128)  # cpu: a trial of the script
    common = [
        "launcher.nproc=1",
        f"trainer.device={device}",
        "model=deep_mlp",
        f"model.width={width}",
        "optimizer=sgd",
        "optimizer.lr=0.001",
        f"data.batch_size={batch}",
        f"data.dataset.num_points={batch * steps + 1024}",
        "data.dataset.num_test=1024",
        f"trainer.max_steps={steps}",
        "trainer.progress=off",
        "trainer.export_weights=false",
        "checkpoint.at_end=false",
        "checkpoint.every_n_steps=null",
    ]
    cases = {
        "fp32": ["strategy=ddp"],
        "bf16-mixed": ["strategy=ddp", "trainer.precision=bf16-mixed"],
        "compile": ["strategy=ddp", "trainer.compile=true"],
        "fsdp bf16-mixed compile": ["strategy=fsdp", "trainer.precision=bf16-mixed", "trainer.compile=true"],
    }
    done = {
        name: summary(root / str(i))
        for i, (name, args) in enumerate(cases.items())
        if run_dtf(root / str(i), *common, *args)
    }
    if "fp32" not in done:
        say("no fp32 run to compare with", False)
        return
    fp32 = done["fp32"]
    for name, s in done.items():
        ratio = s["step_time_s"] / fp32["step_time_s"]
        loss = rel(s["final_train_loss"], fp32["final_train_loss"])
        graphs = s["compiled_graphs"] or 0
        # bf16-mixed: close to fp32, not equal (docs/performance.md: 1-2%); compile: the same numbers within 1e-3
        good = loss <= (0.02 if "bf16" in name else 1e-3) and (graphs >= 1 or "compile" not in name)
        say(
            f"{name}: step {s['step_time_s'] * 1e3:.2f} ms ({ratio:.2f}x fp32), first step "
            f"{s['first_step_s'] or 0:.2f} s, {graphs} graph(s) compiled, final train loss "
            f"{s['final_train_loss']:.6g} (rel {loss:.1e} to fp32)",
            good if name != "fp32" else None,
        )


def memory(root: Path, device: str, ranks: int) -> None:
    """Each strategy's peak memory per rank (torch.cuda.max_memory_allocated, read in the rank)
    against the ZeRO formula dtf's memory check uses (summary.json's model_state_estimate_bytes)
    and the state the rank held (model_state_bytes): deep_mlp 2048 wide (~34 M parameters), fp32
    Adam (16 bytes a parameter), ranks started by torchrun, so that each is this script's process."""
    common = [
        f"launcher.nproc={ranks}",
        f"trainer.device={device}",
        "model=deep_mlp",
        f"model.width={2048 if device == 'cuda' else 128}",
        "optimizer=adam",
        "optimizer.lr=1e-4",
        "data.batch_size=32",
        "data.dataset.num_points=4000",
        "data.dataset.num_test=200",
        "trainer.max_steps=20",
        "trainer.progress=off",
        "trainer.export_weights=false",
        "checkpoint.at_end=false",
        "checkpoint.every_n_steps=null",
    ]
    cases = {"ddp": ["strategy=ddp"], "fsdp": ["strategy=fsdp"]}
    if ranks > 1:  # on one rank every strategy holds the whole state: the formulas differ from 2 on
        cases = {"ddp": ["strategy=ddp"], **{f"zero{k}": ["strategy=zero", f"strategy.stage={k}"] for k in (1, 2, 3)}}
        cases["fsdp"] = ["strategy=fsdp"]
    mib = 2**20
    for name, args in cases.items():
        if stopping:
            break
        run_dir = root / name
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
        cmd += [__file__, "rank", *common, *args, f"hydra.run.dir={run_dir}"]
        print("$", " ".join(cmd), flush=True)
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        print(done.stdout[-1500:] + done.stderr[-1500:], flush=True)
        peaks = [int(b) for b in re.findall(r"^rank \d+ max_memory_allocated (\d+)$", done.stdout, re.MULTILINE)]
        if done.returncode != 0 or len(peaks) != ranks or not (run_dir / "summary.json").exists():
            say(f"{name}: torchrun exited with {done.returncode}, {len(peaks)} of {ranks} rank(s) reported", False)
            continue
        s = summary(run_dir)
        formula, state, peak = s["model_state_estimate_bytes"], max(s["model_state_bytes"]), max(peaks)
        if not formula:
            say(f"{name}: no estimate in summary.json (trainer.memory_check off?)", False)
            continue
        # The formula is a lower bound of the peak (activations, buffers, temporaries come on top).
        good = peak >= formula if device == "cuda" else None
        say(
            f"{name} on {ranks} rank(s): peak {peak / mib:.0f} MiB a rank (the largest), state held "
            f"{state / mib:.0f} MiB, ZeRO formula {formula / mib:.0f} MiB: peak / formula {peak / formula:.2f}, "
            f"state / formula {state / formula:.2f}",
            good,
        )


def environment() -> None:
    import platform

    say(f"torch {torch.__version__}, CUDA {torch.version.cuda}, Python {platform.python_version()}")
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        say(f"GPU {i}: {p.name}, {p.total_memory / 2**30:.0f} GiB, compute capability {p.major}.{p.minor}")
    if torch.cuda.is_available():
        say(f"bf16 supported: {torch.cuda.is_bf16_supported()}")
    try:
        import triton

        say(f"triton {triton.__version__}")
    except ImportError:
        say("no triton: trainer.compile is refused on a GPU")


def rank() -> None:
    """One rank as torchrun starts it: dtf runs in this process (dist.env.launched_externally), then
    the peak memory it allocated on its GPU."""
    from dtf.cli import main

    sys.argv = ["dtf", *sys.argv[2:]]
    try:
        main()
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    print(f"rank {os.environ['RANK']} max_memory_allocated {peak}", flush=True)


if __name__ == "__main__":
    section, args = sys.argv[1], sys.argv[2:]
    if section != "rank":  # timeout's SIGTERM reaches the whole process group: let the run stop, start no other
        signal.signal(signal.SIGTERM, out_of_time)
    if section == "rank":
        rank()
    elif section == "environment":
        environment()
    else:
        root, device = Path(args[0]), args[1]
        root.mkdir(parents=True, exist_ok=True)
        if section == "equivalence":
            equivalence(root, device)
        elif section == "precision":
            precision(root, device)
        elif section == "memory":
            memory(root, device, int(args[2]))
    if stopping:
        say("out of time: the runs left were not started", False)
    sys.exit(1 if failed else 0)
PY

{
  echo "dtf GPU check, $(date -u '+%Y-%m-%d %H:%M UTC'), $(hostname), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "device $DEVICE, $GPUS GPU(s); $PY; time limit $TOTAL s; whole outputs in $LOGS"
  echo
} >"$REPORT"
section environment 15 "$PY" "$WORK/check.py" environment
section equivalence 70 "$PY" "$WORK/check.py" equivalence "$WORK/equivalence" "$DEVICE"
section "precision and compile" 90 "$PY" "$WORK/check.py" precision "$WORK/precision" "$DEVICE"
section memory $((RANKS > 1 ? 80 : 45)) "$PY" "$WORK/check.py" memory "$WORK/memory" "$DEVICE" "$RANKS"
section overhead 70 "$PY" benchmarks/overhead.py --repeats 3 --epochs 3 --nproc 1 --device "$DEVICE"
if [ "$GPUS" -ge 2 ]; then
  section "two-rank tests" 60 "$PY" -m pytest -p no:cacheprovider -q -x tests/dist/test_equivalence.py
fi
{
  echo "== summary"
  if [ "${#FAILED[@]}" -eq 0 ]; then
    echo "every section passed, in $SECONDS s"
  else
    echo "failed: $(printf '%s, ' "${FAILED[@]}" | sed 's/, $//') ($SECONDS s)"
  fi
} >>"$REPORT"
echo "gpu-check: report in $REPORT"
[ "${#FAILED[@]}" -eq 0 ]
