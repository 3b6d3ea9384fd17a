"""The code's shape: small modules, engine roles by composition (no subclass of Engine or Scheduler), and two
houses that share only a small package of names (`api/`)."""

import ast
import re
import sys
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCES = sorted([*(REPO / "worker").rglob("*.py"), *(REPO / "operator").rglob("*.py"), *(REPO / "api").rglob("*.py")])
# Everything ruff formats (`make lint`), where a `# fmt: skip` could keep lines from their formatted shape.
FORMATTED = sorted(
    p for top in ("worker", "operator", "api", "tests", "bench", "hack") for p in (REPO / top).rglob("*.py")
)
MAX_LINES = 400
# The size check is a ratchet, never a gate to squeeze under: a module is counted as ruff formats it (no
# `# fmt: skip` outside the kernels), and one over MAX_LINES may only be one that already was, listed here at its
# line count. It may not grow; when it shrinks its entry follows it down, and once it is within MAX_LINES (or gone)
# its entry leaves, so the list only shrinks. A module that outgrows MAX_LINES is split by concern instead.
KNOWN_LONG: dict[str, int] = {}
# GPU kernel sources: their launch calls and signatures keep the layout of the grid they describe (`# fmt: skip`).
KERNELS = sorted(str(p.relative_to(REPO)) for p in (REPO / "worker" / "disagg_worker" / "model").glob("triton_*.py"))
# `# fmt: skip` left outside the kernels, by count (none now: a file added here has to say why); the list only shrinks.
FMT_SKIP_LEFT: dict[str, int] = {}
# What keeps ruff's formatter off lines, as it reads a comment: one of these between two `#` or a `#` and the end
# (`# fmt: off` ... `# fmt: on`, yapf's spelling of those, a trailing `# fmt: skip`, also after another pragma).
FMT_DIRECTIVES = {"fmt:skip", "fmt:off", "fmt:on", "yapf:disable", "yapf:enable"}


def test_the_sources_are_found():
    assert len(SOURCES) > 50


def size_problems(sizes: dict[str, int], known: dict[str, int], limit: int = MAX_LINES) -> list[str]:
    """What breaks the ratchet, a line naming the module each: one over `limit` that is not `known`, or a known
    one that grew past its count, shrank under it (its entry must follow), is within `limit` or is gone."""
    problems = [
        f"{path}: {n} lines, over {limit}: split it by concern"
        for path, n in sizes.items()
        if n > limit and path not in known
    ]
    for path, listed in known.items():
        n = sizes.get(path)
        if n is None:
            problems.append(f"{path}: listed at {listed} lines but gone: remove its entry")
        elif n <= limit:
            problems.append(f"{path}: {n} lines, within {limit}: remove its entry")
        elif n > listed:
            problems.append(f"{path}: {n} lines, grown past its {listed}: split it by concern")
        elif n < listed:
            problems.append(f"{path}: {n} lines, down from {listed}: lower its entry to {n}")
    return sorted(problems)


def test_no_module_is_over_400_lines_but_the_known_ones_and_they_never_grow():
    sizes = {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for p in SOURCES}
    assert size_problems(sizes, KNOWN_LONG) == []


def test_the_size_ratchet_names_a_new_long_module_and_a_known_one_that_grew_or_shrank():
    known = {"a.py": 450, "b.py": 420, "c.py": 410, "d.py": 405, "e.py": 430}
    sizes = {"a.py": 450, "b.py": 421, "c.py": 400, "d.py": 402, "f.py": 401, "g.py": 400}
    assert size_problems(sizes, known) == [
        "b.py: 421 lines, grown past its 420: split it by concern",
        "c.py: 400 lines, within 400: remove its entry",
        "d.py: 402 lines, down from 405: lower its entry to 402",
        "e.py: listed at 430 lines but gone: remove its entry",
        "f.py: 401 lines, over 400: split it by concern",
    ]


def fmt_directives(path: Path) -> int:
    """How many comments in `path` keep the formatter off lines."""
    with path.open("rb") as f:
        comments = [t.string for t in tokenize.tokenize(f.readline) if t.type == tokenize.COMMENT]
    return sum(1 for c in comments if any(re.sub(r"\s", "", part) in FMT_DIRECTIVES for part in c.split("#")))


def test_no_fmt_skip_outside_the_kernels():
    found = {str(p.relative_to(REPO)): fmt_directives(p) for p in FORMATTED}
    outside = {path: n for path, n in found.items() if n and path not in KERNELS}
    assert outside == FMT_SKIP_LEFT, "let ruff format these (and remove a file from FMT_SKIP_LEFT once it has none)"


def test_the_directive_check_sees_every_spelling_and_only_comments(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "x = [1,  2]  # fmt: skip\n# fmt: off\ny = 1\n#fmt:on\nz = 2  # noqa: E501  # fmt:skip\n"
        '# yapf: disable\ntext = "# fmt: skip"\n# a `# fmt: skip` named in a comment\n'
    )
    assert fmt_directives(source) == 5


def test_the_kernel_files_hold_triton_kernels():
    """Only a GPU kernel source keeps its own layout, so a file named like one must be one."""
    assert KERNELS
    assert [path for path in KERNELS if "@triton.jit" not in (REPO / path).read_text()] == []


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
