#!/usr/bin/env bash
# The GPU campaign: every measurement behind the GPU speed targets (BENCHMARKS.md), in one
# command, on a machine with one NVIDIA H100 or H200, each step under its own time limit.
#
#   bash benchmarks/gpu_campaign.sh [OPTIONS] OUTDIR
#
# Install first, from the repository root: pip install -e '.[dev]' (pytest and timm included).
# The campaign measures this checkout's code (it goes first on PYTHONPATH) and writes everything
# to OUTDIR: one folder per phase, and at the end OUTDIR/summary.md (benchmarks/campaign_report.py:
# each target measured, its goal, met or not), which it also prints.
#
# Phases, in order (default: all of them), and the steps each runs:
#   peak     peak: matmul TFLOP/s, copy bandwidth, AdamW step against its memory floor
#            (benchmarks/gpu_peak.py)
#   tests    pytest_gpu: pytest -m gpu (engines on one GPU, nvJPEG, GPU augmentation, 20 training
#            steps without a host-device sync)
#   vit_b16  profile_b16 (benchmarks/profile_step.py), bench_b16 (benchmarks/vs_libraries.py:
#            libraries, libraries at their best, ablation), time_b16 (--mode time, compiled),
#            profile_b16_compiled
#   vit_h14  time_h14 (--mode time, compiled), bench_h14 (benchmarks/vs_libraries.py, eager)
#   loader   loader: raw shards + GPU augmentation, JPEG shards + nvJPEG, the CPU paths
#            (benchmarks/loader_speed.py)
#   amp      amp: the quickstart under O0 and O1/O2/O3 x bfloat16/float16, all at once
#   tensor   tensor_parallel: ViT-g/14 under TRAIN.PARALLEL tensor at MESH.TP 1, 2, 4, 8 (as many
#            as the GPUs allow): memory per GPU and step time (benchmarks/tensor_parallel.py);
#            on a machine with one GPU it is skipped, saying so
#   fewer_tokens
#            tokens: ViT-S/16 and ViT-B/16 training steps with patch dropout (keep 0.5, 0.25),
#            drop-path skip (0.1, 0.3, 0.5) and packed against padded token batches, each against
#            its reference (benchmarks/fewer_tokens.py, bf16); tokens_compiled: the packing table
#            with compiled blocks (FlexAttention's block masks)
#   cnn_zoo  cnn_zoo: RegNetY-4.0GF and ResNet-50 against upstream pycls's code and timm's
#            (benchmarks/vs_upstream.py; needs --upstream, else skipped, saying so)
#   recipes  float8: ViT-B/16, ViT-L/16 and ViT-H/14 compiled (--mode time, O2 bfloat16), each
#            without float8 and with AMP.FLOAT8 tensorwise and rowwise over every block layer
#            (AMP.FLOAT8_MIN_DIM 0); distill: DeiT-B distilled's step with and without its
#            RegNetY-16GF teacher, compiled (benchmarks/distill_step.py)
#   levers   the levers of the ViT step (benchmarks/gpu_short.sh runs this phase alone):
#            ceilings (matmul, copy: benchmarks/gpu_peak.py), attention (SDPA backends at ViT
#            shapes: benchmarks/attention_backends.py), optim_rows (AdamW and the O2 master
#            update against their floors, one pass included), ab_b16 (benchmarks/step_ab.py:
#            ViT-B/16 trainer step O1 and its levers, O2 with the one pass, the parallel block
#            and bias-free layers, timm and torchvision at their best, a profile), ab_h14 (ViT-H/14 O2 batch 64: bf16, float8 all, float8
#            auto), ab_l16 (ViT-L/16 O2 batch 128: bf16, float8 MLP, float8 auto)
#
# Options:
#   --phases LIST          comma-separated phases to run (default: all, in the order above)
#   --steps LIST           comma-separated steps to run within those phases (default: all)
#   --budget-minutes N     the whole campaign's time limit: a step gets at most what is left,
#                          and steps are skipped once it is spent (default: no limit beyond the
#                          phases' own)
#   --budget-seconds N     the same in seconds
#   --phase-minutes SPEC   a phase's time limit, NAME=N for one phase or N for every phase
#                          (repeatable). A phase's steps share its time in fixed proportions, so
#                          a longer limit gives each step longer. Defaults: peak 2, tests 5,
#                          vit_b16 11, vit_h14 7, loader 3, amp 3, tensor 5, fewer_tokens 20,
#                          cnn_zoo 5, recipes 19, levers 9 (89 in all)
#   --phase-seconds SPEC   the same in seconds
#   --no-report            leave out the summary at the end (benchmarks/gpu_short.sh writes its
#                          own)
#   --upstream DIR         a checkout of facebookresearch/pycls for cnn_zoo (default:
#                          $UPSTREAM_PYCLS): git clone https://github.com/facebookresearch/pycls DIR
#   --b16-batch N          ViT-B/16 batch (256)
#   --h14-batch N          ViT-H/14 batch of benchmarks/vs_libraries.py (32)
#   --h14-time-batch N     ViT-H/14 batch of --mode time (64)
#   --h14-time-opts OPTS   more "KEY VALUE ..." overrides for that --mode time run, e.g.
#                          "VIT.CHECKPOINT_BLOCKS 8"
#   --rehearse             every step on the CPU at tiny sizes (automatic without CUDA; 2 to 6
#                          minutes on two idle cores): checks the machinery, measures nothing;
#                          its time limits grow with the load average over the CPUs (a GPU
#                          run keeps its own)
#   --dry-run              print each step's time limit and command (the GPU sizes unless
#                          --rehearse), run nothing; steps the budget would skip say so
#   -h, --help             this text
#
# Each phase folder OUTDIR/PHASE/ holds env.txt (date, git revision, load average, GPU, package
# versions, nvidia-smi), steps.tsv (step, exit status - 124: stopped at its time limit -,
# seconds, limit; appended to when a step runs again) and, per step, NAME.log and a folder NAME/
# (emptied when the step runs again) with the tool's tables and json_stats lines. Runs of single
# steps into another OUTDIR can be copied below the first: the report reads every folder below
# OUTDIR. The exit status is 0 when every step that ran exited 0, 1 otherwise, 2 for a usage
# error. Environment: PYTHON (python3), UPSTREAM_PYCLS, LOADAVG_FILE (/proc/loadavg: the load a
# rehearsal's limits grow with).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
PY=${PYTHON:-python3}

