#!/usr/bin/env bash
# What must travel to a GPU machine (Python 3.12, torch with CUDA, no package index): the wheels of the worker's
# dependencies its image lacks, into .whl/ (git-ignored; name it in the device call's `carry`). hack/gpu/run.sh
# installs them there and runs the gpu tier. The GPU machine's image already holds torch, triton, transformers,
# aiohttp, safetensors, tokenizers, prometheus-client, numpy, pytest and hypothesis.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
OUT=.whl
# name==version as installed here, so the device runs what CI ran.
NAMES=(pyzmq gguf xgrammar apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection)
rm -rf "$OUT" && mkdir -p "$OUT"
for name in "${NAMES[@]}"; do
  version=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$OUT" "$name==$version"
done
du -sh "$OUT"
ls "$OUT"
