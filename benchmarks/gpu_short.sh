#!/usr/bin/env bash
# The levers of the ViT training step measured in one command with a deadline, on one NVIDIA H100
# or H200: does pycls beat timm, and which lever pays? (docs/benchmarks.md)
#
#   bash benchmarks/gpu_short.sh [OPTIONS] OUTDIR
#
# Steps, in this order, each under its share of the deadline (at the default 540 s: 20, 25, 45,
# 190, 120 and 140 s), skipped once the deadline is spent:
#   ceilings    8192^3 bf16 matmul and device copy bandwidth (benchmarks/gpu_peak.py)
#   attention   SDPA's backends at ViT-B/16, ViT-L/16 and ViT-H/14 shapes, forward and backward,
#               and the one torch picks (benchmarks/attention_backends.py)
#   optim_rows  AdamW and the O2 master update over ViT-H/14's parameters against their memory
#               floor: torch fused, pycls contiguous, the one pass (benchmarks/gpu_peak.py)
#   ab_b16      ViT-B/16 batch 256, one process (benchmarks/step_ab.py): the trainer's step O1,
#               with the one optimizer pass, the bf16 residual stream, coordinate-descent tuning;
#               O2 with the one pass; the parallel block and bias-free layers (other models at
#               the same FLOPs); timm and torchvision at their best doing the same work; a
#               profile by category
#   ab_h14      ViT-H/14 O2 batch 64: bf16, float8 on every layer, float8 auto
#   ab_l16      ViT-L/16 O2 batch 128: bf16, float8 on the MLP, float8 auto
# These are the steps of benchmarks/gpu_campaign.sh's phase levers, which this script runs.
#
# At the end OUTDIR holds two files: summary.md (every target: measured, predicted, goal, met /
# NOT met / not reached; then each tool's table), which it also prints, and gpu_short.tar.gz
# (everything else: env.txt, steps.tsv, each step's log, tables and json).
#
# Options:
#   --deadline-s N   the whole run's time limit in seconds, the summary and archive included
#                    (default 540)
#   --wheels DIR     install the wheels in DIR first (pip install --no-index --no-deps into a
#                    folder put first on PYTHONPATH, removed at the end): for a node without
#                    network access that lacks pycls's requirements. Build DIR where pip works:
#                      pip wheel --no-deps -w DIR yacs simplejson iopath portalocker timm \
#                          huggingface_hub safetensors "torchao==VERSION"
#                    (VERSION: the torchao built for the node's torch; leave out what the node has)
#   --steps LIST     only these steps (comma-separated, in the order above), e.g. ab_b16 again
#   --rehearse       every step on the CPU at tiny sizes (automatic without CUDA): checks the
#                    machinery, measures nothing; each step's share, and the deadline, grow
#                    with the machine's load average over its CPUs (a GPU run keeps its
#                    deadline)
#   --dry-run        print each step's limit and command, run nothing
#   -h, --help       this text
#
# Run it from the root of a git checkout (the results cite its revision) with pycls's
# requirements installed (pip install -e '.[dev]'), or with --wheels on an offline node. Exit
# status: 0 when every step that ran exited 0, 1 otherwise, 2 for a usage error.
# Environment: PYTHON (python3), LOADAVG_FILE (/proc/loadavg: the load a rehearsal's limits grow
# with).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
PY=${PYTHON:-python3}
RESERVE_S=20 # kept back from the steps for the summary and the archive

die() {
    echo "gpu_short.sh: $*" >&2
    exit 2
}

OUTDIR=
DEADLINE_S=540
WHEELS=
PASS=()
DRY=0
while [ $# -gt 0 ]; do
    case $1 in
        -h | --help)
            sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'
            exit 0
            ;;
        --deadline-s)
            [ $# -ge 2 ] && [[ $2 =~ ^[1-9][0-9]*$ ]] || die "--deadline-s needs a positive integer"
            DEADLINE_S=$2
            shift
            ;;
        --wheels)
            [ $# -ge 2 ] && [ -n "$2" ] || die "--wheels needs a folder of wheels"
            [ -d "$2" ] || die "--wheels $2: no such folder"
            WHEELS=$2
            shift
            ;;
        --steps)
            [ $# -ge 2 ] && [ -n "$2" ] || die "--steps needs a comma-separated list"
            PASS+=(--steps "$2")
            shift
            ;;
        --rehearse) PASS+=(--rehearse) ;;
        --dry-run) PASS+=(--dry-run) DRY=1 ;;
        -*) die "unknown option '$1' (see --help)" ;;
        *)
            [ -z "$OUTDIR" ] || die "one OUTDIR only (got '$OUTDIR' and '$1')"
            OUTDIR=$1
            ;;
    esac
    shift
done
[ -n "$OUTDIR" ] || die "name the output folder: bash benchmarks/gpu_short.sh OUTDIR"
STEPS_S=$((DEADLINE_S - RESERVE_S))
[ "$STEPS_S" -ge 60 ] || die "--deadline-s $DEADLINE_S leaves less than 60 s for the steps"
START=$(date +%s)
WORK=$OUTDIR/work

if [ -n "$WHEELS" ] && [ "$DRY" = 0 ]; then
    SITE=$(mktemp -d "${TMPDIR:-/tmp}/pycls_wheels.XXXXXX") || exit 1
    trap 'rm -rf "$SITE"' EXIT
    shopt -s nullglob
    files=("$WHEELS"/*.whl "$WHEELS"/*.tar.gz)
    shopt -u nullglob
    [ ${#files[@]} -gt 0 ] || die "--wheels $WHEELS holds no .whl or .tar.gz"
    echo "installing ${#files[@]} package file(s) from $WHEELS (no index, no dependencies)"
    "$PY" -m pip install --quiet --no-index --no-deps --no-build-isolation --target "$SITE" \
        "${files[@]}" || { echo "gpu_short.sh: installing from $WHEELS failed" >&2; exit 1; }
    export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
fi

if [ "$DRY" = 0 ]; then
    [ ! -e "$WORK" ] || rm -rf "$WORK"
    mkdir -p "$OUTDIR" || die "cannot create $OUTDIR"
fi
bash "$ROOT/benchmarks/gpu_campaign.sh" --phases levers --phase-seconds "levers=$STEPS_S" \
    --budget-seconds "$STEPS_S" --no-report "${PASS[@]}" "$WORK"
rc=$?
if [ "$DRY" = 1 ]; then
    echo "REPORT $PY benchmarks/campaign_report.py $WORK --levers --out $OUTDIR/summary.md"
    echo "ARCHIVE $OUTDIR/gpu_short.tar.gz (then $WORK is removed)"
    exit $rc
fi
[ "$rc" -le 1 ] || exit "$rc"
"$PY" benchmarks/campaign_report.py "$WORK" --levers --out "$OUTDIR/summary.md" \
    >"$WORK/report.log" 2>&1 || { echo "the report failed: see $WORK/report.log"; rc=1; }
if tar -czf "$OUTDIR/gpu_short.tar.gz" -C "$OUTDIR" work; then
    rm -rf "$WORK"
else
    echo "gpu_short.sh: the archive failed; the results stay in $WORK" >&2
    rc=1
fi
[ -f "$OUTDIR/summary.md" ] && cat "$OUTDIR/summary.md"
echo "gpu_short done in $(($(date +%s) - START))s: $OUTDIR/summary.md, $OUTDIR/gpu_short.tar.gz"
exit $rc