ALL_PHASES=(peak tests vit_b16 vit_h14 loader amp tensor fewer_tokens cnn_zoo recipes levers)
declare -A PHASE_STEPS=(
    [peak]="peak"
    [tests]="pytest_gpu"
    [vit_b16]="profile_b16 bench_b16 time_b16 profile_b16_compiled"
    [vit_h14]="time_h14 bench_h14"
    [loader]="loader"
    [amp]="amp"
    [tensor]="tensor_parallel"
    [fewer_tokens]="tokens tokens_compiled"
    [cnn_zoo]="cnn_zoo"
    [recipes]="float8 distill"
    [levers]="ceilings attention optim_rows ab_b16 ab_h14 ab_l16"
)
# Each step's share of its phase, in seconds at the default phase limit
declare -A STEP_SECONDS=(
    [peak]=120 [pytest_gpu]=300
    [profile_b16]=90 [bench_b16]=300 [time_b16]=180 [profile_b16_compiled]=90
    [time_h14]=210 [bench_h14]=210 [loader]=180 [amp]=180 [tensor_parallel]=300 [tokens]=720
    [tokens_compiled]=480 [cnn_zoo]=300 [float8]=720 [distill]=420
    [ceilings]=20 [attention]=25 [optim_rows]=45 [ab_b16]=190 [ab_h14]=120 [ab_l16]=140
)
declare -A PHASE_LIMIT_S=()

die() {
    echo "gpu_campaign.sh: $*" >&2
    exit 2
}

is_count() { [[ $1 =~ ^[1-9][0-9]*$ ]]; }

is_phase() {
    local p
    for p in "${ALL_PHASES[@]}"; do [ "$p" = "$1" ] && return 0; done
    return 1
}

