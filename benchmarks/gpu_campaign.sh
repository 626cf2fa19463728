#!/usr/bin/env bash
# The GPU campaign: every measurement of the speed targets (BENCHMARKS.md), in order, each under its own
# time limit, in three phases that each fit one device-tool call (< 10 minutes).
#
#   benchmarks/gpu_campaign.sh [--rehearse] [--dry-run] [--out DIR] PHASE...
#
# PHASE:
#   wheels   (here, with the internet) download the wheels the GPU image lacks into .whl/
#   phase1   env, matmul peak + copy bandwidth + optimizer step vs its floor (benchmarks/gpu_peak.py),
#            pytest -m gpu (with the 20-step no-sync test), profile of the ViT-B/16 step,
#            the quickstart under O0 and O1/O2/O3 x bfloat16/float16
#   phase2   benchmarks/vs_libraries.py ViT-B/16 (libraries, libraries at their best, ablation),
#            --mode time ViT-B/16 (compiled), profile of the compiled ViT-B/16 step
#   phase3   --mode time ViT-H/14 (compiled), data path (benchmarks/loader_speed.py: raw shards +
#            GPU augmentation, JPEG shards + nvJPEG), benchmarks/vs_libraries.py ViT-H/14 (eager)
#   phase4   the CNN zoo: RegNetY-4.0GF and ResNet-50, bf16, channels_last, ours against upstream
#            pycls's code and timm's (benchmarks/vs_upstream.py; needs $UPSTREAM_PYCLS)
#   all      phase1 ... phase4 (a rehearsal; on a GPU it is longer than one device call)
#   report   the targets table (benchmarks/campaign_report.py) over everything in the folder
#
# Each phase writes DIR/phaseN/: env.txt, steps.tsv (step, exit code, seconds, budget; appended
# to when a step runs again), and per step NAME.log and a folder NAME/ (emptied when the step runs)
# with the tool's own tables and json_stats lines; then the report, DIR/summary.md.
# DIR: --out, else $GPU_CAMPAIGN_DIR, else /tmp/gpu_campaign. When $OUT is set (the device tool),
# each phase is also packed into $OUT/phaseN.tar.gz with $OUT/phaseN_summary.md beside it (the
# tool brings back at most 8 files, 2 folders deep).
#
# Without CUDA (or with --rehearse) every step runs on the CPU at tiny sizes: the whole campaign
# then takes 2 to 6 minutes on 2 shared cores. --dry-run prints the steps (the GPU run's, or with
# --rehearse the rehearsal's) without running anything.
#
# Knobs (environment): B16_BATCH (256), H14_BATCH (32, benchmarks/vs_libraries.py), H14_TIME_BATCH (64,
# --mode time), H14_TIME_OPTS (more KEY VALUE overrides for that run), PHASE_LIMIT_S (500: steps
# are shortened or skipped to end a phase by then), UPSTREAM_PYCLS (a checkout of
# facebookresearch/pycls, default .upstream/pycls, ignored by git: carry it to the GPU machine),
# GPU_CAMPAIGN_STEPS (space-separated step names: run only these), GIT_REV (the commit, when the
# machine has no .git), PYTHON (python3).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
PY=${PYTHON:-python3}
RESULTS=${GPU_CAMPAIGN_DIR:-/tmp/gpu_campaign}
REHEARSE=0
DRY=0
PHASES=()
while [ $# -gt 0 ]; do
    case $1 in
        --rehearse) REHEARSE=1 ;;
        --dry-run) DRY=1 ;;
        --out) RESULTS=$2; shift ;;
        --out=*) RESULTS=${1#--out=} ;;
        -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        wheels|phase1|phase2|phase3|phase4|report) PHASES+=("$1") ;;
        all) PHASES+=(phase1 phase2 phase3 phase4) ;;
        *) echo "gpu_campaign.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
    shift
