#!/usr/bin/env bash
# Jaeger all-in-one (collector with OTLP on gRPC/HTTP, in-memory storage, query API), built from its Go module
# through the module proxy into $DISAGG_JAEGER_CACHE (default ~/.cache/disagg/jaeger/<version>/bin/jaeger-all-in-one).
# The tracing integration test (tests/integration/test_tracing.py) runs it as its collector.
#
# Idempotent: a stamp named after the version, so a second run builds nothing. The module's own go.mod and go.sum
# pin its dependencies (it has a replace directive, so `go install module@version` cannot build it): its source is
# copied out of the module cache and built there, on every core (GOMAXPROCS bounds it).
# Prints the binary's path on its last line (`build.sh --bin` prints it without building).
set -euo pipefail

JAEGER_VERSION="${JAEGER_VERSION:-v1.76.0}"
CACHE="${DISAGG_JAEGER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/disagg/jaeger}/$JAEGER_VERSION"
BIN="$CACHE/bin/jaeger-all-in-one"

if [[ "${1:-}" == --bin ]]; then
  echo "$BIN"
  exit 0
fi

export GOTOOLCHAIN=local CGO_ENABLED=0
mkdir -p "$CACHE/bin"
log() { printf '[jaeger-build %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }

exec 9>"$CACHE/.lock"
flock 9

if [[ ! -f "$CACHE/stamp" || ! -x "$BIN" ]]; then
  log "building jaeger all-in-one $JAEGER_VERSION"
  dir=$(cd "$CACHE" && GOFLAGS=-mod=mod go mod download -json "github.com/jaegertracing/jaeger@$JAEGER_VERSION" |
        sed -n 's/^\s*"Dir": "\(.*\)",\?$/\1/p')
  src="$CACHE/src"
  rm -rf "$src" && cp -r "$dir" "$src" && chmod -R u+w "$src"
  (cd "$src" && go build -mod=readonly -trimpath -ldflags "-s -w" -o "$BIN.tmp" ./cmd/all-in-one)
  mv "$BIN.tmp" "$BIN"
  rm -rf "$src"
  date -u +%FT%TZ >"$CACHE/stamp"
fi
echo "$BIN"
