#!/usr/bin/env bash
# The GPU checks in one command (issue 6), under 8 minutes on one H200:
#   1. the GPU unit tests of the CUDA ring (tests/unit/test_ring_cuda.py -m gpu: streams, IPC with a child);
#   2. python -m epdq.benchmarks.gpu_check: hand-off benchmark (CUDA ring vs shm ring vs safetensors
#      vs one device-to-device copy), a random-weight Qwen2.5-VL-3B checkpoint with the real shapes,
#      broker + encoder + PD + colocated worker (transformers engines) on the GPU, greedy token check
#      EPD vs the same model fed pixels, a short goodput run, and which ring path the PD worker took.
#
# Usage, from the repository root of the GPU machine (its own python3 with torch + transformers):
#     bash bench/gpu_check.sh [OUT_DIR]          # default: $OUT if set, else gpu-check-results
# The GPU machine has no pyzmq/msgspec and no package index: fetch their wheels first on a machine
# that has one, into .whl/ (ignored by git), and carry .whl with the working tree:
#     bash bench/gpu_check.sh --fetch-wheels
# Environment: PYTHON (default python3), DEVICE (default cuda:0), PRESET (default qwen2.5-vl-3b),
# LIMIT_S (default 450: the whole script's wall-clock limit; the check is told what is left and stops
# starting goodput points in time to write its tables), GPU_CHECK_ARGS (more arguments for
# epdq.benchmarks.gpu_check, e.g. "--goodput-qps 1,2").
# Exit status: 0 when the unit tests and the check passed; the tables are in OUT_DIR/summary.md.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
PY="${PYTHON:-python3}"

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    mkdir -p .whl
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
    exec "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
        -d .whl pyzmq==27.3.0 msgspec==0.23.0
fi

OUT_DIR="${1:-${OUT:-gpu-check-results}}"
mkdir -p "$OUT_DIR"
START=$(date +%s)
LIMIT_S="${LIMIT_S:-450}"

# dependencies the GPU machine lacks travel as wheels; installed into a private directory
if ! "$PY" -c "import zmq, msgspec" 2>/dev/null; then
    if compgen -G ".whl/*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/epdq-site .whl/*.whl || { echo "installing .whl/*.whl failed" >&2; exit 3; }
        export PYTHONPATH="/tmp/epdq-site${PYTHONPATH:+:$PYTHONPATH}"
    else
        echo "pyzmq/msgspec are missing and there is no .whl/: run 'bash bench/gpu_check.sh --fetch-wheels'" \
             "on a machine with a package index and carry .whl" >&2
        exit 3
    fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export EPDQ_HOME="${EPDQ_HOME:-/tmp/epdq-gpu-check-home}"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, torch.cuda.get_device_name(0))" \
    || { echo "this machine has no usable CUDA device" >&2; exit 4; }
# what the tables will not say: the driver, the GPU's state, room in /dev/shm (the shm ring rows)
{ nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm,clocks.max.sm --format=csv 2>&1
  df -h /dev/shm "${TMPDIR:-/tmp}" 2>&1; nproc; "$PY" -c "import transformers; print('transformers', transformers.__version__)"; } \
    | tee "$OUT_DIR/machine.txt"

echo "== 1. GPU unit tests"
# -W: an unknown ini option (pytest-asyncio's, not installed there) must not become an error
timeout 150 "$PY" -m pytest tests/unit/test_ring_cuda.py -q -p no:cacheprovider -p no:asyncio \
    -W ignore::pytest.PytestConfigWarning -o addopts="-ra" 2>&1 | tee "$OUT_DIR/pytest.txt"
TESTS_RC=${PIPESTATUS[0]}

LEFT=$(( LIMIT_S - ($(date +%s) - START) ))
echo "== 2. gpu_check ($(( $(date +%s) - START )) s so far, $LEFT s left)"
# SIGTERM at the limit: the check still writes what it has. No stage starts in its last 90 s, and the
# goodput run stops 100 s before that (--reserve-s), leaving time for the float32 check and the diagnostics
# shellcheck disable=SC2086
timeout -k 10 "$LEFT" "$PY" -m epdq.benchmarks.gpu_check --out "$OUT_DIR" --device "${DEVICE:-cuda:0}" \
    --preset "${PRESET:-qwen2.5-vl-3b}" --budget-s "$(( LEFT > 150 ? LEFT - 90 : 60 ))" ${GPU_CHECK_ARGS:-} 2>&1 \
    | tee "$OUT_DIR/console.log"
CHECK_RC=${PIPESTATUS[0]}

echo "== done in $(( $(date +%s) - START )) s: unit tests rc=$TESTS_RC, gpu_check rc=$CHECK_RC (tables: $OUT_DIR/summary.md)"
[[ $TESTS_RC -eq 0 && $CHECK_RC -eq 0 ]]
