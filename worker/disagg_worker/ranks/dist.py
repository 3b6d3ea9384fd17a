"""The ranks of one instance and how they talk: torch.distributed, gloo on CPU, NCCL on CUDA.

An instance with tensor parallel size T and pipeline parallel size P runs T * P scheduler
processes; world rank = pp_rank * T + tp_rank. Tensors that the forward exchanges (the row-parallel
all-reduces, the hidden states between stages) go through the device backend; Python objects
(the step's plan, transfer commands, poll results) go through a gloo group, pickled.

`Comm` is what the engine needs of them; a single-rank instance gets `SoloComm`, which does
nothing and needs no torch.distributed at all.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from disagg_worker.model.decoder import Collectives
from disagg_worker.model.parallel import Shard


@dataclass(frozen=True)
class RankAddress:
    """Where the ranks of an instance meet (a TCP store on the driver's host)."""

    host: str
    port: int

    @classmethod
    def parse(cls, addr: str) -> RankAddress:
        host, _, port = addr.rpartition(":")
        return cls(host.strip("[]"), int(port))

    @property
    def init_method(self) -> str:
        return f"tcp://{self.host}:{self.port}"


def _group(ranks: list[int], timeout: timedelta, backend: str | None = None) -> dist.ProcessGroup | None:
    """A new process group of `ranks` (None on a rank outside it)."""
    group = dist.new_group(ranks, backend=backend, timeout=timeout)
    return group if isinstance(group, dist.ProcessGroup) else None


@dataclass
class Posted:
    """Sends in progress and the tensors they read (alive until the sends complete)."""

    works: list[Any]
    tensors: list[torch.Tensor]

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works, self.tensors = [], []


class SoloComm:
    """The one rank of a single-rank instance."""

    def __init__(self) -> None:
        self.shard = Shard()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def collectives(self) -> Collectives:
        """What the model's layers use of this rank's groups."""
        return Collectives(self.all_reduce)

    def broadcast_in_stage(self, obj: Any) -> Any:
        return obj

    def min_in_stage(self, values: list[int]) -> list[int]:
        return values

    def union_in_stage(self, items: set[int]) -> set[int]:
        return items

    def close(self) -> None:
        pass


class Comm(SoloComm):
    """A rank of a multi-rank instance: its tensor-parallel group and its neighbours in the pipeline."""

    def __init__(self, shard: Shard, address: RankAddress, device: str, timeout_s: float = 300.0):
        """`timeout_s`: the longest one collective may wait for the other ranks (`DisaggConfig.dist_timeout_s`)."""
        super().__init__()
        timeout = timedelta(seconds=timeout_s)
        self.shard = shard
        world = shard.tp_size * shard.pp_size
        backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(
            backend,
            init_method=address.init_method,
            world_size=world,
            rank=shard.world_rank,
            timeout=timeout,
        )
        self.device = torch.device(device)
        stage = [shard.pp_rank * shard.tp_size + t for t in range(shard.tp_size)]
        # Every rank must create every group, in the same order.
        self.tp_group: dist.ProcessGroup | None = None
        self.tp_objects: dist.ProcessGroup | None = None
        for pp in range(shard.pp_size):
            ranks = [pp * shard.tp_size + t for t in range(shard.tp_size)]
            device_group, object_group = _group(ranks, timeout), _group(ranks, timeout, "gloo")
            if ranks == stage:
                self.tp_group, self.tp_objects = device_group, object_group
        objects = _group(list(range(world)), timeout, "gloo")
        if objects is None:
            raise RuntimeError("this rank is not in its own instance's group")
        self.objects = objects
        self.stage_root = stage[0]

    # ---- tensor parallel (within a stage) ---------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.shard.tp_size > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def collectives(self) -> Collectives:
        return Collectives(self.all_reduce, self if self.shard.ep_size > 1 else None)

    def all_to_all(self, x: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """Rows of x to the stage's tensor ranks, `send_counts[d]` to rank d; what each sent to this rank."""
        out = x.new_empty((sum(recv_counts), *x.shape[1:]))
        dist.all_to_all_single(
            out, x.contiguous(), output_split_sizes=recv_counts, input_split_sizes=send_counts, group=self.tp_group
        )
        return out

    def broadcast_in_stage(self, obj: Any) -> Any:
        """The stage's tensor-parallel rank 0 gives `obj` to every rank of its stage."""
        if self.shard.tp_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.stage_root, group=self.tp_objects)
        return box[0]

    def min_in_stage(self, values: list[int]) -> list[int]:
        """Element-wise minimum over the stage's ranks (every rank passes the same length)."""
        if self.shard.tp_size == 1 or not values:
            return values
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.tp_objects)
        return [int(v) for v in t.tolist()]

    def union_in_stage(self, items: set[int]) -> set[int]:
        """The union of every rank's set over the stage."""
        if self.shard.tp_size == 1:
            return items
        gathered: list[Any] = [None] * self.shard.tp_size
        dist.all_gather_object(gathered, items, group=self.tp_objects)
        return set().union(*gathered)

    # ---- pipeline parallel (between stages) --------------------------------------------------------
    def send_to(self, rank: int, obj: Any, tensor: torch.Tensor | None = None) -> None:
        """Send a Python object and optionally a tensor (on this rank's device) to world rank `rank`."""
        for work in self.post_to(rank, obj, tensor).works:
            work.wait()

    def post_to(self, rank: int, obj: Any, tensor: torch.Tensor | None = None) -> Posted:
        """Start sending what `send_to` sends and return at once; the send completes while the
        receiver takes it (keep the result until `Posted.wait`)."""
        meta = None if tensor is None else (tuple(tensor.shape), tensor.dtype)
        data = pickle.dumps((obj, meta), protocol=pickle.HIGHEST_PROTOCOL)
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        tensors = [size, payload]
        works = [dist.isend(size, rank, group=self.objects), dist.isend(payload, rank, group=self.objects)]
        if tensor is not None:
            tensors.append(tensor.contiguous())
            works.append(dist.isend(tensors[-1], rank))
        return Posted([w for w in works if w is not None], tensors)

    def recv_from(self, rank: int) -> tuple[Any, torch.Tensor | None]:
        """What `send_to` sent from world rank `rank`: (object, tensor or None)."""
        size = torch.empty(1, dtype=torch.int64)
        dist.recv(size, rank, group=self.objects)
        payload = torch.empty(int(size[0]), dtype=torch.uint8)
        dist.recv(payload, rank, group=self.objects)
        obj, meta = pickle.loads(payload.numpy().tobytes())
        if meta is None:
            return obj, None
        tensor = torch.empty(meta[0], dtype=meta[1], device=self.device)
        dist.recv(tensor, rank)
        return obj, tensor

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
