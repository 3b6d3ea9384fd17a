"""The report at the end of `make test`: each build phase's wall time, then each test tier's with its slowest
tests.  python3 hack/test/report.py PHASES_TSV TIERS_JSON  (either file may be missing: a run that stopped early).

PHASES_TSV holds one line per phase (hack/test/phase.sh): name, start (Unix seconds), seconds, exit status.
Phases that `make -j` ran side by side overlap, so the report shows when each started, relative to the first,
and the run's wall time from the first start to the last end. Runs on the machine's own python3 (no venv).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.phases import render  # noqa: E402


def phases(path: Path) -> list[str]:
    rows = []
    for line in path.read_text().splitlines():
        name, start, seconds, status = line.split("\t")
        rows.append((name, float(start), float(seconds), int(status)))
    if not rows:
        return []
    origin = min(start for _, start, _, _ in rows)
    end = max(start + seconds for _, start, seconds, _ in rows)
    width = min(48, max(len(name) for name, _, _, _ in rows))  # a longer name runs past its column
    lines = [f"{'phase':<{width}} {'start':>8} {'wall':>8}  status"]
    for name, start, seconds, status in sorted(rows, key=lambda r: r[1]):
        mark = "ok" if status == 0 else f"FAILED ({status})"
        lines.append(f"{name:<{width}} {_min(start - origin):>8} {_min(seconds):>8}  {mark}")
    lines.append(f"{'all':<{width}} {'':>8} {_min(end - origin):>8}")
    return lines


def _min(seconds: float) -> str:
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


def main(phases_tsv: str, tiers_json: str) -> None:
    print("\n===== make test: where the time went =====")
    if Path(phases_tsv).exists():
        print("\n".join(phases(Path(phases_tsv))))
    if Path(tiers_json).exists():
        print("\n" + "\n".join(render(json.loads(Path(tiers_json).read_text()))))


if __name__ == "__main__":
    main(*sys.argv[1:3])
