#!/usr/bin/env bash
# The GPU checklist of docs/gpu.md in one bounded run, for a machine with a CUDA device.
#
#   bash scripts/gpu_check.sh [OUTDIR]          (default OUTDIR: gpu_check/)
#
# Stages, each under its own time limit (a stage that fails or overruns is reported and the next
# one runs), logs and JSON lines in OUTDIR:
#   env            GPU, driver, torch / CUDA / Triton versions           -> check.log
#   pytest         the gpu-marked kernel, host-sync and CUDA-graph tests (compiled Triton
#                  kernels, torch.cuda.set_sync_debug_mode, train.cuda_graph=on's captures),
#                  beside the parity run                                  -> pytest_gpu.log
#   parity         python -m dev.gpu_parity: every training path on cuda against the CPU reference
#                                                                         -> gpu_parity.jsonl
#   bench_kernels  python -m benchmarks.bench_kernels: gather / scatter+update against the copy bandwidth
#                                                                         -> bench_kernels.jsonl
#   bench_train    python -m benchmarks.bench_train at W = 1, train.device=cuda and cpu in one run (and at
#                  each data.batch_size in BATCHES="B1 B2 ..."); at W = 2 with train.pipeline=off
#                  and ids                                                -> bench_train.jsonl
#   bench_before   both benchmarks at another checkout (BEFORE=DIR, e.g. a `git archive` of an
#                  older commit), only when BEFORE is set                 -> bench_before.jsonl
# CRITEO=DIR (a prepared Criteo directory) adds the parity path criteo-dali: the default recipe on
# data=criteo, DALI's GPU pipeline on the device (the memmap reader where DALI is not installed).
# PART=checks runs env, pytest and parity only; PART=bench env and the benchmarks only (default:
# all), so a short device lease can take them in two calls. PART=step runs env and the step study
# of the MLPerf-shaped DLRM only:
#   dense_probe    python -m dev.gpu_dense_probe: the dense step alone, eager vs one CUDA graph
#                                                                         -> dense_probe.jsonl
#   step_mlperf    bench_train --workload mlperf, bf16, W = 1 at STEP_BATCHES (default 2048 16384
#                  65536), torch.profiler over 5 steps (kernel busy share, launches, top kernels),
#                  STEP_EXTRA overrides appended                          -> step.jsonl
#   step_bench     the same profile on the bench workload at 2,048 (the earlier baseline)
#                                                                         -> step.jsonl
#   step_w2_*      the bench workload at W = 2 through gloo on the one device, for each
#                  train.pipeline in STEP_W2_PIPELINES (e.g. "off ids"; default: none)
#                                                                         -> step.jsonl
# (STEP_PRECISIONS: the mlperf points' train.precision list, default bf16; DENSE_PROBE=0 skips the
# probe; STEP_EXTRA="data.cycle_batches=8" takes the synthetic generator out of the step, and
# STEP_EXTRA="data.cycle_batches=8 train.cuda_graph=on" measures the captured step: the whole step at
# W = 1, the dense half at W = 2.)
# DEVICE=cpu QUICK=1 runs the same plumbing on a CPU machine (small sizes, no gpu tests), to check
# the script itself before spending GPU time. PYTHON picks the interpreter (default python3).
set -u
case "${1:-}" in
  -h|--help) sed -n '2,/^set /{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;;
  -*) echo "error: $1: unknown option (gpu_check.sh [OUTDIR]: see --help)" >&2; exit 2 ;;
esac
OUT=${1:-gpu_check}
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
QUICK=${QUICK:-0}
JOBS=${JOBS:-8}
PART=${PART:-all}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
# From the repository root: the benchmarks and harnesses are modules (`python -m benchmarks.x`,
# `python -m dev.x`), found there, with this checkout's trainer/, from the working directory.
cd "$ROOT"
export PYTHONUNBUFFERED=1
LOG="$OUT/check.log"

say() { echo "[gpu_check $(date +%T)] $*" | tee -a "$LOG"; }

# stage NAME LIMIT_S LOGFILE CMD...: run CMD under a time limit, its output into LOGFILE
stage() {
  local name=$1 limit=$2 log=$3 t0 rc
  shift 3
  say "$name: start (limit ${limit}s): $*"
  t0=$(date +%s)
  timeout -k 10 "$limit" "$@" >> "$log" 2>&1
  rc=$?
  say "$name: rc=$rc after $(( $(date +%s) - t0 ))s$([ $rc = 124 ] && echo ' (time limit)')"
  return $rc
}

if [ "$QUICK" = 1 ]; then
  PARITY=(--only dlrm w2-lfu-ssp --steps 6)
  KBENCH=(--quick)
  TSTEPS=6
  TQUICK=(data.max_table_rows=20000 data.test_samples=1024)  # bench_train's workload, small
else
  PARITY=(--steps 120)
  KBENCH=(--dims 16 64 128 --bags 8 32 --reps 20)
  TSTEPS=60
  TQUICK=()
fi

stage env 60 "$LOG" "$PY" - "$DEVICE" <<'EOF'
import subprocess, sys, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
try:
    import triton
    print("triton", triton.__version__)
except ImportError as e:
    print("triton: not importable:", e)
