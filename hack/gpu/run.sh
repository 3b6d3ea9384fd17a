#!/usr/bin/env bash
# On a GPU machine (the device tool's `run`, carrying .whl/ made by hack/gpu/assemble.sh): install the carried
# wheels beside the image's own packages (torch, triton, transformers...), run the gpu tier, then the GPU benchmark
# (bench/bench_gpu.py, at most $GPU_BENCH_TIMEOUT_S seconds). What comes back goes to $OUT: the device's name, the
# tier's log and JUnit report, the benchmark's gpu.json and log. The exit status is the tier's: a failing
# benchmark says so in its log and JSON.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "installing the carried wheels failed" | tee "$OUT/error.txt"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD/worker:$PWD/operator:$PWD/api:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.csv"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/device.csv"
timeout "${GPU_TIER_TIMEOUT_S:-300}" python3 -m pytest -q -p no:cacheprovider -o addopts= tests/gpu \
  --junitxml "$OUT/gpu.xml" 2>&1 | tee "$OUT/gpu.log"
tier=${PIPESTATUS[0]}
timeout "${GPU_BENCH_TIMEOUT_S:-240}" python3 bench/bench_gpu.py --out "$OUT" 2>&1 | tee "$OUT/bench_gpu.log"
echo "bench_gpu exit status ${PIPESTATUS[0]}" | tee -a "$OUT/bench_gpu.log"
exit "$tier"
