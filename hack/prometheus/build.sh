#!/usr/bin/env bash
# Prometheus and promtool, built through the Go module proxy into ~/.cache/disagg/prometheus/<version>/bin
# (printed on the last line; `build.sh --bin-dir` prints it without building). The tests run the chart's alert
# rules through `promtool test rules` and query a running P/D stack through a real Prometheus server.
#
# Prometheus 3.X.Y is the module version v0.3XX.Y. `remove_all_sd` leaves out the cloud service discoveries
# (the tests scrape static targets), which roughly halves the build. Idempotent: a stamp per version.
set -euo pipefail

PROMETHEUS_VERSION="${PROMETHEUS_VERSION:-v0.316.0}"
CACHE="${DISAGG_PROMETHEUS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/disagg/prometheus}/$PROMETHEUS_VERSION"
BIN_DIR="$CACHE/bin"

if [[ "${1:-}" == --bin-dir ]]; then
  echo "$BIN_DIR"
  exit 0
fi

export GOTOOLCHAIN=local GOFLAGS=-mod=mod CGO_ENABLED=0
mkdir -p "$BIN_DIR"
log() { printf '[prometheus-build %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }

# Serialise concurrent builds (make and pytest may both ask for one).
exec 9>"$CACHE/.lock"
flock 9

if [[ ! -f "$CACHE/stamp" || ! -x "$BIN_DIR/prometheus" || ! -x "$BIN_DIR/promtool" ]]; then
  log "building prometheus and promtool $PROMETHEUS_VERSION"
  start=$SECONDS
  module=github.com/prometheus/prometheus
  release=${PROMETHEUS_VERSION#v0.}  # 316.0 -> 3.16.0
  release="${release:0:1}.$((10#${release:1:2})).${release#*.}"
  ldflags="-s -w -X github.com/prometheus/common/version.Version=$release"
  (cd "$CACHE" && GOBIN="$BIN_DIR" go install -trimpath -tags remove_all_sd -ldflags "$ldflags" \
     "$module/cmd/prometheus@$PROMETHEUS_VERSION" "$module/cmd/promtool@$PROMETHEUS_VERSION")
  date -u +%FT%TZ >"$CACHE/stamp"
  log "done in $((SECONDS - start))s"
fi
echo "$BIN_DIR"