if sys.argv[1] == "cuda":
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, "SMs", p.multi_processor_count, "memory GiB", round(p.total_memory / 2**30, 1))
    print(subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                          "--format=csv,noheader"], capture_output=True, text=True).stdout.strip())
import trainer, kernels  # noqa: F401  (the package imports with this interpreter's packages)
print("trainer imports")
EOF
[ $? = 0 ] || { say "env failed: see $LOG"; exit 1; }

if [ "$PART" = step ]; then
  STEP_BATCHES=${STEP_BATCHES:-2048 16384 65536}
  SSTEPS=$([ "$QUICK" = 1 ] && echo 30 || echo 40)
  [ "${DENSE_PROBE:-1}" = 1 ] && stage dense_probe 90 "$OUT/dense_probe.jsonl" "$PY" -m dev.gpu_dense_probe \
    --device "$DEVICE" $([ "$QUICK" = 1 ] && echo --batch-sizes 256 --iters 2)
  for batch in $STEP_BATCHES; do
    stage "step_mlperf_$batch" 120 "$OUT/step.jsonl" "$PY" -m benchmarks.bench_train --worlds 1 \
      --workload mlperf --steps "$SSTEPS" --profile-steps 5 --batch-sizes "$batch" \
      --precisions ${STEP_PRECISIONS:-bf16} -- "train.device=$DEVICE" data.loader_threads=8 ${STEP_EXTRA:-}
  done
  stage step_bench 90 "$OUT/step.jsonl" "$PY" -m benchmarks.bench_train --worlds 1 --steps "$SSTEPS" \
    --profile-steps 5 -- "train.device=$DEVICE" ${STEP_EXTRA:-}
  for pipe in ${STEP_W2_PIPELINES:-}; do  # W = 2 through gloo on the one device, serial vs pipelined
    stage "step_w2_pipeline_$pipe" 120 "$OUT/step.jsonl" "$PY" -m benchmarks.bench_train --worlds 2 \
      --steps "$SSTEPS" --profile-steps 5 -- "train.device=$DEVICE" comm.dist_backend=gloo \
      "train.pipeline=$pipe" ${STEP_EXTRA:-}
  done
  say "done: $OUT"
  exit 0
fi

PYTEST_PID=
if [ "$PART" != bench ] && [ "$DEVICE" = cuda ]; then
  stage pytest 200 "$OUT/pytest_gpu.log" "$PY" -m pytest -q -s -m gpu -p no:cacheprovider \
    tests/kernels/test_kernel_*.py tests/unit/test_step_device.py tests/unit/test_dense_step.py tests/unit/test_whole_step.py \
    tests/unit/test_dense_update.py &
  PYTEST_PID=$!
fi

[ "$PART" != bench ] && stage parity 240 "$LOG" "$PY" -m dev.gpu_parity --device "$DEVICE" --jobs "$JOBS" \
  "${PARITY[@]}" ${CRITEO:+--criteo "$CRITEO"} --out "$OUT/gpu_parity.jsonl"

[ -n "$PYTEST_PID" ] && wait "$PYTEST_PID"
[ -f "$OUT/pytest_gpu.log" ] && tail -n 15 "$OUT/pytest_gpu.log" >> "$LOG"

if [ "$PART" = checks ]; then say "done: $OUT"; exit 0; fi
# the benchmarks run alone on the device
stage bench_kernels 100 "$LOG" "$PY" -m benchmarks.bench_kernels --device "$DEVICE" "${KBENCH[@]}" \
  --out "$OUT/bench_kernels.jsonl"

for batch in default ${BATCHES:-}; do
  size=()
  [ "$batch" = default ] || size=("data.batch_size=$batch")
  for dev in "$DEVICE" cpu; do
    stage "bench_train_${dev}_$batch" 90 "$OUT/bench_train.jsonl" "$PY" -m benchmarks.bench_train \
      --worlds 1 --steps "$TSTEPS" -- "${TQUICK[@]}" "train.device=$dev" "${size[@]}"
    [ "$DEVICE" = cpu ] && break
  done
done

# issue 15 item 6: the pipelined step against the serial one at W = 2 (on one GPU both ranks share
# it through gloo, which stages every collective through host memory)
for pipe in off ids; do
  stage "bench_train_w2_pipeline_$pipe" 120 "$OUT/bench_train.jsonl" "$PY" -m benchmarks.bench_train \
    --worlds 2 --steps "$TSTEPS" -- "${TQUICK[@]}" "train.device=$DEVICE" comm.dist_backend=gloo "train.pipeline=$pipe"
done

if [ -n "${BEFORE:-}" ]; then  # the same benchmarks at another checkout, side by side
  old=(env -C "$BEFORE")  # run from that checkout's root: its benchmarks/ and trainer/
  stage bench_kernels_before 100 "$OUT/bench_before.jsonl" "${old[@]}" "$PY" \
    -m benchmarks.bench_kernels --device "$DEVICE" "${KBENCH[@]}"
  stage bench_train_before 90 "$OUT/bench_before.jsonl" "${old[@]}" "$PY" \
    -m benchmarks.bench_train --worlds 1 --steps "$TSTEPS" -- "${TQUICK[@]}" "train.device=$DEVICE"
fi
say "done: $OUT"