# set_phase_limit OPTION SECONDS_PER_UNIT SPEC: --phase-minutes (60) or --phase-seconds (1)
set_phase_limit() {
    local option=$1 unit=$2 spec=$3 name minutes p
    if [[ $spec == *=* ]]; then
        name=${spec%%=*} minutes=${spec#*=}
        is_phase "$name" || die "$option: no phase '$name' (phases: ${ALL_PHASES[*]})"
        is_count "$minutes" || die "$option $spec: ${option#--phase-} must be a positive integer"
        PHASE_LIMIT_S[$name]=$((minutes * unit))
    else
        is_count "$spec" || die "$option $spec: give N or NAME=N (N a positive integer)"
        for p in "${ALL_PHASES[@]}"; do PHASE_LIMIT_S[$p]=$((spec * unit)); done
    fi
}

need_value() { [ $# -ge 2 ] && [ -n "$2" ] || die "$1 needs a value (see --help)"; }

RESULTS=
PHASES_ARG=
STEPS_ARG=
BUDGET_S=
UPSTREAM=${UPSTREAM_PYCLS:-}
B16_BATCH=256
H14_BATCH=32
H14_TIME_BATCH=64
H14_TIME_OPTS=
REHEARSE=0
DRY=0
REPORT=1
while [ $# -gt 0 ]; do
    case $1 in
        -h | --help)
            sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'
            exit 0
            ;;
        --rehearse) REHEARSE=1 ;;
        --dry-run) DRY=1 ;;
        --phases) need_value "$@"; PHASES_ARG=$2; shift ;;
        --steps) need_value "$@"; STEPS_ARG=$2; shift ;;
        --budget-minutes)
            need_value "$@"
            is_count "$2" || die "--budget-minutes $2: give a positive integer"
            BUDGET_S=$(($2 * 60)); shift ;;
        --budget-seconds)
            need_value "$@"
            is_count "$2" || die "--budget-seconds $2: give a positive integer"
            BUDGET_S=$2; shift ;;
        --phase-minutes) need_value "$@"; set_phase_limit "$1" 60 "$2"; shift ;;
        --phase-seconds) need_value "$@"; set_phase_limit "$1" 1 "$2"; shift ;;
        --no-report) REPORT=0 ;;
        --upstream) need_value "$@"; UPSTREAM=$2; shift ;;
        --b16-batch) need_value "$@"; is_count "$2" || die "--b16-batch $2"; B16_BATCH=$2; shift ;;
        --h14-batch) need_value "$@"; is_count "$2" || die "--h14-batch $2"; H14_BATCH=$2; shift ;;
        --h14-time-batch)
            need_value "$@"; is_count "$2" || die "--h14-time-batch $2"; H14_TIME_BATCH=$2; shift ;;
        --h14-time-opts) need_value "$@"; H14_TIME_OPTS=$2; shift ;;
        -*) die "unknown option '$1' (see --help)" ;;
        *)
            [ -z "$RESULTS" ] || die "one OUTDIR only (got '$RESULTS' and '$1')"
            RESULTS=$1
            ;;
    esac
    shift
done
[ -n "$RESULTS" ] || die "name the output folder: bash benchmarks/gpu_campaign.sh OUTDIR"

PHASES=()
if [ -n "$PHASES_ARG" ]; then
    IFS=, read -ra PHASES <<<"$PHASES_ARG"
    for p in "${PHASES[@]}"; do
        is_phase "$p" || die "--phases: no phase '$p' (phases: ${ALL_PHASES[*]})"
    done
else
    PHASES=("${ALL_PHASES[@]}")
fi
STEPS=()
if [ -n "$STEPS_ARG" ]; then
    IFS=, read -ra STEPS <<<"$STEPS_ARG"
    for s in "${STEPS[@]}"; do
        [ -n "${STEP_SECONDS[$s]:-}" ] || die "--steps: no step '$s' (steps: ${!STEP_SECONDS[*]})"
    done
fi

phase_default_s() {
    local s total=0
    for s in ${PHASE_STEPS[$1]}; do total=$((total + STEP_SECONDS[$s])); done
    echo "$total"
}

# --------------------------------------------------------------------------------------------- #
# Running steps
# --------------------------------------------------------------------------------------------- #
CAMPAIGN_START=$(date +%s)
DRY_ELAPSED=0 # a dry run advances its clock by each step's full limit
PHASE=
PHASE_DIR=
PHASE_START=
FAILED=0

now() {
    if [ "$DRY" = 1 ]; then echo $((CAMPAIGN_START + DRY_ELAPSED)); else date +%s; fi
}

