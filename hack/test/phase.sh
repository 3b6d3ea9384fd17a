#!/usr/bin/env bash
# Runs one step of `make test` and records its wall time:  hack/test/phase.sh [--plain] NAME COMMAND [ARG...]
# Appends "NAME<TAB>start<TAB>seconds<TAB>exit status" to $DISAGG_PHASES (when set), which hack/test/report.py
# prints at the end of the run. Each line the command prints is prefixed with "[NAME] ", so that the steps
# `make -j` runs side by side stay readable in one log (stdout stays stdout, stderr stderr); --plain leaves the output as it is (pytest's).
# Exits with the command's status.
set -uo pipefail
plain=0
[[ $1 == --plain ]] && { plain=1; shift; }
name=$1
shift
start=$EPOCHREALTIME
if ((plain)); then
  "$@"
  status=$?
else
  "$@" > >(sed -u "s/^/[$name] /") 2> >(sed -u "s/^/[$name] /" >&2)
  status=$?
  wait  # for the prefixing of the last lines
fi
end=$EPOCHREALTIME
if [[ -n ${DISAGG_PHASES:-} ]]; then
  mkdir -p "$(dirname "$DISAGG_PHASES")"
  printf '%s\t%s\t%.1f\t%s\n' "$name" "${start%.*}" "$(awk "BEGIN { print $end - $start }")" "$status" >>"$DISAGG_PHASES"
fi
exit "$status"
