"""The ranks of one instance and how they talk: torch.distributed, gloo on CPU, NCCL on CUDA.

An instance with tensor parallel size T and pipeline parallel size P runs T * P scheduler
processes; world rank = pp_rank * T + tp_rank. Tensors that the forward exchanges (the row-parallel
all-reduces, the hidden states between stages) go through the device backend; Python objects
(the step's plan, transfer commands, poll results) go through a gloo group, pickled.

With DP attention a stage's tensor ranks form `dp_size` attention groups: the attention's all-reduce,
the driver's broadcast and the transfer agreement run within a group (a group is, to them, what a stage
is without DP attention), the MLP's all-reduce, the experts' all-to-all and the gather of every group's
tokens over the whole stage, and the groups' drivers agree before each step whether it runs a forward.

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

from disagg_worker.model.decoder import Collectives, GroupRows
from disagg_worker.model.parallel import Shard
from disagg_worker.ranks.address import RankAddress


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

    def any_group(self, flag: bool) -> bool:
        """True when this or any other attention group's driver passes True (DP attention)."""
        return flag

    def min_in_stage(self, values: list[int]) -> list[int]:
        return values

    def union_in_stage(self, items: set[int]) -> set[int]:
        return items

    def min_over_ranks(self, value: int) -> int:
        return value

    def close(self) -> None:
        pass


class Comm(SoloComm):
    """A rank of a multi-rank instance: its tensor-parallel group and its neighbours in the pipeline.

    `tp_group`/`tp_objects` are the rank's attention group (the stage's tensor ranks without DP attention),
    `mlp_group` all of the stage's tensor ranks, `drivers` the attention groups' first ranks (DP attention).
    """

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
        tp, attn, dp = shard.tp_size, shard.attn_tp_size, shard.dp_size
        first = shard.pp_rank * tp + shard.dp_rank * attn
        mine = [first + a for a in range(attn)]
        # Every rank must create every group, in the same order.
        self.tp_group: dist.ProcessGroup | None = None
        self.tp_objects: dist.ProcessGroup | None = None
        self.mlp_group: dist.ProcessGroup | None = None
        for pp in range(shard.pp_size):
            if dp > 1:
                stage_group = _group([pp * tp + t for t in range(tp)], timeout)
                if pp == shard.pp_rank:
                    self.mlp_group = stage_group
            for d in range(dp):
                ranks = [pp * tp + d * attn + a for a in range(attn)]
                device_group, object_group = _group(ranks, timeout), _group(ranks, timeout, "gloo")
                if ranks == mine:
                    self.tp_group, self.tp_objects = device_group, object_group
        if dp == 1:
            self.mlp_group = self.tp_group
        self.drivers = _group([d * attn for d in range(dp)], timeout, "gloo") if dp > 1 else None
        objects = _group(list(range(world)), timeout, "gloo")
        if objects is None:
            raise RuntimeError("this rank is not in its own instance's group")
        self.objects = objects
        self.stage_root = first

    # ---- tensor parallel (within a stage) ---------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the attention group (the row-parallel attention output)."""
        if self.shard.attn_tp_size > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def mlp_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over every tensor rank of the stage (the row-parallel MLP and expert outputs)."""
        if self.shard.tp_size > 1:
            dist.all_reduce(x, group=self.mlp_group)
        return x

    def collectives(self) -> Collectives:
        return Collectives(
            self.mlp_all_reduce,
            self if self.shard.ep_size > 1 else None,
            attn_all_reduce=self.all_reduce,
            group_rows=self.group_rows if self.shard.dp_size > 1 else None,
        )

    def all_to_all(self, x: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """Rows of x to the stage's tensor ranks, `send_counts[d]` to rank d; what each sent to this rank."""
        out = x.new_empty((sum(recv_counts), *x.shape[1:]))
        dist.all_to_all_single(
            out, x.contiguous(), output_split_sizes=recv_counts, input_split_sizes=send_counts, group=self.mlp_group
        )
        return out

    def group_rows(self, n: int) -> GroupRows:
        """DP attention, once per forward: how many tokens each attention group has (this one `n`)."""
        counts = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.shard.tp_size)]
        mine = torch.tensor([n], dtype=torch.int64, device=self.device)
        dist.all_gather(counts, mine, group=self.mlp_group)
        attn = self.shard.attn_tp_size
        sizes = [int(c.item()) for c in counts[::attn]]  # a group's ranks hold the same tokens
        return GroupRows(tuple(sizes), self.shard.dp_rank, self._gather)

    def _gather(self, x: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
        """Every attention group's rows of x, group after group, on every rank of the stage."""
        padded = x.new_zeros((max(sizes), *x.shape[1:]))
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in range(self.shard.tp_size)]
        dist.all_gather(parts, padded, group=self.mlp_group)
        attn = self.shard.attn_tp_size
        return torch.cat([parts[d * attn][:n] for d, n in enumerate(sizes)])

    def any_group(self, flag: bool) -> bool:
        if self.drivers is None:
            return flag
        t = torch.tensor([int(flag)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.drivers)
        return bool(t.item())

    def broadcast_in_stage(self, obj: Any) -> Any:
        """The first rank of this rank's attention group (its stage without DP attention) gives `obj` to
        every rank of the group."""
        if self.shard.attn_tp_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.stage_root, group=self.tp_objects)
        return box[0]

    def min_in_stage(self, values: list[int]) -> list[int]:
        """Element-wise minimum over the attention group's ranks (every rank passes the same length)."""
        if self.shard.attn_tp_size == 1 or not values:
            return values
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.tp_objects)
        return [int(v) for v in t.tolist()]

    def min_over_ranks(self, value: int) -> int:
        """The smallest `value` any rank of the instance passes (every rank must call it at the same point)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.objects)
        return int(t.item())

    def union_in_stage(self, items: set[int]) -> set[int]:
        """The union of every rank's set over the attention group."""
        if self.shard.attn_tp_size == 1:
            return items
        gathered: list[Any] = [None] * self.shard.attn_tp_size
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
