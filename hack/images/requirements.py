"""Print the requirements an image installs: pyproject.toml's dependencies and those of the extras named.

Dockerfile.worker installs its dependencies from this list, made in a stage of its own, so the layer that holds
them (torch and its libraries: gigabytes, minutes to build and to import into a node) is rebuilt only when the
list changes, not when another part of pyproject.toml does (a test dependency, a linter's setting).
An extra that names the project itself (`disagg[a,b]`) stands for those extras' requirements.
Usage: python requirements.py PYPROJECT EXTRA[,EXTRA...]   (standard library only: it runs in a bare Python 3.11)
"""

from __future__ import annotations

import re
import sys

import tomllib

_SELF = re.compile(r"^\s*([A-Za-z0-9_.-]+)\s*\[([^\]]*)\]\s*$")


def requirements(project: dict, extras: list[str]) -> list[str]:
    """The project's dependencies, then each extra's in order, self-references expanded, each listed once."""
    name = project["name"].lower()
    optional = project.get("optional-dependencies", {})
    out: list[str] = []
    seen: set[str] = set()

    def add(reqs: list[str]) -> None:
        for req in reqs:
            own = _SELF.match(req)
            if own and own.group(1).lower() == name:
                expand([e.strip() for e in own.group(2).split(",") if e.strip()])
            elif req not in out:
                out.append(req)

    def expand(names: list[str]) -> None:
        for extra in names:
            if extra not in optional:
                raise SystemExit(f"pyproject.toml has no extra {extra!r} (it has {', '.join(sorted(optional))})")
            if extra not in seen:
                seen.add(extra)
                add(optional[extra])

    add(project.get("dependencies", []))
    expand(extras)
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    with open(argv[1], "rb") as f:
        project = tomllib.load(f)["project"]
    extras = [e.strip() for e in argv[2].split(",") if e.strip()]
    print("\n".join(requirements(project, extras)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
