"""hack/node/oci_import.py: what reaches containerd when an image changes, and what the OCI layout keeps."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("oci_import", REPO / "hack" / "node" / "oci_import.py")
assert _spec and _spec.loader
oci_import = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(oci_import)

MANIFEST = "application/vnd.oci.image.manifest.v1+json"


def _put(layout: Path, data: bytes) -> str:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    path = layout / "blobs" / "sha256" / digest.split(":")[1]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return digest


def _blob_bytes(layout: Path, digest: str) -> bytes:
    return (layout / "blobs" / "sha256" / digest[7:]).read_bytes()


def _image(layout: Path, layers: list[bytes]) -> dict[str, str]:
    """An OCI layout holding one image of `layers`; the digests by role."""
    config = _put(layout, b'{"architecture": "amd64"}')
    digests = [_put(layout, data) for data in layers]
    manifest = {
        "schemaVersion": 2,
        "mediaType": MANIFEST,
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config, "size": 1},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": d, "size": 1} for d in digests],
    }
    mdigest = _put(layout, json.dumps(manifest).encode())
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    named = {"mediaType": MANIFEST, "digest": mdigest, "size": 1, "annotations": {oci_import.REF_NAME: "w:1"}}
    index_path = layout / "index.json"
    # Pushed again under the same name: the image named before stays in the index, without its name.
    before = json.loads(index_path.read_text())["manifests"] if index_path.exists() else []
    for m in before:
        m.pop("annotations", None)
    index_path.write_text(json.dumps({"schemaVersion": 2, "manifests": [*before, named]}))
    return {"config": config, "manifest": mdigest, **{f"layer{i}": d for i, d in enumerate(digests)}}


def _tar_names(layout: Path, have: set[str], capsysbinary: pytest.CaptureFixture[bytes]) -> set[str]:
    oci_import.write_tar(layout, have)
    data = capsysbinary.readouterr().out
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return set(tar.getnames())


def test_the_tar_leaves_out_what_containerd_holds(tmp_path: Path, capsysbinary: pytest.CaptureFixture[bytes]) -> None:
    d = _image(tmp_path, [b"torch" * 1000, b"the code"])
    everything = _tar_names(tmp_path, set(), capsysbinary)
    assert everything == {"oci-layout", "index.json"} | {f"blobs/sha256/{v.split(':')[1]}" for v in d.values()}

    # A code change: containerd holds the dependencies' layer and the config; only the rest travels.
    sent = _tar_names(tmp_path, {d["layer0"], d["config"]}, capsysbinary)
    assert sent == {"oci-layout", "index.json", f"blobs/sha256/{d['manifest'][7:]}", f"blobs/sha256/{d['layer1'][7:]}"}


def test_an_image_that_lost_its_name_is_not_sent(tmp_path: Path, capsysbinary: pytest.CaptureFixture[bytes]) -> None:
    old = _image(tmp_path, [b"torch" * 1000, b"the code before"])
    new = _image(tmp_path, [b"torch" * 1000, b"the code"])
    sent = _tar_names(tmp_path, {new["layer0"], new["config"]}, capsysbinary)
    assert f"blobs/sha256/{old['layer1'][7:]}" not in sent and f"blobs/sha256/{old['manifest'][7:]}" not in sent
    assert f"blobs/sha256/{new['layer1'][7:]}" in sent


def test_link_shares_containerds_copies_and_drops_what_no_image_needs(tmp_path: Path) -> None:
    layout, content = tmp_path / "layout", tmp_path / "content"
    stale = _image(layout, [b"the code before the change"])["layer0"]
    d = _image(layout, [b"torch" * 1000, b"the code"])
    (content / "blobs" / "sha256").mkdir(parents=True)
    for key in ("layer0", "manifest"):
        theirs = content / "blobs" / "sha256" / d[key][7:]
        theirs.write_bytes(_blob_bytes(layout, d[key]))
    (layout / "blobs" / "sha256" / (d["layer1"][7:] + ".link")).write_bytes(b"left by an interrupted run")

    oci_import.link(layout, content)

    ours = layout / "blobs" / "sha256"
    assert (ours / d["layer0"][7:]).samefile(content / "blobs" / "sha256" / d["layer0"][7:])  # one copy on disk
    # A manifest is never shared: buildah rewrites it in place when it pushes the same image again.
    assert not (ours / d["manifest"][7:]).samefile(content / "blobs" / "sha256" / d["manifest"][7:])
    assert not (ours / (d["layer1"][7:] + ".link")).exists()
    assert not (layout / "blobs" / "sha256" / stale[7:]).exists()
    assert oci_import.referenced(layout) == set(d.values())
    assert len(json.loads((layout / "index.json").read_text())["manifests"]) == 1
    assert all((layout / "blobs" / "sha256" / v[7:]).exists() for v in d.values())