wanted() {
    [ ${#STEPS[@]} -eq 0 ] && return 0
    local s
    for s in "${STEPS[@]}"; do [ "$s" = "$1" ] && return 0; done
    return 1
}

skip() { # skip NAME REASON
    if [ "$DRY" = 1 ]; then
        echo "SKIP $1: $2"
        return 0
    fi
    echo "== $1: skipped, $2"
    printf '%s\tskipped\t0\t0\n' "$1" >>"$PHASE_DIR/steps.tsv"
}

# The rehearsal's time limits in percent of the GPU run's: its work is what the machine's other
# load leaves it, so they grow with the load average over the CPUs (at least 100: an idle
# machine). A GPU run keeps its limits whatever the host's load. LOADAVG_FILE: where the load
# average is read (/proc/loadavg).
load_percent() {
    [ "$REHEARSE" = 1 ] || { echo 100; return 0; }
    local load cpus
    load=$(cut -d' ' -f1 "${LOADAVG_FILE:-/proc/loadavg}" 2>/dev/null) || load=0
    cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null) || cpus=1 # (nproc obeys OMP)
    awk -v l="${load:-0}" -v c="$cpus" 'BEGIN { p = int(100 * l / c); print (p > 100 ? p : 100) }'
}

# step NAME CMD...: runs CMD under `timeout` with a fresh PHASE_DIR/NAME/ for its files, output
# to PHASE_DIR/NAME.log, and appends "NAME status seconds limit" to PHASE_DIR/steps.tsv. Its
# limit: its share of the phase's limit, at most what is left of the phase and of the budget;
# in a rehearsal all three grow with the machine's load (load_percent). An argument
# @DEADLINE_S@ becomes the limit less a margin, for tools that stop by themselves in time to
# write their tables (benchmarks/step_ab.py --deadline-s)
step() {
    local name=$1
    shift
    wanted "$name" || return 0
    local t0 limit left pct
    t0=$(now)
    pct=$(load_percent)
    limit=$((STEP_SECONDS[$name] * PHASE_LIMIT_S[$PHASE] / $(phase_default_s "$PHASE") * pct / 100))
    left=$((PHASE_START + PHASE_LIMIT_S[$PHASE] * pct / 100 - t0))
    [ "$limit" -gt "$left" ] && limit=$left
    if [ -n "$BUDGET_S" ]; then
        left=$((CAMPAIGN_START + BUDGET_S * pct / 100 - t0))
        [ "$limit" -gt "$left" ] && limit=$left
    fi
    if [ "$limit" -lt 15 ]; then
        skip "$name" "less than 15 s of the phase's or the campaign's time is left"
        return 0
    fi
    local args=() a
    for a in "$@"; do
        [ "$a" = "@DEADLINE_S@" ] && a=$((limit > 40 ? limit - 15 : limit * 2 / 3))
        args+=("$a")
    done
    set -- "${args[@]}"
    if [ "$DRY" = 1 ]; then
        printf 'STEP %s %ss:' "$name" "$limit"
        printf ' %q' "$@"
        echo
        DRY_ELAPSED=$((DRY_ELAPSED + limit))
        return 0
    fi
    rm -rf "${PHASE_DIR:?}/$name"
    mkdir -p "$PHASE_DIR/$name"
    echo "== $name (limit ${limit}s): $*"
    local rc
    timeout -k 10 "$limit" "$@" >"$PHASE_DIR/$name.log" 2>&1
    rc=$?
    [ "$rc" = 0 ] || FAILED=1
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - t0))" "$limit" \
        >>"$PHASE_DIR/steps.tsv"
    echo "   exit status $rc after $(($(date +%s) - t0))s; last lines:"
    tail -n 3 "$PHASE_DIR/$name.log" | cut -c1-200 | sed 's/^/   | /'
}

write_env() {
    {
        echo "date_utc: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
        echo "host: $(hostname)"
        echo "load_average: $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo unknown)"
        echo "rehearsal: $REHEARSE"
        echo "cpus: $(nproc --all)"
        echo "pythonpath: ${PYTHONPATH:-}"
        "$PY" - <<'EOF'
import importlib.metadata, torch
from pycls.core import timing
print(f"git: {timing.source_revision()}")
print(f"torch: {torch.__version__} (cuda {torch.version.cuda})")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"gpu: {p.name}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs")
for name in ("torchvision", "timm", "torchao", "yacs", "iopath", "simplejson", "fairscale",
             "submitit", "numpy"):
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
    PHASE=$1
    PHASE_DIR=$RESULTS/$1
    [ -n "${PHASE_LIMIT_S[$1]:-}" ] || PHASE_LIMIT_S[$1]=$(phase_default_s "$1")
    if [ "$DRY" = 1 ]; then
        PHASE_START=$(now)
        echo "PHASE $1 ${PHASE_LIMIT_S[$1]}s"
        return 0
    fi
    mkdir -p "$PHASE_DIR"
    write_env
    PHASE_START=$(now) # the phase's time is its steps'
    local what
    what=$(sed -n 's/^gpu: //p; s/^torch: //p' "$PHASE_DIR/env.txt" | paste -sd' ')
    echo "### $1 (limit ${PHASE_LIMIT_S[$1]}s) -> $PHASE_DIR ($what)"
}

