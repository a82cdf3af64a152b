#!/usr/bin/env bash
# The prepared GPU check: one command, on a machine with one CUDA GPU and a CUDA build of
# torch already installed (no network, nothing else installed: disttrain is taken from
# src/), run from anywhere in the repository. Sections, each under its own time limit:
#
#   env      device, driver, torch, CUDA and NCCL versions
#   set      (below)
#   mfu      bench/gpu_mfu.py at micro-batch 16 and 32 with the fused loss off and on,
#            eager (mfu_eager) and compiled (mfu_compile), each side run twice,
#            alternated (plain, disttrain, plain, disttrain), 15 timed steps a run: one
#            JSON line per pair (the ratio of the medians, each repetition's beside),
#            with issue 38's targets and whether they were met
#   calibrate  disttrain plan calibrate --device cuda --nproc 1 (matmuls in bf16, fp16
#            and fp32, fused attention, a memory copy) into cluster_gpu.json, then
#            bench/gpu_calibrate.py: each measured rate over what the planner's preset
#            for this GPU predicts, and a bf16 sweep of the forward and backward
#            matmuls of 1-20B models' linear layers, as one JSON line
#   jobs     the default job, 50 steps, world 1 (NCCL), then the same with
#            model.name=llama in bf16: each run's summary as one JSON line
#   set      the GPU test set (pytest -m gpu tests/gpu): the one-rank cases, and every
#            multi-rank strategy with all its ranks on the one GPU in the shared-GPU
#            test mode (test_gpu_shared.py: Gloo, collectives staged through pinned
#            host memory); the NCCL cases needing 2+ GPUs skip
#   profile  scripts/gpu_profile.py: a few profiled steps of disttrain and the plain
#            loop (GPU busy and idle time per step, host-device syncs, top host ops)
#   pretrained  scripts/gpu_pretrained.py: a bf16 Llama directory (8 x 1024) trained
#            from under ZeRO-3, built on meta and filled on the GPU: memory peak, and
#            the held-out loss against transformers' own
#
# The whole check stays within $GPU_CHECK_BUDGET_S seconds (480): each section's limit is
# cut to what is left, and a section with under 20 s left is reported as skipped. The
# sections run in the order of what they prove: env, set, mfu_eager, mfu_compile,
# calibrate, profile (the planner's split beside the device's), jobs, pretrained (both
# seen on an H200 already: the first to be cut when the budget runs out).
# Logs and JSON go under $OUT when it is set, else under ./gpu_check_out (one flat
# folder: results.jsonl with every JSON line, summary.txt, and a .log per section,
# trimmed to its first 40 and last 200 lines: the raw output committed under
# bench/results/gpu/<date>-<gpu>/). The last lines printed are a table of sections with
# status and seconds.
#
#   bash scripts/gpu_check.sh                 # everything (within 8 minutes on an H100)
#   GPU_CHECK_ONLY="set mfu" bash scripts/gpu_check.sh     # a rerun of some sections
#   DISTTRAIN_GPU_SET_ON_CPU=1 bash scripts/gpu_check.sh   # dry run on the CPU
#
# The dry run (DISTTRAIN_GPU_SET_ON_CPU=1) runs the same sections on the CPU with Gloo
# at smaller sizes (the set's fp16 cases skip, the shared-GPU cases stage CPU tensors
# under DISTTRAIN_HOST_STAGING=1, the MFU bench at a tiny shape, calibrate --quick on the
# CPU and the sweep at tiny shapes): it shows that the script starts and finishes, not
# that CUDA works.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DEST="${OUT:-$ROOT/gpu_check_out}"
mkdir -p "$DEST"
rm -f "$DEST"/*.log
: > "$DEST/results.jsonl"
: > "$DEST/summary.txt"
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
ONLY="${GPU_CHECK_ONLY:-env mfu calibrate jobs set profile pretrained}"
DRY="${DISTTRAIN_GPU_SET_ON_CPU:-0}"
if [ "$DRY" = 1 ]; then
    MFU_SHAPE=(--device cpu --micro-batch 2 --seq-len 64 --n-layer 2 --d-model 64
               --n-head 2 --vocab 512 --steps 4 --warmup 2 --log-every 2 --repeats 2)
    CAL_DEVICE=cpu
    CAL_QUICK=--quick
    JOB_STEPS=8
    PROFILE_ARGS=(--device cpu --steps 2)
    PRETRAINED_ARGS=(--device cpu --layers 2 --width 128)
else
    PRETRAINED_ARGS=()
    PROFILE_ARGS=(--steps 6)
    # 2 x (plain + 2 disttrain) runs of 5 + 15 steps: the 120 steps per micro-batch of
    # one unrepeated run of 10 + 30 steps each
    MFU_SHAPE=(--micro-batch 16 32 --steps 15 --warmup 5 --log-every 5 --repeats 2)
    CAL_DEVICE=cuda
    CAL_QUICK=
    JOB_STEPS=50
fi
# pytest-xdist, where installed, runs the set's cases side by side on the one GPU (each
# case is a tiny model in its own spawned ranks, up to eight for the shared-GPU (2,2,2);
# the oracle is computed once per worker)
SET_WORKERS=()
if [ "$DRY" != 1 ] && "$PY" -c "import xdist" 2>/dev/null; then SET_WORKERS=(-n 4); fi

# every section's limit is cut to what is left of the whole check's budget
BUDGET="${GPU_CHECK_BUDGET_S:-480}"

# wanted NAME: the section (mfu_eager: its group, mfu) is in $GPU_CHECK_ONLY
wanted() { [[ " $ONLY " == *" ${1%%_*} "* ]]; }

# run NAME LIMIT_S CMD...: the command's output to NAME.log (and the terminal); a line
# of the summary with its status and wall time.
run() {
    local name=$1 limit=$2
    shift 2
    wanted "$name" || return 0
    local left=$((BUDGET - SECONDS))
    if [ "$left" -lt 20 ]; then
        printf '%-12s %-28s %4ds\n' "$name" "SKIPPED (budget spent)" 0 >> "$DEST/summary.txt"
        return 0
    fi
    [ "$limit" -le "$left" ] || limit=$left
    echo "=== $name (limit ${limit}s): $*"
    local t0=$SECONDS rc
    # through bash -c, so that the exported functions below run under timeout too
    timeout -k 10 "$limit" bash -c '"$@"' "$name" "$@" 2>&1 | tee "$DEST/$name.log"
    rc=${PIPESTATUS[0]}
    local status=ok
    [ "$rc" = 0 ] || status="FAILED (exit $rc$([ "$rc" = 124 ] && echo ', time limit'))"
    printf '%-12s %-28s %4ds\n' "$name" "$status" $((SECONDS - t0)) >> "$DEST/summary.txt"
}

# json_lines LOG: the log's lines that are JSON objects, appended to results.jsonl
json_lines() { grep -h '^{' "$DEST/$1.log" 2>/dev/null >> "$DEST/results.jsonl" || true; }

env_report() {
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm \
            --format=csv,noheader || true
    fi
    "$PY" - <<'EOF'
import json, platform
import torch
info = {"check": "env", "python": platform.python_version(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info.update(gpu=p.name, gpus=torch.cuda.device_count(), sms=p.multi_processor_count,
                memory_gib=round(p.total_memory / 2**30, 1),
                capability=f"{p.major}.{p.minor}",
                nccl=".".join(map(str, torch.cuda.nccl.version())))
try:
    import transformers
    info["transformers"] = transformers.__version__
except ImportError:
    info["transformers"] = None
print(json.dumps(info))
EOF
}

# job NAME STEPS [--set ...]: the command line's training job on one rank; prints the
# run's summary.json as one JSON line
job() {
    local name=$1 steps=$2 dir="${TMPDIR:-/tmp}/gpu_check_run_$1"
    shift 2
    rm -rf "$dir"
    "$PY" -m disttrain train --nproc 1 --quiet --run-dir "$dir" \
        --set train.steps="$steps" --set train.log_every=10 --set checkpoint.every=0 "$@" \
        || return
    "$PY" -c 'import json,sys; s=json.load(open(sys.argv[1])); s["check"]=sys.argv[2]; print(json.dumps(s))' \
        "$dir/summary.json" "$name"
    rm -rf "$dir"
}

# jobs: the default job, then model.name=llama in bf16
jobs() {
    job default "$JOB_STEPS" && job llama "$JOB_STEPS" --set model.name=llama \
        --set train.precision=bf16
}

# calibrate: this GPU as a cluster file, then its figures against the planner's preset
# (the full calibration: 33 matmul shapes (11 in each of bf16, fp16, fp32), 4 attention shapes; the dry run's --quick: 10
# and 2, in 5 s on 2 CPU cores)
calibrate() {
    # $CAL_QUICK unquoted: empty, or the one flag --quick
    "$PY" -m disttrain plan calibrate --device "$CAL_DEVICE" --nproc 1 \
        --out "$DEST/cluster_gpu.json" $CAL_QUICK || return
    "$PY" bench/gpu_calibrate.py "$DEST/cluster_gpu.json" --device "$CAL_DEVICE"
}

export -f env_report job jobs calibrate
export JOB_STEPS CAL_DEVICE CAL_QUICK
export DEST PY
run env 60 env_report
json_lines env
run set 200 "$PY" -m pytest -m gpu tests/gpu -q -rA -p no:cacheprovider "${SET_WORKERS[@]}"
run mfu_eager 100 "$PY" bench/gpu_mfu.py "${MFU_SHAPE[@]}" --fused-loss off on
json_lines mfu_eager
run mfu_compile 150 "$PY" bench/gpu_mfu.py "${MFU_SHAPE[@]}" --fused-loss off on --compile
json_lines mfu_compile
run calibrate 60 calibrate
json_lines calibrate
run profile 60 "$PY" scripts/gpu_profile.py "${PROFILE_ARGS[@]}"
json_lines profile
run jobs 90 jobs
json_lines jobs
run pretrained 60 "$PY" scripts/gpu_pretrained.py "${PRETRAINED_ARGS[@]}"
json_lines pretrained

# each log trimmed to its first 40 and last 200 lines (JSON lines are in results.jsonl)
for log in "$DEST"/*.log; do
    [ -f "$log" ] || continue
    n=$(wc -l < "$log")
    if [ "$n" -gt 240 ]; then
        { head -n 40 "$log"; echo "... ($((n - 240)) lines left out) ..."; tail -n 200 "$log"; } \
            > "$log.trim" && mv "$log.trim" "$log"
    fi
done

echo "=== results ($DEST/results.jsonl)"
cat "$DEST/results.jsonl"
echo "=== summary"
cat "$DEST/summary.txt"
! grep -q FAILED "$DEST/summary.txt"
