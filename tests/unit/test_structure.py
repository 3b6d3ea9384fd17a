"""The code's shape: small modules, engine roles by composition (no subclass of Engine or Scheduler), and two
houses that share only a small package of names (`api/`)."""

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCES = sorted([*(REPO / "worker").rglob("*.py"), *(REPO / "operator").rglob("*.py"), *(REPO / "api").rglob("*.py")])
MAX_LINES = 400


def test_the_sources_are_found():
    assert len(SOURCES) > 50


def test_no_module_is_over_400_lines():
    sizes = {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for p in SOURCES}
    assert {path: n for path, n in sizes.items() if n > MAX_LINES} == {}, "split these by concern"


def test_no_class_subclasses_the_engine_or_the_scheduler():
    subclasses = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                if bases & {"Engine", "Scheduler"}:
                    subclasses.append(f"{path.relative_to(REPO)}:{node.name}")
    assert subclasses == []


def _imported_packages(root: Path) -> set[str]:
    """The top-level packages the modules under `root` import (relative imports are their own package's)."""
    found: set[str] = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return found


def test_the_package_both_houses_share_needs_the_standard_library_only():
    """The operator's image installs `api/` beside `operator/`: it must not pull the worker (torch) in."""
    outside = {name for name in _imported_packages(REPO / "api") if name not in sys.stdlib_module_names}
    assert outside == {"disagg_api"}


def test_neither_house_imports_the_other():
    assert "disagg_worker" not in _imported_packages(REPO / "operator")
    assert {"disagg_operator", "kopf", "kubernetes"}.isdisjoint(_imported_packages(REPO / "worker"))
