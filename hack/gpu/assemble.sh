#!/usr/bin/env bash
# What must travel to a GPU machine (Python 3.12, torch with CUDA, no package index): the wheels of the worker's
# dependencies its image lacks, into .whl/ (git-ignored; name it in the device call's `carry`). hack/gpu/run.sh
# installs them there and runs the gpu tier. The GPU machine's image already holds torch, triton, transformers,
# aiohttp, safetensors, tokenizers, prometheus-client, numpy, pytest and hypothesis. Mooncake's CUDA 13 build comes
# trimmed to its transfer engine (hack/gpu/trim_mooncake.py: 50 MB -> ~9 MB), with the Debian libraries it links
# that a CUDA image may lack in .whl/syslibs.tar.gz (~7 MB; run.sh uses only those the image lacks).
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
# The build that reads device memory (the mooncake-cuda13 extra), for CPython 3.12 as the GPU machine's.
MOONCAKE=mooncake-transfer-engine-cuda13==0.3.14
DEBS=(libibverbs1 ibverbs-providers libnl-3-200 libnl-route-3-200 libnuma1 libcurl4 libnghttp2-14 libidn2-0 librtmp1
  libssh2-1 libpsl5 libssl3 libgssapi-krb5-2 libldap-2.5-0 libzstd1 libbrotli1 zlib1g libunistring2 libgnutls30
  libhogweed6 libnettle8 libgmp10 libkrb5-3 libk5crypto3 libcom-err2 libkrb5support0 libsasl2-2 libp11-kit0
  libtasn1-6 libkeyutils1 libffi8)
work=$(mktemp -d) && trap 'rm -rf "$work"' EXIT
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d "$work" "$MOONCAKE"
(cd "$work" && apt-get download -q "${DEBS[@]}" >/dev/null)
for deb in "$work"/*.deb; do dpkg -x "$deb" "$work/debian"; done
"$PY" hack/gpu/trim_mooncake.py "$work"/mooncake_transfer_engine_cuda13-*.whl "$work/debian" "$OUT" "$work/syslibs"
tar -czf "$OUT/syslibs.tar.gz" -C "$work/syslibs" .
du -sh "$OUT"
ls "$OUT"
