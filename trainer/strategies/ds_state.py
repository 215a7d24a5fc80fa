"""DeepSpeed's state in portable form (docs/design.md, Checkpoints). DeepSpeed keeps fp32 masters and Adam moments
in flat partitions; its fragment APIs tell which range of each parameter this rank owns. ZeRO-1/2:
the `_hp_mapping` fragment (any range, or none); ZeRO-3: the partition of the flat parameter numbered by
this rank's place in the parameter's own group. strategy.tp: of this rank's AutoTP slice, which lies in
the full tensor where ds_tp.py's `tensor_slice` says. `ZeroPartitions` is built by DeepSpeedStrategy once
its engine exists, with what it reads."""
from __future__ import annotations

import torch
import torch.distributed as dist

from trainer.checkpoint.format import ADAM_KEYS, STEP_KEY, Piece, replica_slice, state_keys
from trainer.layout import Layout
from trainer.models.experts import ExpertRows
from trainer.models.weights import Block, canonical_name
from trainer.strategies.adam_state import AdamState
from trainer.strategies.ds_tp import tensor_slice


def z3_range(p, experts: ExpertRows | None = None) -> tuple[int, int]:
    """(start, numel) of this rank's partition of a ZeRO-3 parameter (numel 0: padding only): partition
    our rank in the group it is partitioned over (the world; strategy.ep: the ranks holding the same
    experts; strategy.tp: the data-parallel group). strategy.ep: a parameter of this rank's experts
    begins at its first expert's row of the full parameter."""
    size = p.ds_tensor.numel()  # partition size, padded on the last ranks
    rows = experts.group.rank * p.ds_numel if experts is not None and p in experts else 0
    start = dist.get_rank(p.ds_process_group) * size
    return rows + start, max(0, min(size, p.ds_numel - start))


def z3_local(p, experts: ExpertRows | None = None) -> tuple[int, torch.Tensor]:
    start, numel = z3_range(p, experts)
    return start, p.ds_tensor.data.view(-1)[:numel]


def named_params(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(canonical_name(n), p) for n, p in module.named_parameters()]