end_phase() {
    [ "$DRY" = 1 ] && return 0
    echo "### $PHASE done in $(($(date +%s) - PHASE_START))s"
}

# --------------------------------------------------------------------------------------------- #
# Sizes: the GPU run, or the CPU rehearsal
# --------------------------------------------------------------------------------------------- #
if [ "$DRY" = 0 ]; then
    export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
    CUDA=$("$PY" -c "import pycls.core.timing, yacs, torch; print(int(torch.cuda.is_available()))" \
        2>/dev/null) ||
        die "pycls cannot be imported with $PY: install it with pip install -e '.[dev]' from $ROOT"
    # a dry run shows the GPU run's commands unless --rehearse asks for the rehearsal's
    if [ "$REHEARSE" = 0 ] && [ "$CUDA" != 1 ]; then
        echo "no CUDA device: rehearsing on the CPU at tiny sizes (nothing here measures a GPU)"
        REHEARSE=1
    fi
fi
# The block levers of ViT-B/16's A/B, at its FLOPs (benchmarks/block_speed.py on the CPU): the
# parallel block (attention and MLP from one norm, their projections fused) and bias-free layers
PARALLEL_BLOCK="VIT.BLOCK parallel"
BIAS_FREE="VIT.QKV_BIAS False VIT.PROJ_BIAS False"
# A 2-block, 64-wide ViT at 32 px (benchmarks/vs_libraries.py --tiny's size) for config-driven tools
TINY_VIT=(MODEL.ARCH "" VIT.PATCH_SIZE 8 VIT.DEPTH 2 VIT.WIDTH 64 VIT.NUM_HEADS 2 VIT.MLP_DIM 128
          TRAIN.IM_SIZE 32 TEST.IM_SIZE 32 DEVICE cpu DATA_LOADER.NUM_WORKERS 0)
if [ "$REHEARSE" = 1 ]; then
    export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
    # the one-pass rows compile for tens of seconds on a CPU: tests/benchmarks/test_gpu_campaign.py runs one
    PEAK_ARGS=(--tiny --iters 3 --warmup 1 --optimizers torch_fused torch_foreach pycls_per_tensor
               pycls_contiguous o2_contiguous)
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
    TENSOR=(--tiny --tp 1 2 --steps 1)
    TOKENS=(--tiny --amps O1 --batch-size 8 --rounds 1 --iters 1 --warmup 0)
    TOKENS_COMPILED=(--tables packing)  # compiling on the CPU would take the rehearsal's time
    COMPILED=False
    # float8 is refused on a CPU: the rehearsal runs the bfloat16 rows only
    FLOAT8_MODES="none"
    FLOAT8_ARCHS="vit_b16"
    FLOAT8_ARGS=("${TIME_ARGS[@]}" TRAIN.COMPILE False)
    DISTILL=(--cfg configs/quickstart_distilled.yaml --teacher cfg:configs/quickstart_regnet.yaml
             --amp O1 --rounds 1 --iters 2 --warmup 1)
    CEILINGS=(--tiny --iters 3 --warmup 1)
    ATTENTION=(--tiny --iters 2 --samples 1 --warmup 1)
    OPTIM_ROWS=(--tiny --iters 3 --warmup 1 --optimizers torch_fused pycls_contiguous o2_contiguous)
    AB=(--tiny --rounds 1 --iters 1 --warmup 1)
    AB_BIG=("${AB[@]}")
    AB_COMPILE=False
    # the one pass compiles for tens of seconds on a CPU (tests/optim/test_one_pass.py runs it there)
    B16_LEVERS=(--variant o1_bf16_residual "AMP.LEVEL O1 AMP.RESIDUAL_DTYPE bfloat16"
                --variant o2 "AMP.LEVEL O2" --variant o1_parallel "AMP.LEVEL O1 $PARALLEL_BLOCK"
                --variant o1_bias_free "AMP.LEVEL O1 $BIAS_FREE")