done
[ ${#PHASES[@]} -gt 0 ] || { echo "gpu_campaign.sh: name a phase (see --help)" >&2; exit 2; }

B16_BATCH=${B16_BATCH:-256}
H14_BATCH=${H14_BATCH:-32}
H14_TIME_BATCH=${H14_TIME_BATCH:-64}
PHASE_LIMIT_S=${PHASE_LIMIT_S:-500}
UPSTREAM_PYCLS=${UPSTREAM_PYCLS:-$ROOT/.upstream/pycls}

# --------------------------------------------------------------------------------------------- #
# Wheels: pure-python packages the GPU image lacks (it has torch, torchvision, timm, numpy,
# simplejson, PyYAML, tqdm, typing_extensions, cloudpickle, scikit-learn, matplotlib, pytest).
# fairscale 0.4.13 and iopath 0.1.10 are published as source only: pip builds their (pure-python)
# wheels here. portalocker is iopath's dependency.
# --------------------------------------------------------------------------------------------- #
BINARY_WHEELS="yacs==0.1.8 portalocker==4.4.2 submitit==1.5.4"
SOURCE_WHEELS="fairscale==0.4.13 iopath==0.1.10"
NEEDED_MODULES="yacs iopath fairscale submitit portalocker"

download_wheels() {
    mkdir -p .whl
    local p
    for p in $BINARY_WHEELS; do
        "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 --platform any -d .whl "$p" || return 1
    done
    "$PY" -m pip wheel -q --no-deps -w .whl $SOURCE_WHEELS || return 1
    ls -l .whl
}

install_wheels() {
    # Into /tmp/site, once per machine; only what python cannot import already
    local missing
    missing=$("$PY" -c 'import importlib.util as u, sys
print(" ".join(m for m in sys.argv[1:] if u.find_spec(m) is None))' $NEEDED_MODULES)
    if [ -n "$missing" ] && [ ! -e /tmp/site/.pycls_campaign ]; then
        if ls .whl/*.whl >/dev/null 2>&1; then
            "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                --target /tmp/site .whl/*.whl && touch /tmp/site/.pycls_campaign
        else
            echo "missing $missing and no .whl/ folder: run 'benchmarks/gpu_campaign.sh wheels'" \
                "here and carry .whl" >&2
        fi
    fi
    [ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
    "$PY" -c "import yacs" 2>/dev/null && return 0
    echo "yacs is not importable: pycls cannot load a config" >&2
    return 1
}

# --------------------------------------------------------------------------------------------- #
# Running steps
# --------------------------------------------------------------------------------------------- #
PHASE_DIR=
PHASE_START=

wanted() {
    [ -z "${GPU_CAMPAIGN_STEPS:-}" ] && return 0
    case " $GPU_CAMPAIGN_STEPS " in *" $1 "*) return 0 ;; esac
    return 1
}

# step NAME BUDGET_S CMD...: runs CMD under `timeout` with a fresh PHASE_DIR/NAME/ for its files,
# output to PHASE_DIR/NAME.log, and appends "NAME rc seconds budget" to PHASE_DIR/steps.tsv (rc 124:
# stopped at its budget)
step() {
    local name=$1 budget=$2
    shift 2
    wanted "$name" || return 0
    local left=$((PHASE_START + PHASE_LIMIT_S - $(date +%s) - 15))
    [ "$budget" -gt "$left" ] && budget=$left
    if [ "$DRY" = 1 ]; then
        printf 'STEP %s %ss:' "$name" "$budget"
        printf ' %q' "$@"
        echo
        return 0
    fi
    if [ "$budget" -lt 15 ]; then
        echo "== $name: skipped, the phase's time is spent"
        printf '%s\tskipped\t0\t0\n' "$name" >>"$PHASE_DIR/steps.tsv"
        return 0
    fi
    rm -rf "${PHASE_DIR:?}/$name"
    mkdir -p "$PHASE_DIR/$name"
    echo "== $name (budget ${budget}s): $*"
    local t0 rc
    t0=$(date +%s)
    timeout -k 10 "$budget" "$@" >"$PHASE_DIR/$name.log" 2>&1
    rc=$?
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - t0))" "$budget" \
        >>"$PHASE_DIR/steps.tsv"
    echo "   rc=$rc in $(($(date +%s) - t0))s; last lines:"
    tail -n 3 "$PHASE_DIR/$name.log" | cut -c1-200 | sed 's/^/   | /'
}

write_env() {
    {
        echo "date_utc: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
        echo "host: $(hostname)"
        echo "git: ${GIT_REV:-$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)}"
        echo "rehearsal: $REHEARSE"
        echo "cpus: $(nproc --all)"
        "$PY" - <<'EOF'
import importlib.metadata, torch
print(f"torch: {torch.__version__} (cuda {torch.version.cuda})")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"gpu: {p.name}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs")
for name in ("torchvision", "timm", "yacs", "iopath", "fairscale", "submitit", "portalocker",
             "numpy"):
    try:
        print(f"{name}: {importlib.metadata.version(name)}")
    except importlib.metadata.PackageNotFoundError:
        print(f"{name}: missing")
EOF
        command -v nvidia-smi >/dev/null && nvidia-smi \
            --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv
    } >"$PHASE_DIR/env.txt" 2>&1
}

begin_phase() {
    PHASE_DIR=$RESULTS/$1
    PHASE_START=$(date +%s)
    [ "$DRY" = 1 ] && return 0
    mkdir -p "$PHASE_DIR"
    write_env
    local what
    what=$(sed -n 's/^gpu: //p; s/^torch: //p' "$PHASE_DIR/env.txt" | paste -sd' ')
    echo "### $1 -> $PHASE_DIR ($what)"
}

end_phase() {
    [ "$DRY" = 1 ] && return 0
    "$PY" benchmarks/campaign_report.py "$RESULTS" >"$PHASE_DIR/report.log" 2>&1 ||
        echo "report failed: see $PHASE_DIR/report.log"
    cp "$RESULTS/summary.md" "$PHASE_DIR/summary.md" 2>/dev/null
    if [ -n "${OUT:-}" ] && [ "$(cd "$OUT" && pwd)" != "$(cd "$RESULTS" && pwd)" ]; then
        # checkpoints (the quickstart runs') would overflow the 16 MiB a returned file may hold
        tar czf "$OUT/$1.tar.gz" --exclude=checkpoints --exclude='*.pyth' -C "$RESULTS" "$1"
        cp "$PHASE_DIR/summary.md" "$OUT/$1_summary.md" 2>/dev/null
        [ "$(stat -c %s "$OUT/$1.tar.gz")" -gt $((16 * 2**20)) ] &&
            echo "WARNING: $OUT/$1.tar.gz is over 16 MiB: the device tool will not return it"
    fi
    echo "### $1 done in $(($(date +%s) - PHASE_START))s"
    cat "$PHASE_DIR/summary.md" 2>/dev/null
}

# --------------------------------------------------------------------------------------------- #
# Sizes: the GPU run, or the CPU rehearsal
# --------------------------------------------------------------------------------------------- #
# (a dry run shows the GPU run's commands unless --rehearse asks for the rehearsal's)
if [ "$DRY" = 0 ] && [ "$REHEARSE" = 0 ] &&
    ! "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    REHEARSE=1
fi
# A 2-block, 64-wide ViT at 32 px (benchmarks/vs_libraries.py --tiny's size) for config-driven tools
TINY_VIT=(MODEL.ARCH "" VIT.PATCH_SIZE 8 VIT.DEPTH 2 VIT.WIDTH 64 VIT.NUM_HEADS 2 VIT.MLP_DIM 128
          TRAIN.IM_SIZE 32 TEST.IM_SIZE 32 DEVICE cpu DATA_LOADER.NUM_WORKERS 0)
if [ "$REHEARSE" = 1 ]; then
    export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
    PEAK_ARGS=(--tiny --iters 3 --warmup 1)
    PROFILE_FLAGS=(--steps 2 --warmup 1)
    PROFILE_B16=("${TINY_VIT[@]}" TRAIN.BATCH_SIZE 4)
    AMP_LEVELS="O0/bfloat16 O1/bfloat16"
    AMP_ARGS=(VIT.DEPTH 1 VIT.WIDTH 32 VIT.NUM_HEADS 2 VIT.MLP_DIM 64 TRAIN.BATCH_SIZE 64
              OPTIM.MAX_EPOCH 1 OPTIM.WARMUP_EPOCHS 0 DEVICE cpu)
    BENCH_B16=(--tiny --batch-size 8 --iters 2 --warmup 1 --skip-compile --threads 1)
    TIME_ARGS=("${TINY_VIT[@]}" TRAIN.BATCH_SIZE 8 PREC_TIME.NUM_ITER 2 PREC_TIME.WARMUP_ITER 1)
    TIME_B16=("${TIME_ARGS[@]}" TRAIN.COMPILE False)
    TIME_H14=("${TIME_ARGS[@]}" TRAIN.COMPILE False)
    BENCH_H14=(--tiny --batch-size 8 --iters 2 --warmup 1 --skip-compile --threads 1
               --tables libraries)
    LOADER=(--num-images 32 --source-size 48 64 --stored-size 40 --image-size 32 --batch-size 8
            --workers 1 --epochs 1 --repeats 1)
    CNN_ZOO=(--models ResNet-50 --amp bf16 --channels-last --timm --batch 2 --size 32 --pairs 2
             --warmup 1)
else
    PEAK_ARGS=()
    PROFILE_FLAGS=(--steps 5 --warmup 5)
    PROFILE_B16=(TRAIN.BATCH_SIZE "$B16_BATCH")
    AMP_LEVELS="O0/bfloat16 O1/bfloat16 O2/bfloat16 O3/bfloat16 O1/float16 O2/float16 O3/float16"
    AMP_ARGS=()
    BENCH_B16=(--arch vit_b16 --batch-size "$B16_BATCH" --iters 30 --warmup 10)
    TIME_B16=(TRAIN.BATCH_SIZE "$B16_BATCH" TRAIN.COMPILE True PREC_TIME.NUM_ITER 30
              PREC_TIME.WARMUP_ITER 10)
    # shellcheck disable=SC2206  # H14_TIME_OPTS: KEY VALUE pairs, split on purpose
    TIME_H14=(MODEL.ARCH vit_h14 TRAIN.BATCH_SIZE "$H14_TIME_BATCH" TRAIN.COMPILE True
              PREC_TIME.NUM_ITER 15 PREC_TIME.WARMUP_ITER 5 ${H14_TIME_OPTS:-})
    BENCH_H14=(--arch vit_h14 --batch-size "$H14_BATCH" --iters 15 --warmup 5 --skip-compile
               --tables libraries ablation)
    LOADER=(--num-images 2048 --batch-size 256 --workers 16 --epochs 2 --repeats 2)
    CNN_ZOO=(--models RegNetY-4.0GF ResNet-50 --device cuda --amp bf16 --channels-last --timm
             --batch 256 --pairs 20 --warmup 5)
fi
SYNTHETIC=(TRAIN.DATASET synthetic TEST.DATASET synthetic)
# The profiled step is the one --mode time measures: O1 bfloat16 (vit_b16.yaml), contiguous AdamW
PROFILE_B16=(OPTIM.CONTIGUOUS_PARAMS True "${PROFILE_B16[@]}")

# The quickstart under each AMP level / dtype, all at once (the model is tiny: the GPU has room)
amp_levels() {
    local dir=$1 pids=() ld level dtype
    shift
    for ld in $AMP_LEVELS; do
        level=${ld%/*} dtype=${ld#*/}
        OMP_NUM_THREADS=1 "$PY" tools/run_net.py --mode train --cfg configs/quickstart.yaml \
            OUT_DIR "$dir/${level}_$dtype" AMP.LEVEL "$level" AMP.DTYPE "$dtype" "$@" \
            >"$dir/${level}_$dtype.log" 2>&1 &
        pids+=($!)
    done
    local rc=0 pid
    for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
    return $rc
}
export -f amp_levels
export AMP_LEVELS PY

# --------------------------------------------------------------------------------------------- #
# Phases
# --------------------------------------------------------------------------------------------- #
phase1() {
    begin_phase phase1
    step peak 90 "$PY" benchmarks/gpu_peak.py --out "$PHASE_DIR/peak" "${PEAK_ARGS[@]}"
    step pytest_gpu 210 "$PY" -m pytest -m gpu -q -ra -p no:cacheprovider tests \
        --junitxml="$PHASE_DIR/pytest_gpu/pytest_gpu.xml"
    step profile_b16 90 "$PY" benchmarks/profile_step.py --cfg configs/vit_b16.yaml \
        "${PROFILE_FLAGS[@]}" OUT_DIR "$PHASE_DIR/profile_b16" "${SYNTHETIC[@]}" "${PROFILE_B16[@]}"
    step amp 150 bash -c 'amp_levels "$@"' amp_levels "$PHASE_DIR/amp" "${AMP_ARGS[@]}"
    end_phase phase1
}

phase2() {
    begin_phase phase2
    step bench_b16 300 "$PY" benchmarks/vs_libraries.py "${BENCH_B16[@]}" --out "$PHASE_DIR/bench_b16"
    step time_b16 150 "$PY" tools/run_net.py --mode time --cfg configs/vit_b16.yaml \
        OUT_DIR "$PHASE_DIR/time_b16" "${SYNTHETIC[@]}" AMP.LEVEL O1 AMP.DTYPE bfloat16 \
        OPTIM.CONTIGUOUS_PARAMS True "${TIME_B16[@]}"
    step profile_b16_compiled 90 "$PY" benchmarks/profile_step.py --cfg configs/vit_b16.yaml \
        "${PROFILE_FLAGS[@]}" OUT_DIR "$PHASE_DIR/profile_b16_compiled" "${SYNTHETIC[@]}" \
        "${PROFILE_B16[@]}" \
        TRAIN.COMPILE "$([ "$REHEARSE" = 1 ] && echo False || echo True)"
    end_phase phase2
}

phase3() {
    begin_phase phase3
    step time_h14 180 "$PY" tools/run_net.py --mode time --cfg configs/vit_h16.yaml \
        OUT_DIR "$PHASE_DIR/time_h14" "${SYNTHETIC[@]}" AMP.LEVEL O2 AMP.DTYPE bfloat16 \
        OPTIM.CONTIGUOUS_PARAMS True "${TIME_H14[@]}"
    step loader 150 "$PY" benchmarks/loader_speed.py --work /tmp/gpu_campaign_loader \
        "${LOADER[@]}" --out "$PHASE_DIR/loader/loader.md"
    step bench_h14 210 "$PY" benchmarks/vs_libraries.py "${BENCH_H14[@]}" --out "$PHASE_DIR/bench_h14"
    end_phase phase3
}

phase4() {
    begin_phase phase4
    if wanted cnn_zoo && [ "$DRY" = 0 ] && [ ! -f "$UPSTREAM_PYCLS/pycls/models/anynet.py" ]; then
        echo "== cnn_zoo: skipped, no upstream pycls checkout at $UPSTREAM_PYCLS (UPSTREAM_PYCLS)"
        printf 'cnn_zoo\tskipped\t0\t0\n' >>"$PHASE_DIR/steps.tsv"
    else
        step cnn_zoo 300 "$PY" benchmarks/vs_upstream.py --upstream "$UPSTREAM_PYCLS" \
            "${CNN_ZOO[@]}"
    fi
    end_phase phase4
}

for phase in "${PHASES[@]}"; do
    case $phase in
        wheels) download_wheels || exit 1 ;;
        report) install_wheels >/dev/null 2>&1; "$PY" benchmarks/campaign_report.py "$RESULTS" ;;
        *)
            if [ "$DRY" = 0 ]; then install_wheels || exit 1; fi
            "$phase"
            ;;
    esac
done
