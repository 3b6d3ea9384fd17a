#!/usr/bin/env python3
"""Move an image from an OCI layout (what `buildah push oci:DIR` writes) into the node's containerd, sending only
the blobs containerd does not hold yet.

The worker image is ~7 GB, and a change to the project's code changes one layer of a few megabytes. An archive of
the whole image (docker-archive) made containerd read, hash and write all 7 GB again on every change. Here:
  tar LAYOUT HAVE...   write to stdout a tar of the layout's named images for `ctr images import`, leaving out
                       every blob whose digest is in HAVE (`ctr content ls -q`): containerd resolves those from
                       its own store.
  link LAYOUT CONTENT  drop the images that lost their name from the layout's index, remove the blobs no named
                       image refers to, and replace every layer by a hard link to containerd's copy under CONTENT
                       (its blobs/sha256): the layout then costs no disk of its own.
"""

from __future__ import annotations

import io
import json
import os
import sys
import tarfile
from pathlib import Path


def _blob(layout: Path, digest: str) -> Path:
    algorithm, hex_ = digest.split(":", 1)
    return layout / "blobs" / algorithm / hex_


REF_NAME = "org.opencontainers.image.ref.name"


def named_index(layout: Path) -> dict:
    """The layout's index.json with the images that have a name: pushing a name again leaves the image it named
    before in the index without one."""
    index = json.loads((layout / "index.json").read_text())
    index["manifests"] = [m for m in index["manifests"] if REF_NAME in m.get("annotations", {})]
    return index


def referenced(layout: Path) -> set[str]:
    """Every blob digest a named image of the layout needs: indexes, manifests, configs, layers."""
    return _walk(layout)[0]


def _walk(layout: Path) -> tuple[set[str], set[str]]:
    """(every blob a named image needs, the layers among them)."""
    seen: set[str] = set()
    layers: set[str] = set()
    todo = list(named_index(layout)["manifests"])
    while todo:
        desc = todo.pop()
        if desc["digest"] in seen:
            continue
        seen.add(desc["digest"])
        if "manifest" in desc["mediaType"] or "index" in desc["mediaType"]:
            doc = json.loads(_blob(layout, desc["digest"]).read_text())
            todo.extend(doc.get("manifests", []))
            todo.extend([doc["config"]] if "config" in doc else [])
            todo.extend(doc.get("layers", []))
            layers.update(d["digest"] for d in doc.get("layers", []))
    return seen, layers


def write_tar(layout: Path, have: set[str]) -> None:
    index = json.dumps(named_index(layout)).encode()
    with tarfile.open(fileobj=sys.stdout.buffer, mode="w|") as tar:
        tar.add(layout / "oci-layout", arcname="oci-layout")
        info = tarfile.TarInfo("index.json")
        info.size = len(index)
        tar.addfile(info, io.BytesIO(index))
        for digest in sorted(referenced(layout) - have):
            path = _blob(layout, digest)
            tar.add(path, arcname=str(path.relative_to(layout)))


def _replace_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def link(layout: Path, content: Path) -> None:
    """Layers only are shared with containerd: buildah rewrites a manifest in place (truncating the file) when
    it pushes the same image again, which must never touch containerd's copy. Manifests and configs are a few
    kilobytes."""
    _replace_text(layout / "index.json", json.dumps(named_index(layout)))
    keep, layers = _walk(layout)
    for path in (layout / "blobs").glob("*/*"):
        digest = f"{path.parent.name}:{path.name}"
        if digest not in keep:  # an image that lost its name, or a leftover of an interrupted run
            path.unlink()
            continue
        theirs = content / "blobs" / path.parent.name / path.name
        if digest in layers and theirs.exists() and not path.samefile(theirs):
            tmp = path.with_name(path.name + ".link")
            tmp.unlink(missing_ok=True)
            os.link(theirs, tmp)
            tmp.replace(path)


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "tar":
        write_tar(Path(argv[1]), set(argv[2:]))
    elif len(argv) == 3 and argv[0] == "link":
        link(Path(argv[1]), Path(argv[2]))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