else
    PEAK_ARGS=()
    PROFILE_FLAGS=(--steps 5 --warmup 5)
    PROFILE_B16=(TRAIN.BATCH_SIZE "$B16_BATCH")
    AMP_LEVELS="O0/bfloat16 O1/bfloat16 O2/bfloat16 O3/bfloat16 O1/float16 O2/float16 O3/float16"
    AMP_ARGS=()
    BENCH_B16=(--arch vit_b16 --batch-size "$B16_BATCH" --iters 30 --warmup 10)
    TIME_B16=(TRAIN.BATCH_SIZE "$B16_BATCH" TRAIN.COMPILE True PREC_TIME.NUM_ITER 30
              PREC_TIME.WARMUP_ITER 10)
    # shellcheck disable=SC2206  # --h14-time-opts: KEY VALUE pairs, split on purpose
    TIME_H14=(MODEL.ARCH vit_h14 TRAIN.BATCH_SIZE "$H14_TIME_BATCH" TRAIN.COMPILE True
              PREC_TIME.NUM_ITER 15 PREC_TIME.WARMUP_ITER 5 $H14_TIME_OPTS)
    BENCH_H14=(--arch vit_h14 --batch-size "$H14_BATCH" --iters 15 --warmup 5 --skip-compile
               --tables libraries ablation)
    LOADER=(--num-images 2048 --batch-size 256 --workers 16 --epochs 2 --repeats 2)
    CNN_ZOO=(--models RegNetY-4.0GF ResNet-50 --device cuda --amp bf16 --channels-last --timm
             --batch 256 --pairs 20 --warmup 5)
    TENSOR=(--device cuda --arch vit_g14 --batch 32 --amp O1 --steps 5)
    TOKENS=(--device cuda --archs vit_b16 vit_s16 --amps O1 --batch-size 128 --rounds 2
            --iters 10 --warmup 5)
    TOKENS_COMPILED=(--tables packing --compile)
    COMPILED=True
    FLOAT8_MODES="none tensorwise rowwise"
    FLOAT8_ARCHS="vit_b16 vit_l16 vit_h14"
    FLOAT8_ARGS=(TRAIN.COMPILE True PREC_TIME.NUM_ITER 15 PREC_TIME.WARMUP_ITER 5)
    DISTILL=(--cfg configs/deit_b16_distilled.yaml --teacher zoo:RegNetY-16GF --amp O1
             --batch-size "$B16_BATCH" --device cuda --compile --rounds 2 --iters 20 --warmup 5)
    CEILINGS=()
    ATTENTION=()
    OPTIM_ROWS=(--optimizers torch_fused pycls_contiguous pycls_one_pass o2_contiguous o2_one_pass
                o2_one_pass_ema)
    AB=(--rounds 3 --iters 10 --warmup 5)
    AB_BIG=(--rounds 2 --iters 5 --warmup 3)  # ViT-H/14, ViT-L/16: longer steps, fewer
    AB_COMPILE=True
    B16_LEVERS=(--variant o1_one_pass "AMP.LEVEL O1 OPTIM.ONE_PASS True"
                --variant o1_bf16_residual "AMP.LEVEL O1 AMP.RESIDUAL_DTYPE bfloat16"
                --variant o1_coordinate_descent "AMP.LEVEL O1 TRAIN.COMPILE_COORDINATE_DESCENT True"
                --variant o2_one_pass "AMP.LEVEL O2 OPTIM.ONE_PASS True"
                --variant o1_parallel "AMP.LEVEL O1 $PARALLEL_BLOCK"
                --variant o1_bias_free "AMP.LEVEL O1 $BIAS_FREE")
fi
SYNTHETIC=(TRAIN.DATASET synthetic TEST.DATASET synthetic)
# The profiled step is the one --mode time measures: O1 bfloat16 (vit_b16.yaml), contiguous AdamW
PROFILE_B16=(OPTIM.CONTIGUOUS_PARAMS True "${PROFILE_B16[@]}")
LOADER_WORK=${TMPDIR:-/tmp}/pycls_campaign_loader

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

# --mode time of each ViT without float8 and with each float8 recipe, one after the other (each
# row survives a time limit reached later); every block layer converted: AMP.FLOAT8_MIN_DIM's
# default leaves all of these ViTs' layers (sides 768-5120) in bfloat16
float8_times() {
    local dir=$1 rc=0 arch mode cfg batch
    shift
    declare -A batch_of=([vit_b16]=256 [vit_l16]=128 [vit_h14]=64)
    for arch in $FLOAT8_ARCHS; do
        cfg=configs/${arch/h14/h16}.yaml batch=${batch_of[$arch]}
        for mode in $FLOAT8_MODES; do
            "$PY" tools/run_net.py --mode time --cfg "$cfg" OUT_DIR "$dir/${arch}_$mode" \
                MODEL.ARCH "$arch" TRAIN.DATASET synthetic TEST.DATASET synthetic \
                TRAIN.BATCH_SIZE "$batch" AMP.LEVEL O2 AMP.DTYPE bfloat16 \
                AMP.FLOAT8 "$mode" AMP.FLOAT8_MIN_DIM 0 "$@" >"$dir/${arch}_$mode.log" 2>&1 ||
                rc=1
        done
    done
    return $rc
}
export -f float8_times
export FLOAT8_MODES FLOAT8_ARCHS

