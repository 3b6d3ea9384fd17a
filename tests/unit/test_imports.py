"""Imports run one way: each part of the worker imports only parts below it, and no files import each other in
a circle (imports inside functions included)."""

import ast
import graphlib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "worker" / "disagg_worker"
NAME = PACKAGE.name
# The worker's parts from the ground up: a part imports only parts before it. Under everything, the start-up error any
# part may raise; then the ground, which knows nothing of engines or processes (a request's shape, settings, the
# model, paged memory), flow control's pure queue and rules (`flow`), then the OpenTelemetry wrapper the HTTP
# processes use (which names the stages a request's scheduler records); the transfer (`disagg`) sits under the engine,
# the ranks' machinery under the engine, the processes that run an engine above it; above those the HTTP kit both
# front ends use (`http`: transport, not OpenAI: admission and body limits, errors, auth, drain, the tracing
# middleware, the probe header), the workers' HTTP side above it, the router (which reuses the workers' OpenAI
# parsing) above that, the endpoint picker a gateway asks (which reuses the router's pool, policies and discovery)
# above the router, the command line on top.
FLOORS = [
    ("errors",),
    ("env", "keys", "tuning", "flags", "mem", "model", "bench"),
    ("request",),
    ("flow",),
    ("tracing",),
    ("speculative_config", "tier_config", "lora_config"),
    ("cache_config",),
    ("config",),
    ("disagg",),
    ("cli_args",),
    ("ranks",),
    ("engine",),
    ("instance",),
    ("http",),
    ("server",),
    ("router",),
    ("epp",),
    ("cli",),
]
FLOOR_OF = {part: n for n, parts in enumerate(FLOORS) for part in parts}


def module_of(path: Path) -> str:
    parts = [NAME, *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_of(p): p for p in PACKAGE.rglob("*.py")}


def imported(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The modules of this package that one import statement names (a name that is a submodule counts as it)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = module.split(".")
        if not MODULES[module].name == "__init__.py":
            base = base[:-1]
        if node.level:
            base = base[: len(base) - node.level + 1]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        names = [f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else source for a in node.names]
    found = []
    for name in names:
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name.startswith(NAME + ".") and name != module:
            found.append(name)
    return found


def import_edges() -> set[tuple[str, str]]:
    edges = set()
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges |= {(module, target) for target in imported(module, node)}
    return edges


def part(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def test_every_part_of_the_worker_has_a_floor():
    assert {part(m) for m in MODULES if m != NAME} - FLOOR_OF.keys() == set(), "add the new part to FLOORS"


def test_each_part_imports_only_parts_below_it():
    upward = sorted(
        f"{a} imports {b}" for a, b in import_edges() if part(a) != part(b) and FLOOR_OF[part(b)] >= FLOOR_OF[part(a)]
    )
    assert upward == []


def test_no_files_import_each_other_in_a_circle():
    graph: dict[str, set[str]] = {}
    for a, b in import_edges():
        graph.setdefault(a, set()).add(b)
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        raise AssertionError(f"a circle of imports: {' -> '.join(e.args[1])}") from None


def test_the_check_sees_imports_inside_functions():
    """The circle engine/stage.py once hid with an import inside a function would be found."""
    source = "def f():\n    from disagg_worker.engine.decode import DecodeStage\n"
    tree = ast.parse(source)
    found = [
        t for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for t in imported(f"{NAME}.engine.stage", node)
    ]
    assert found == [f"{NAME}.engine.decode"]
