#!/usr/bin/env bash
# The GPU check: what can only be measured on a machine with CUDA. CI never runs it.
#
#   bash benchmarks/gpu_check.sh [--quick]
#
# Without CUDA it says so and exits 0, measuring nothing. With CUDA, from the repository root:
#
#   1. the worker side's batched copies on the device (benchmarks/gpu_batch_copy.py): the CUDA
#      path of nexuskv/dataplane/batch_copy.py checked against the per-block copies (a difference
#      fails the check), then timed against torch's plain index_select + .cpu();
#   2. the data-plane copy benchmark, pinned host <-> device against torch's plain copy
#      (benchmarks/bench_copy.py --pairs host-device,device-host; it also starts the remote tier's
#      Mooncake Store, so it needs the README's install);
#   3. the real-vLLM replay (benchmarks/bench_replay.py) with whatever vLLM is installed (vLLM's
#      CUDA build here) on its small local model;
#   4. the GPU-only arms, where they are installed: vLLM's native CPU offloading
#      (--kv-offloading-size) and LMCache, beside NexusKV — each reported as run, or as not
#      installed; this script does not install them.
#
# Every step's output goes to $OUT (default benchmarks/results/gpu_check/<UTC time>), one log per
# step; the results files go to benchmarks/results/ as every benchmark's do. A failed step is
# reported and the next one runs; the exit status is 1 if any step failed.
set -u
cd "$(dirname "$0")/.."
QUICK=0
[ "${1:-}" = "--quick" ] && QUICK=1
PY=${PYTHON:-python}

if ! $PY -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: no CUDA device here (torch.cuda.is_available() is False, or torch is missing):"
    echo "gpu_check: nothing measured. Run this on a machine with an NVIDIA GPU and vLLM's CUDA build."
    exit 0
fi

OUT=${OUT:-benchmarks/results/gpu_check/$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
failed=0
step() {  # step NAME COMMAND...: run it, log it, never stop the check
    local name=$1; shift
    echo "== $name: $*"
    if "$@" >"$OUT/$name.log" 2>&1; then
        tail -n 12 "$OUT/$name.log"
        echo "== $name: ok"
    else
        tail -n 30 "$OUT/$name.log"
        echo "== $name: FAILED (log: $OUT/$name.log)"
        failed=1
    fi
}

$PY - <<'EOF' | tee "$OUT/device.txt"
import torch
print("device:", torch.cuda.get_device_name(), "| torch", torch.__version__, "| CUDA", torch.version.cuda)
try:
    from importlib import metadata
    print("vllm:", metadata.version("vllm"))
except Exception as exc:  # noqa: BLE001
    print("vllm: not installed:", exc)
EOF

if [ $QUICK = 1 ]; then REPEATS=3; RUNS=1; else REPEATS=10; RUNS=3; fi

step batch_copy $PY -m benchmarks.gpu_batch_copy --repeats $REPEATS
step copy $PY -m benchmarks.bench_copy --pairs host-device,device-host --repeats $((REPEATS / 2 + 1))
step replay $PY -m benchmarks.bench_replay --runs $RUNS

# The GPU-only arms: run only where their packages are installed.
if $PY -c 'import vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector' 2>/dev/null \
        || $PY -c 'import vllm.v1.kv_offload' 2>/dev/null; then
    echo "== native offloading: vLLM's offloading connector is installed; arm: --kv-offloading-size"
    echo "   (no replay arm runs it yet: see benchmarks/README.md, 'The GPU check')" | tee "$OUT/native_offloading.txt"
else
    echo "== native offloading: not in this vLLM build" | tee "$OUT/native_offloading.txt"
fi
if $PY -c 'import lmcache' 2>/dev/null; then
    echo "== LMCache: installed (lmcache $($PY -c 'import lmcache, importlib.metadata as m; print(m.version("lmcache"))'))"
    echo "   (no replay arm runs it yet: see benchmarks/README.md, 'The GPU check')" | tee "$OUT/lmcache.txt"
else
    echo "== LMCache: not installed (pip install lmcache to add its arm)" | tee "$OUT/lmcache.txt"
fi

echo "gpu_check: logs in $OUT; status $failed"
exit $failed