# --------------------------------------------------------------------------------------------- #
# Phases
# --------------------------------------------------------------------------------------------- #
phase_peak() {
    step peak "$PY" benchmarks/gpu_peak.py --out "$PHASE_DIR/peak" "${PEAK_ARGS[@]}"
}

phase_tests() {
    step pytest_gpu "$PY" -m pytest -m gpu -q -ra -p no:cacheprovider tests \
        --junitxml="$PHASE_DIR/pytest_gpu/pytest_gpu.xml"
}

phase_vit_b16() {
    step profile_b16 "$PY" benchmarks/profile_step.py --cfg configs/vit_b16.yaml \
        "${PROFILE_FLAGS[@]}" OUT_DIR "$PHASE_DIR/profile_b16" "${SYNTHETIC[@]}" "${PROFILE_B16[@]}"
    step bench_b16 "$PY" benchmarks/vs_libraries.py "${BENCH_B16[@]}" --out "$PHASE_DIR/bench_b16"
    step time_b16 "$PY" tools/run_net.py --mode time --cfg configs/vit_b16.yaml \
        OUT_DIR "$PHASE_DIR/time_b16" "${SYNTHETIC[@]}" AMP.LEVEL O1 AMP.DTYPE bfloat16 \
        OPTIM.CONTIGUOUS_PARAMS True "${TIME_B16[@]}"
    step profile_b16_compiled "$PY" benchmarks/profile_step.py --cfg configs/vit_b16.yaml \
        "${PROFILE_FLAGS[@]}" OUT_DIR "$PHASE_DIR/profile_b16_compiled" "${SYNTHETIC[@]}" \
        "${PROFILE_B16[@]}" TRAIN.COMPILE "$COMPILED"
}

phase_vit_h14() {
    step time_h14 "$PY" tools/run_net.py --mode time --cfg configs/vit_h16.yaml \
        OUT_DIR "$PHASE_DIR/time_h14" "${SYNTHETIC[@]}" AMP.LEVEL O2 AMP.DTYPE bfloat16 \
        OPTIM.CONTIGUOUS_PARAMS True "${TIME_H14[@]}"
    step bench_h14 "$PY" benchmarks/vs_libraries.py "${BENCH_H14[@]}" --out "$PHASE_DIR/bench_h14"
}

phase_loader() {
    step loader "$PY" benchmarks/loader_speed.py --work "$LOADER_WORK" "${LOADER[@]}" \
        --out "$PHASE_DIR/loader/loader.md"
}

phase_amp() {
    step amp bash -c 'amp_levels "$@"' amp_levels "$PHASE_DIR/amp" "${AMP_ARGS[@]}"
}

# The tensor-parallel degrees this machine's GPUs allow: 1, 2, 4, 8 up to their number (8 in a
# dry run, which shows the run of a machine with 8)
tp_degrees() {
    local gpus=8 d degrees=()
    if [ "$DRY" = 0 ]; then
        gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
    fi
    for d in 1 2 4 8; do [ "$d" -le "$gpus" ] && degrees+=("$d"); done
    echo "${degrees[*]}"
}

phase_tensor() {
    wanted tensor_parallel || return 0
    if [ "$REHEARSE" = 1 ]; then
        step tensor_parallel "$PY" benchmarks/tensor_parallel.py "${TENSOR[@]}" \
            --out "$PHASE_DIR/tensor_parallel"
        return 0
    fi
    local degrees
    degrees=$(tp_degrees)
    if [ "$degrees" = "1" ] || [ -z "$degrees" ]; then
        skip tensor_parallel "this machine has one GPU: tensor parallelism needs several"
        return 0
    fi
    # shellcheck disable=SC2086  # the degrees, one argument each
    step tensor_parallel "$PY" benchmarks/tensor_parallel.py "${TENSOR[@]}" --tp $degrees \
        --out "$PHASE_DIR/tensor_parallel"
}

