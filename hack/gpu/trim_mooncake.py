"""Trim a Mooncake wheel to its transfer engine, for hack/gpu/assemble.sh.

A GPU machine gets at most 64 MiB with the repository, and Mooncake's CUDA 13 wheel is 50 MB, most of it the
store, the EP and PG backends and their binaries, none of which the worker's KV transfer uses: it imports
`mooncake.engine` alone (`disagg.mooncake.engine`). The trimmed wheel keeps that module, the libraries it loads
(followed through NEEDED and its RPATH, as the loader does) and the distribution's metadata, under the same name
and version, so that `disagg.mooncake.environ.installed_build` still tells a build that reads device memory.

Libraries the engine needs that the wheel does not ship are looked up in a folder of Debian packages extracted
with `dpkg -x` (libibverbs, libmlx5, libnuma, libcurl and theirs) and copied, under their sonames, into a folder
of their own: run.sh puts on LD_LIBRARY_PATH only those the GPU machine's image lacks. Any other library must
be one every such image has (glibc's, the C++ runtime's, the driver's libcuda) or libcudart from torch's CUDA
packages; one that is none of these stops the assembly, naming it.

Usage: trim_mooncake.py WHEEL DEBIAN_ROOT OUT_DIR SYSLIB_DIR
"""

from __future__ import annotations

import base64
import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

MODULE = "mooncake/engine.so"
# The package's own Python files the module needs to be imported as `mooncake.engine`, and its type stub.
PACKAGE_FILES = ("mooncake/__init__.py", "mooncake/engine.pyi", "mooncake/py.typed")
FROM_IMAGE = {
    "libc.so.6",
    "libm.so.6",
    "libdl.so.2",
    "librt.so.1",
    "libpthread.so.0",
    "libresolv.so.2",
    "ld-linux-x86-64.so.2",
    "libstdc++.so.6",
    "libgcc_s.so.1",
    "libcuda.so.1",  # the driver's, mounted into every GPU container
    "libcudart.so.13",  # torch's nvidia packages; run.sh puts their folder on LD_LIBRARY_PATH
}
DEBIAN_LIBS = ("lib/x86_64-linux-gnu", "usr/lib/x86_64-linux-gnu")


def dynamic(path: Path) -> tuple[list[str], list[str]]:
    """The NEEDED sonames and the RPATH/RUNPATH folders of an ELF file (readelf -d)."""
    out = subprocess.run(["readelf", "-d", str(path)], check=True, capture_output=True, text=True).stdout
    needed, paths = [], []
    for line in out.splitlines():
        value = line.rsplit("[", 1)[-1].rstrip("]")
        if "(NEEDED)" in line:
            needed.append(value)
        elif "(RPATH)" in line or "(RUNPATH)" in line:
            paths += [p.replace("$ORIGIN", str(path.parent)) for p in value.split(":")]
    return needed, paths


def closure(root: Path, debian: Path) -> tuple[set[Path], dict[str, Path]]:
    """The wheel's files the module loads, and the Debian libraries (by soname) it and they load."""
    wheel_files: set[Path] = set()
    system: dict[str, Path] = {}
    todo = [root / MODULE]
    while todo:
        path = todo.pop()
        needed, rpath = dynamic(path)
        for soname in needed:
            if soname in FROM_IMAGE or soname in system:
                continue
            found = next((Path(d) / soname for d in rpath if (Path(d) / soname).exists()), None)
            if found is not None and found.resolve().is_relative_to(root):
                if found.resolve() not in wheel_files:
                    wheel_files.add(found.resolve())
                    todo.append(found.resolve())
                continue
            deb = next((debian / d / soname for d in DEBIAN_LIBS if (debian / d / soname).exists()), None)
            if deb is None:
                sys.exit(f"{path.name} needs {soname}: neither in the wheel, the Debian packages nor the image")
            system[soname] = deb.resolve()
            todo.append(deb.resolve())
    return wheel_files | {root / MODULE}, system


def record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def main(wheel: Path, debian: Path, out_dir: Path, syslib_dir: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        with zipfile.ZipFile(wheel) as z:
            z.extractall(root)
        libs, system = closure(root, debian)
        dist_info = next(root.glob("*.dist-info"))
        # entry_points.txt is left out: its console scripts name modules the trimmed wheel lacks.
        meta = [p for p in dist_info.rglob("*") if p.is_file() and p.name not in ("RECORD", "entry_points.txt")]
        keep = sorted({root / f for f in PACKAGE_FILES} | libs | set(meta))
        record = dist_info / "RECORD"
        lines = []
        with zipfile.ZipFile(out_dir / wheel.name, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
            for path in keep:
                name = path.relative_to(root).as_posix()
                data = path.read_bytes()
                info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
                info.external_attr = (0o755 if ".so" in name else 0o644) << 16
                z.writestr(info, data, zipfile.ZIP_DEFLATED)
                lines.append(record_line(name, data))
            lines.append(f"{record.relative_to(root).as_posix()},,")
            z.writestr(record.relative_to(root).as_posix(), "\n".join(lines) + "\n")
    syslib_dir.mkdir(parents=True, exist_ok=True)
    for soname, path in sorted(system.items()):
        shutil.copyfile(path, syslib_dir / soname)
    print(f"{wheel.name}: kept {len(keep)} files; Debian libraries: {' '.join(sorted(system))}")


if __name__ == "__main__":
    main(*(Path(a) for a in sys.argv[1:5]))
