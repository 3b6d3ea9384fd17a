"""`spec.lora`: LoRA adapters served beside the base model (docs/lora.md), the same on prefill and decode.

Each adapter is a directory in PEFT's format from a ConfigMap (its keys `adapter_config.json` and
`adapter_model.safetensors`, the latter as binaryData: an adapter of at most 1 MiB), a PersistentVolumeClaim (a
directory in it) or a node's directory; every pod of both roles mounts it read-only at /lora/NAME and is told
`--lora-modules NAME=/lora/NAME`. Both roles get the same adapters from the same block, so a request for one can
always be paired (a decode that lacks an adapter its prefill computed under would refuse the KV). A worker that
cannot load an adapter stops at start-up naming it, so a Ready pod serves every adapter the block declares.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from disagg_api import settings as S
from disagg_api.setting import Setting

from . import names


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter: its name (what requests put in `model`) and exactly one source of its directory."""

    name: str
    config_map: str | None = None
    pvc: str | None = None
    path: str = ""  # inside the PVC; "" for its root
    host_path: str | None = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "LoraAdapter":
        return cls(str(d["name"]), d.get("configMap"), d.get("pvc"), str(d.get("path", "")), d.get("hostPath"))

    @property
    def mount_path(self) -> str:
        return f"{names.LORA_MOUNT}/{self.name}"

    def source(self) -> tuple[str, str, str]:
        """(kind, name, path) of where its files are: what a change of it rolls the pods for."""
        if self.config_map:
            return "configMap", self.config_map, ""
        if self.pvc:
            return "pvc", self.pvc, self.path
        return "hostPath", self.host_path or "", ""


@dataclass(frozen=True)
class LoraSpec:
    """The adapters and the slots that hold them (`--max-loras`, `--max-lora-rank`)."""

    adapters: tuple[LoraAdapter, ...]
    max_loras: int = S.MAX_LORAS.default
    max_lora_rank: int = S.MAX_LORA_RANK.default

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "LoraSpec | None":
        """None for no block, or a block that names no adapter (a worker with no adapter runs no LoRA code)."""
        if not d or not d.get("adapters"):
            return None
        return cls(
            tuple(LoraAdapter.from_dict(a) for a in d["adapters"]),
            int(d.get("maxLoras", S.MAX_LORAS.default)),
            int(d.get("maxLoraRank", S.MAX_LORA_RANK.default)),
        )

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.adapters)

    def settings(self) -> list[tuple[Setting, Any]]:
        """Every worker's LoRA flags: each adapter at its mount, then the slots."""
        modules = tuple(f"{a.name}={a.mount_path}" for a in self.adapters)
        return [(S.LORA_MODULES, modules), (S.MAX_LORAS, self.max_loras), (S.MAX_LORA_RANK, self.max_lora_rank)]

    def volumes(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The pods' volumes and the worker container's read-only mounts, one mount per adapter: a ConfigMap or a
        node directory a volume each, a PVC one volume however many adapters it holds (a directory each, by
        subPath)."""
        vols: list[dict[str, Any]] = []
        mounts: list[dict[str, Any]] = []
        claims: dict[str, str] = {}  # PVC -> its volume's name
        for i, a in enumerate(self.adapters):
            vol = f"lora-{i}"
            mount: dict[str, Any] = {"name": vol, "mountPath": a.mount_path, "readOnly": True}
            if a.config_map:
                vols.append({"name": vol, "configMap": {"name": a.config_map}})
            elif a.pvc:
                if a.pvc not in claims:
                    claims[a.pvc] = vol
                    vols.append({"name": vol, "persistentVolumeClaim": {"claimName": a.pvc, "readOnly": True}})
                mount["name"] = claims[a.pvc]
                if a.path.strip("/"):
                    mount["subPath"] = a.path.strip("/")
            else:
                vols.append({"name": vol, "hostPath": {"path": a.host_path, "type": "Directory"}})
            mounts.append(mount)
        return vols, mounts