class ZeroPartitions:
    """A DeepSpeed engine's masters, moments and step count, read and written as portable pieces."""

    def __init__(self, engine, stage: int, layout: Layout, experts: ExpertRows):
        self.engine, self.stage, self.layout = engine, stage, layout
        self.rank, self.world_size = layout.rank, layout.degrees.world
        self.experts = experts  # strategy.ep: parameters of this rank's experts, held by world / ep ranks
        zero = engine.optimizer
        self.adam = AdamState(zero.optimizer, self.masters(), self._update)  # Adam inside DeepSpeed's optimizer

    def masters(self) -> list[torch.Tensor]:
        """The fp32 master partitions: ZeRO-1/2 and ZeRO-3 name them differently."""
        zero = self.engine.optimizer
        return getattr(zero, "single_partition_of_fp32_groups", None) or zero.fp32_partitioned_groups_flat

    def place(self, p: torch.nn.Parameter) -> tuple[int, Block | None]:
        """Where the flat values of this rank's part of `p` begin in the full tensor, or the `Block` they
        count in: strategy.tp's slice (ds_tp.py); strategy.ep's lora_B of its experts. ZeRO's ranges of
        the part count from there (strategy.ep's experts' rows: `ExpertRows.start`, z3_range)."""
        if self.layout.degrees.tp > 1:
            return tensor_slice(p, self.layout.tp_rank)[:2]
        return 0, self.experts.block(p)

    def _saves(self, p: torch.nn.Parameter) -> bool:
        """strategy.tp: a parameter whole on every rank of the tensor group is saved by its first rank."""
        return self.layout.degrees.tp == 1 or tensor_slice(p, self.layout.tp_rank).saved

    def _update(self) -> None:  # the way DeepSpeed steps its partitions
        if self.stage == 3:
            for i in range(len(self.masters())):
                self.engine.optimizer._optimizer_step(i)
        else:
            self.engine.optimizer.optimizer.step()

    def _fragments(self, model_only: bool = False):
        """(name, start, numel, {"param"|moment: this rank's fp32 range}, `Block` | None, saved here) per
        owned parameter."""
        from deepspeed.utils import (
            lazy_init_hp_params_optimizer_state,
            safe_get_local_fp32_param,
            safe_get_local_optimizer_state,
        )

        zero = self.engine.optimizer
        moments = () if model_only else ADAM_KEYS
        if self.stage < 3 and moments:
            # Link every parameter's moment fragments. DeepSpeed links once, after stepping the
            # first param group only, so with two groups the second stays unlinked.
            for group, flat in zip(zero.bit16_groups, zero.single_partition_of_fp32_groups):
                lazy_init_hp_params_optimizer_state(group, flat, zero.optimizer.state)
        for name, p in named_params(self.engine.module):
            if not p.requires_grad:  # frozen: no master, no moments; the parameter itself
                if self.stage == 3:
                    start, local = z3_local(p, self.experts)
                else:
                    ep = self.experts.group.size if p in self.experts else 1
                    start, local, _ = replica_slice(self.experts.start(p), p.detach().view(-1), self.world_size // ep,
                                                    self.rank // ep)
                yield name, start, local.numel(), {"param": local}, self.experts.block(p), True
                continue
            at, block = self.place(p)
            if self.stage == 3:
                start, numel = z3_range(p, self.experts)
                local = {"param": safe_get_local_fp32_param(p)}
                local.update({k: safe_get_local_optimizer_state(p, k) for k in moments})
                yield name, at + start, numel, {k: v.view(-1)[:numel] for k, v in local.items()}, block, self._saves(p)
            elif getattr(p, "_hp_mapping", None) is not None:
                m = p._hp_mapping
                local = {"param": m.get_hp_fragment(), **{k: m.get_hp_fragment(k) for k in moments}}
                yield (name, at + self.experts.start(p) + m.lp_fragment_address.start, m.lp_fragment_address.numel,
                       local, block, self._saves(p))

    def state_dict(self, model_only: bool, with_step: bool) -> dict[str, Piece]:
        if not model_only:  # also before the first update (step 1 skipped): moments of zeros, step 0
            self.adam.create()
        pieces = {state_keys(name)[what]: Piece(start, t, block) for name, start, numel, local, block, saved
                  in self._fragments(model_only) for what, t in local.items() if numel and saved}
        if with_step and not model_only:
            pieces[STEP_KEY] = Piece(0, torch.tensor([self.adam.step_count()]))
        return pieces

    def state_layout(self) -> dict[str, tuple]:
        self.adam.create()
        layout = {state_keys(name)[what]: (start, numel, block) for name, start, numel, local, block, _
                  in self._fragments() for what in local if numel}
        if self.stage < 3:  # the full (low-precision) parameters (strategy.tp: slices) live on every rank: load them whole
            layout.update({state_keys(name)["param"]: (at + self.experts.start(p), p.numel(), block)
                           for name, p in named_params(self.engine.module) for at, block in [self.place(p)]})
        return {**layout, STEP_KEY: (0, 1)}

    @torch.no_grad()
    def load_state_dict(self, values: dict[str, torch.Tensor]) -> None:
        from deepspeed.utils import safe_set_local_fp32_param, safe_set_local_optimizer_state

        for name, p in named_params(self.engine.module):
            keys = state_keys(name)
            if keys["param"] not in values:  # frozen pretrained weights, which a checkpoint does not save
                continue
            if self.stage == 3 and not p.requires_grad:
                if z3_range(p, self.experts)[1]:
                    z3_local(p, self.experts)[1].copy_(values[keys["param"]])
                continue
            if self.stage == 3:
                start, numel = z3_range(p, self.experts)
                if not numel:
                    continue
                padded = torch.zeros(p.ds_tensor.numel(), dtype=torch.float32, device=p.ds_tensor.device)
                for what, key in keys.items():
                    padded[:numel].copy_(values[key])
                    if what == "param":
                        safe_set_local_fp32_param(p, padded)
                        p.ds_tensor.data.view(-1)[:numel].copy_(values[key])
                    else:
                        safe_set_local_optimizer_state(p, padded, what)
                continue
            full = values[keys["param"]]
            p.data.view(-1).copy_(full)
            m = getattr(p, "_hp_mapping", None)  # None: frozen, or held by another rank
            if m is not None:
                start, numel = m.lp_fragment_address.start, m.lp_fragment_address.numel
                m.get_hp_fragment().copy_(full[start:start + numel])
                for k in ADAM_KEYS:
                    m.get_hp_fragment(k).copy_(values[keys[k]])
        self.adam.set_step_count(values[STEP_KEY].item())
