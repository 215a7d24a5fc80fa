"""DeepSpeed's state in portable form (docs/design.md, Checkpoints). DeepSpeed keeps fp32 masters and Adam moments
in flat partitions; its fragment APIs tell which range of each parameter this rank owns. ZeRO-1/2:
the `_hp_mapping` fragment (any range, or none); ZeRO-3: partition `rank` of the flat parameter.
`ZeroPartitions` is built by DeepSpeedStrategy once its engine exists, with what it reads."""
from __future__ import annotations

import torch

from trainer.checkpoint.format import ADAM_KEYS, STEP_KEY, Piece, replica_slice, state_keys
from trainer.models.experts import ExpertRows
from trainer.models.weights import Block, canonical_name
from trainer.strategies.adam_state import AdamState


def z3_range(p, rank: int, experts: ExpertRows | None = None) -> tuple[int, int]:
    """(start, numel) of a ZeRO-3 parameter's partition on `rank` (numel 0: padding only). strategy.ep:
    a parameter of this rank's experts is partitioned over the ranks that hold them (rank // ep among
    them), and begins at its first expert's row of the full parameter."""
    size = p.ds_tensor.numel()  # partition size, padded on the last ranks
    part, rows = rank, 0
    if experts is not None and p in experts:
        part, rows = rank // experts.group.size, experts.group.rank * p.ds_numel
    start = part * size
    return rows + start, max(0, min(size, p.ds_numel - start))


def z3_local(p, rank: int, experts: ExpertRows | None = None) -> tuple[int, torch.Tensor]:
    start, numel = z3_range(p, rank, experts)
    return start, p.ds_tensor.data.view(-1)[:numel]


def named_params(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(canonical_name(n), p) for n, p in module.named_parameters()]


class ZeroPartitions:
    """A DeepSpeed engine's masters, moments and step count, read and written as portable pieces."""

    def __init__(self, engine, stage: int, rank: int, world_size: int, experts: ExpertRows):
        self.engine, self.stage, self.rank, self.world_size = engine, stage, rank, world_size
        self.experts = experts  # strategy.ep: parameters of this rank's experts, held by world / ep ranks
        zero = engine.optimizer
        self.adam = AdamState(zero.optimizer, self.masters(), self._update)  # Adam inside DeepSpeed's optimizer

    def masters(self) -> list[torch.Tensor]:
        """The fp32 master partitions: ZeRO-1/2 and ZeRO-3 name them differently."""
        zero = self.engine.optimizer
        return getattr(zero, "single_partition_of_fp32_groups", None) or zero.fp32_partitioned_groups_flat

    def _update(self) -> None:  # the way DeepSpeed steps its partitions
        if self.stage == 3:
            for i in range(len(self.masters())):
                self.engine.optimizer._optimizer_step(i)
        else:
            self.engine.optimizer.optimizer.step()

    def _fragments(self, model_only: bool = False):
        """(name, start, numel, {"param"|moment: this rank's fp32 range}) per owned parameter."""
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
                    start, local = z3_local(p, self.rank, self.experts)
                else:
                    ep = self.experts.group.size if p in self.experts else 1
                    start, local, _ = replica_slice(self.experts.start(p), p.detach().view(-1), self.world_size // ep,
                                                    self.rank // ep)
                yield name, start, local.numel(), {"param": local}
            elif self.stage == 3:
                start, numel = z3_range(p, self.rank, self.experts)
                local = {"param": safe_get_local_fp32_param(p)}
                local.update({k: safe_get_local_optimizer_state(p, k) for k in moments})
                yield name, start, numel, {k: v.view(-1)[:numel] for k, v in local.items()}
            elif getattr(p, "_hp_mapping", None) is not None:
                m = p._hp_mapping
                local = {"param": m.get_hp_fragment(), **{k: m.get_hp_fragment(k) for k in moments}}
                yield name, self.experts.start(p) + m.lp_fragment_address.start, m.lp_fragment_address.numel, local

    def blocks(self) -> dict[str, Block]:
        """strategy.ep: the parameters this rank holds columns of (LoRA's lora_B of its experts), by name."""
        return {name: block for name, p in named_params(self.engine.module) if (block := self.experts.block(p))}

    def state_dict(self, model_only: bool, with_step: bool) -> dict[str, Piece]:
        if not model_only:  # also before the first update (step 1 skipped): moments of zeros, step 0
            self.adam.create()
        blocks = self.blocks()
        pieces = {state_keys(name)[what]: Piece(start, t, blocks.get(name))
                  for name, start, numel, local in self._fragments(model_only) for what, t in local.items() if numel}
        if with_step and not model_only:
            pieces[STEP_KEY] = Piece(0, torch.tensor([self.adam.step_count()]))
        return pieces

    def state_layout(self) -> dict[str, tuple]:
        self.adam.create()
        blocks = self.blocks()
        layout = {state_keys(name)[what]: (start, numel, blocks.get(name)) for name, start, numel, local
                  in self._fragments() for what in local if numel}
        if self.stage < 3:  # the full (low-precision) parameters live on every rank: load them whole
            layout.update({state_keys(name)["param"]: (self.experts.start(p), p.numel(), blocks.get(name))
                           for name, p in named_params(self.engine.module)})
        return {**layout, STEP_KEY: (0, 1)}

    @torch.no_grad()
    def load_state_dict(self, values: dict[str, torch.Tensor]) -> None:
        from deepspeed.utils import safe_set_local_fp32_param, safe_set_local_optimizer_state

        for name, p in named_params(self.engine.module):
            keys = state_keys(name)
            if keys["param"] not in values:  # frozen pretrained weights, which a checkpoint does not save
                continue
            if self.stage == 3 and not p.requires_grad:
                if z3_range(p, self.rank, self.experts)[1]:
                    z3_local(p, self.rank, self.experts)[1].copy_(values[keys["param"]])
                continue
            if self.stage == 3:
                start, numel = z3_range(p, self.rank, self.experts)
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
