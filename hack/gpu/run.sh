#!/usr/bin/env bash
# On a GPU machine (the device tool's `run`, carrying .whl/ made by hack/gpu/assemble.sh): install the carried
# wheels beside the image's own packages (torch, triton, transformers...), run the GPU benchmark (bench/bench_gpu.py,
# at most $GPU_BENCH_TIMEOUT_S seconds), then the gpu tier (at most $GPU_TIER_TIMEOUT_S). What comes back goes to
# $OUT: the device's name, the tier's log and JUnit report, its bf16_agreement.json (GPU_REPORT_DIR), the
# benchmark's gpu.json, gpu.png and log: 7 files at most, of the 8 that come back. The exit status is the tier's:
# a failing benchmark says so in its log and JSON.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "installing the carried wheels failed" | tee "$OUT/error.txt"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD/worker:$PWD/operator:$PWD/api:$PWD GPU_REPORT_DIR=$OUT
# Mooncake's engine links libcudart.so.13, which torch's CUDA packages ship, and Debian libraries a CUDA image may
# lack (.whl/syslibs.tar.gz, hack/gpu/trim_mooncake.py): of those, only the ones whose soname the image's loader
# does not know go on LD_LIBRARY_PATH, so the image's own never give way to older copies.
mkdir -p /tmp/syslibs/all /tmp/syslibs/used && tar -xzf .whl/syslibs.tar.gz -C /tmp/syslibs/all
known=$({ ldconfig -p || /sbin/ldconfig -p; } 2>/dev/null | awk '{print $1}')
for lib in /tmp/syslibs/all/*; do
  grep -qxF "${lib##*/}" <<<"$known" || ln -sf "$lib" /tmp/syslibs/used/
done
cudart=$(python3 -c "import glob, os, site; print(next((os.path.dirname(p) for d in site.getsitepackages()
  for p in glob.glob(d + '/nvidia/**/libcudart.so.13', recursive=True)), ''))")
export LD_LIBRARY_PATH=/tmp/syslibs/used${cudart:+:$cudart}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.csv"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/device.csv"
echo "carried libraries used: $(ls /tmp/syslibs/used | tr '\n' ' ')libcudart from: ${cudart:-the image}" \
  | tee -a "$OUT/device.csv"
python3 -c "import mooncake.engine; print('mooncake.engine imports')" 2>&1 | tail -1 | tee -a "$OUT/device.csv"
export PYTHONUNBUFFERED=1
# The integration helpers start `disagg` from beside the interpreter, where `pip install` would have put it.
bin=$(dirname "$(python3 -c 'import sys; print(sys.executable)')")
# (guarded as pip writes it: the scheduler process starts by spawn, which runs this file again as __mp_main__)
[ -x "$bin/disagg" ] || printf '#!%s\nimport sys\nfrom disagg_worker.cli import main\n\nif __name__ == "__main__":\n    sys.exit(main())\n' \
  "$bin/python3" >"$bin/disagg" && chmod +x "$bin/disagg"
# The benchmark first: its figures do not depend on the tier's outcome, and a test that hangs then costs only
# the tier's own time (each test stops at GPU_TEST_TIMEOUT_S).
timeout "${GPU_BENCH_TIMEOUT_S:-200}" python3 bench/bench_gpu.py --out "$OUT" 2>&1 | tee "$OUT/bench_gpu.log"
echo "bench_gpu exit status ${PIPESTATUS[0]}" | tee -a "$OUT/bench_gpu.log"
per_test=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout ${GPU_TEST_TIMEOUT_S:-120}")
timeout "${GPU_TIER_TIMEOUT_S:-270}" python3 -m pytest -q -p no:cacheprovider -o addopts= tests/gpu --durations 15 \
  $per_test --junitxml "$OUT/gpu.xml" 2>&1 | tee "$OUT/gpu.log"
exit "${PIPESTATUS[0]}"
