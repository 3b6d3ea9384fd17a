"""The code's shape: small modules, and engine roles by composition (no subclass of Engine or Scheduler)."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCES = sorted([*(REPO / "worker").rglob("*.py"), *(REPO / "operator").rglob("*.py")])
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
