"""Where each rank stands on the parallel axes: one object that the strategy, the data, the loss and
the checkpoints ask, instead of each computing groups of its own.

The world is data-parallel x sequence-parallel ranks (`strategy.sp`): a sequence-parallel group is
`sp` consecutive ranks, holding shares of the same rows, so the data's ranks (`dp_rank`, `dp_size`)
are `rank // sp` of `world // sp`. Expert parallelism (`strategy.ep`) takes its ranks from the
data-parallel ranks (torchtitan's dp2ep): an expert group is `ep` consecutive ranks, rank e of it
holding experts [e E/ep, (e+1) E/ep) of every MoE layer; the ranks holding the same experts (`rank %
ep`, one per expert group) are its expert-data-parallel group, over which those experts' gradients
are reduced and their rows sharded. The backends see the whole world as data-parallel for every
other weight: sequence parallelism is not told to them (models/sequence.py says why).

Tensor parallelism (`strategy.tp`, fsdp; without sp and ep) splits each layer's weights over a tensor
group of `tp` consecutive ranks, which read the same rows: the data's ranks are `rank // tp` of
`world // tp`, and the backend shards and averages over those data-parallel ranks only (the 2-D
("dp", "tp") mesh of torchtitan). A tensor group computes one loss `tp` times: its first rank counts it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainer.models.experts import ONE_EXPERT_GROUP, ExpertGroup
from trainer.models.sequence import WHOLE_ROWS, SequenceGroup


@dataclass(frozen=True)
class Degrees:
    """The sizes of the parallel axes, for a world of `world` ranks."""
    world: int
    sp: int = 1
    ep: int = 1
    tp: int = 1

    def coordinates(self, rank: int) -> dict[str, int]:
        """Where `rank` stands: its data-parallel rank (the data it reads), its place in its sequence
        group, its expert group and its place in it (which experts it holds), its place in its tensor
        group (which part of each split weight it holds)."""
        return {"dp": rank // (self.sp * self.tp), "sp": rank % self.sp, "expert_group": rank // self.ep,
                "ep": rank % self.ep, "tp": rank % self.tp}

    @property
    def dp(self) -> int:
        return self.world // (self.sp * self.tp)

    @property
    def averaged(self) -> int:
        """The ranks a backend averages gradients over: every rank but a tensor group's copies (the ranks
        of a sequence group are data-parallel to the backends)."""
        return self.world // self.tp


class Layout:
    """This rank's groups on every axis, created on every rank in the same order (`new_group` is
    collective). Sizes of 1 create no group."""

    def __init__(self, degrees: Degrees, rank: int):
        self.degrees, self.rank = degrees, rank
        at = degrees.coordinates(rank)
        self.dp_rank, self.dp_size = at["dp"], degrees.dp
        self.tp_rank = at["tp"]
        self.counts_loss = self.tp_rank == 0  # strategy.tp: a tensor group's ranks compute the same loss; one counts it
        self.sequence = self._consecutive(degrees.sp, SequenceGroup) if degrees.sp > 1 else WHOLE_ROWS
        self.experts = self._consecutive(degrees.ep, ExpertGroup) if degrees.ep > 1 else ONE_EXPERT_GROUP

    def _consecutive(self, size: int, kind):
        """This rank's group among groups of `size` consecutive ranks."""
        groups = [dist.new_group(list(range(start, start + size))) for start in range(0, self.degrees.world, size)]
        return kind(groups[self.rank // size], size, self.rank % size)

    def data_mesh(self, device_type: str, shard: int) -> DeviceMesh:
        """Every rank as a data-parallel rank (the backends are not told of sp), sharding within groups
        of `shard` consecutive ranks and replicating across them: 2-D ("replicate", "shard") where
        both are > 1 (HSDP; shard 1: NO_SHARD), else one dimension."""
        world = self.degrees.world
        if shard == world:
            return init_device_mesh(device_type, (world,))
        return init_device_mesh(device_type, (world // shard, shard), mesh_dim_names=("replicate", "shard"))

    def expert_data_mesh(self, device_type: str) -> DeviceMesh:
        """The ranks that hold the same experts as this one (one in each expert group), as a device
        mesh: FSDP2 shards those experts over it."""
        world, ep = self.degrees.world, self.degrees.ep
        return init_device_mesh(device_type, (world // ep, ep), mesh_dim_names=("expert_data", "expert"))["expert_data"]

    def tensor_mesh(self, device_type: str) -> DeviceMesh:
        """strategy.tp: the 2-D ("dp", "tp") mesh, a tensor group of `tp` consecutive ranks on "tp": the
        weights split over "tp", sharded by FSDP2 over "dp"."""
        world, tp = self.degrees.world, self.degrees.tp
        return init_device_mesh(device_type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
