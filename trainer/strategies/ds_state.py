"""DeepSpeed's state in portable form (DESIGN §5). DeepSpeed keeps fp32 masters and Adam moments
in flat partitions; its fragment APIs tell which range of each parameter this rank owns. ZeRO-1/2:
the `_hp_mapping` fragment (any range, or none); ZeRO-3: partition `rank` of the flat parameter."""
from __future__ import annotations

import torch

from trainer.checkpoint.format import ADAM_KEYS, STEP_KEY, Piece, replica_slice, state_keys
from trainer.models.weights import canonical_name
from trainer.strategies.base import Strategy


class ZeroState(Strategy):
    """The portable-state half of DeepSpeedStrategy, which holds `engine`, `stage` and `_masters`."""

    def _params(self):
        return [(canonical_name(n), p) for n, p in self.module.named_parameters()]

    def _z3_range(self, p) -> tuple[int, int]:
        size = p.ds_tensor.numel()  # partition size, padded on the last ranks
        start = self.rank * size
        return start, max(0, min(size, p.ds_numel - start))

    def _z3_local(self, p) -> tuple[int, torch.Tensor]:
        start, numel = self._z3_range(p)
        return start, p.ds_tensor.data.view(-1)[:numel]

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
        for name, p in self._params():
            if not p.requires_grad:  # frozen: no master, no moments; the parameter itself
                if self.stage == 3:
                    start, local = self._z3_local(p)
                else:
                    start, local = replica_slice(0, p.detach().view(-1), self.world_size, self.rank)
                yield name, start, local.numel(), {"param": local}
            elif self.stage == 3:
                start, numel = self._z3_range(p)
                local = {"param": safe_get_local_fp32_param(p)}
                local.update({k: safe_get_local_optimizer_state(p, k) for k in moments})
                yield name, start, numel, {k: v.view(-1)[:numel] for k, v in local.items()}
            elif getattr(p, "_hp_mapping", None) is not None:
                m = p._hp_mapping
                local = {"param": m.get_hp_fragment(), **{k: m.get_hp_fragment(k) for k in moments}}
                yield name, m.lp_fragment_address.start, m.lp_fragment_address.numel, local

    def state_dict(self, model_only=False):
        if not model_only:  # also before the first update (step 1 skipped): moments of zeros, step 0
            self._create_optimizer_state()
        pieces = {state_keys(name)[what]: Piece(start, t) for name, start, numel, local in self._fragments(model_only)
                  for what, t in local.items() if numel}
        if self.is_main and not model_only:
            pieces[STEP_KEY] = Piece(0, torch.tensor([self._adam_step()]))
        return pieces

    def state_layout(self):
        self._create_optimizer_state()
        layout = {state_keys(name)[what]: (start, numel) for name, start, numel, local in self._fragments()
                  for what in local if numel}
        if self.stage < 3:  # the full (low-precision) parameters live on every rank: load them whole
            layout.update({state_keys(name)["param"]: (0, p.numel()) for name, p in self._params()})
        return {**layout, STEP_KEY: (0, 1)}

    @torch.no_grad()
    def load_state_dict(self, values):
        from deepspeed.utils import safe_set_local_fp32_param, safe_set_local_optimizer_state

        for name, p in self._params():
            keys = state_keys(name)
            if keys["param"] not in values:  # frozen pretrained weights, which a checkpoint does not save
                continue
            if self.stage == 3 and not p.requires_grad:
                if self._z3_range(p)[1]:
                    self._z3_local(p)[1].copy_(values[keys["param"]])
                continue
            if self.stage == 3:
                start, numel = self._z3_range(p)
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
        self._set_adam_step(values[STEP_KEY].item())

    def adam(self):
        return self.engine.optimizer.optimizer  # inside DeepSpeed's ZeRO optimizer

    def _stepped_tensors(self):
        return self._masters()

    def _adam_update(self):  # the way DeepSpeed steps its partitions
        if self.stage == 3:
            for i in range(len(self._masters())):
                self.engine.optimizer._optimizer_step(i)
        else:
            self.adam().step()
