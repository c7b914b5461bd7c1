#!/usr/bin/env bash
# The checks that need a GPU, as one script for a CUDA machine (CI has none):
#   1. tests/agent/test_cuda_real.py and tests/e2e/test_cuda_end_to_end.py (skipped elsewhere);
#   2. bench/cuda_calls.py: the host cost of each CUDA call the device path could make;
#   3. bench/overhead.py --device cuda: the training thread's cost with CUDA events;
#   4. bench/overhead.py on the same host with the GPU hidden (the CPU path, same CPU);
#   5. the whole agent test suite with a GPU visible (tests written on CPU machines).
# Each part is bounded by `timeout` and logged to $OUT (or ./cuda_check_out); a failing
# part does not stop the next; SKIP="name ..." leaves parts out (device time is short).
# Expects python3 with torch (CUDA build), msgpack, psutil,
# nvidia-ml-py, uvloop and aiosqlite; put wheels in .whl/ to have them installed first.
set -u
cd "$(dirname "$0")/.."
out=${OUT:-cuda_check_out}
mkdir -p "$out"
py=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the bench scripts import agent from the checkout
{
    nvidia-smi -L
    nproc
    $py -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))'
    lscpu | grep -E 'Model name|L2|L3' || true
} 2>&1 | tee "$out/env.txt"

part() {  # part NAME SECONDS CMD...: run, log, record the exit code (SKIP="a b" skips parts)
    local name=$1 limit=$2
    shift 2
    case " ${SKIP:-} " in *" $name "*) echo "=== $name: skipped"; return ;; esac
    echo "=== $name (limit ${limit}s): $*"
    local t0=$SECONDS
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "=== $name: exit $rc in $((SECONDS - t0))s"
    tail -n 25 "$out/$name.log"
}

part cuda_tests "${CUDA_TESTS_S:-240}" $py -m pytest -q -p no:cacheprovider -rA -s \
    tests/agent/test_cuda_real.py tests/e2e/test_cuda_end_to_end.py
part cuda_calls 60 $py bench/cuda_calls.py
# OVERHEAD_CUDA_ARGS / OVERHEAD_CPU_ARGS replace the default (quick) arguments.
part overhead_cuda "${OVERHEAD_S:-150}" $py bench/overhead.py --device cuda \
    ${OVERHEAD_CUDA_ARGS:---quick --no-profiler --no-launch --targets 0.3 --modules 4,64,512}
part overhead_cpu_same_host "${OVERHEAD_S:-150}" env CUDA_VISIBLE_DEVICES= $py bench/overhead.py \
    ${OVERHEAD_CPU_ARGS:---quick --no-profiler --no-launch --targets 0.3 --modules 4,64,512}
part agent_suite "${AGENT_SUITE_S:-200}" $py -m pytest -q -p no:cacheprovider --maxfail=40 -n 8 tests/agent