phase_fewer_tokens() {
    step tokens "$PY" benchmarks/fewer_tokens.py "${TOKENS[@]}" --out "$PHASE_DIR/tokens"
    step tokens_compiled "$PY" benchmarks/fewer_tokens.py "${TOKENS[@]}" "${TOKENS_COMPILED[@]}" \
        --out "$PHASE_DIR/tokens_compiled"
}

phase_cnn_zoo() {
    wanted cnn_zoo || return 0
    if [ -z "$UPSTREAM" ]; then
        skip cnn_zoo "no upstream pycls checkout (--upstream DIR or UPSTREAM_PYCLS)"
    elif [ "$DRY" = 0 ] && [ ! -f "$UPSTREAM/pycls/models/anynet.py" ]; then
        skip cnn_zoo "$UPSTREAM holds no upstream pycls checkout (pycls/models/anynet.py)"
    else
        step cnn_zoo "$PY" benchmarks/vs_upstream.py --upstream "$UPSTREAM" "${CNN_ZOO[@]}"
    fi
}

phase_recipes() {
    step float8 bash -c 'float8_times "$@"' float8_times "$PHASE_DIR/float8" "${FLOAT8_ARGS[@]}"
    step distill "$PY" benchmarks/distill_step.py "${DISTILL[@]}" --out "$PHASE_DIR/distill"
}

# The levers of the ViT step, each variant one process's A/B (benchmarks/step_ab.py): what each
# measures and predicts is in docs/benchmarks.md and the summary
AB_COMMON="OPTIM.CONTIGUOUS_PARAMS True AMP.DTYPE bfloat16 TRAIN.COMPILE $AB_COMPILE"
FLOAT8="AMP.FLOAT8 tensorwise AMP.FLOAT8_MIN_DIM 0 AMP.FLOAT8_LAYERS"  # + all or mlp
FLOAT8_AUTO="$FLOAT8 auto"  # auto chooses among what FLOAT8_MIN_DIM 0 lets in
phase_levers() {
    step ceilings "$PY" benchmarks/gpu_peak.py --out "$PHASE_DIR/ceilings" "${CEILINGS[@]}" \
        --optimizers
    step attention "$PY" benchmarks/attention_backends.py "${ATTENTION[@]}" \
        --out "$PHASE_DIR/attention"
    step optim_rows "$PY" benchmarks/gpu_peak.py --out "$PHASE_DIR/optim_rows" "${OPTIM_ROWS[@]}"
    step ab_b16 "$PY" benchmarks/step_ab.py --cfg configs/vit_b16.yaml "${AB[@]}" \
        --opts "$AB_COMMON TRAIN.BATCH_SIZE $B16_BATCH" \
        --variant o1 "AMP.LEVEL O1" "${B16_LEVERS[@]}" --timm --torchvision --profile o1 \
        --deadline-s @DEADLINE_S@ --out "$PHASE_DIR/ab_b16"
    step ab_h14 "$PY" benchmarks/step_ab.py --cfg configs/vit_h16.yaml "${AB_BIG[@]}" \
        --opts "$AB_COMMON MODEL.ARCH vit_h14 AMP.LEVEL O2 TRAIN.BATCH_SIZE 64" \
        --variant bf16 "" --variant float8_all "$FLOAT8 all" --variant float8_auto "$FLOAT8_AUTO" \
        --deadline-s @DEADLINE_S@ --out "$PHASE_DIR/ab_h14"
    step ab_l16 "$PY" benchmarks/step_ab.py --cfg configs/vit_l16.yaml "${AB_BIG[@]}" \
        --opts "$AB_COMMON MODEL.ARCH vit_l16 AMP.LEVEL O2 TRAIN.BATCH_SIZE 128" \
        --variant bf16 "" --variant float8_mlp "$FLOAT8 mlp" --variant float8_auto "$FLOAT8_AUTO" \
        --deadline-s @DEADLINE_S@ --out "$PHASE_DIR/ab_l16"
}

[ "$DRY" = 1 ] || mkdir -p "$RESULTS" || die "cannot create $RESULTS"
for phase in "${PHASES[@]}"; do
    begin_phase "$phase"
    "phase_$phase"
    end_phase
done
[ "$DRY" = 1 ] && exit 0
[ "$REPORT" = 1 ] || exit $FAILED
"$PY" benchmarks/campaign_report.py "$RESULTS" >"$RESULTS/report.log" 2>&1 ||
    { echo "the report failed: see $RESULTS/report.log"; exit 1; }
cat "$RESULTS/summary.md"
echo "campaign done in $(($(date +%s) - CAMPAIGN_START))s: $RESULTS/summary.md"
exit $FAILED
