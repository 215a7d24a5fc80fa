"""What DDP and FSDP2 share: a torch optimizer over the wrapped module, torch's clipping and
gradient scaler, and portable state read from each parameter's local range."""
from __future__ import annotations

from abc import abstractmethod
from typing import Iterator

import torch
from torch import nn

from trainer.checkpoint.format import ADAM_KEYS, STEP_KEY, Piece, replica_slice, state_keys
from trainer.config import Config, Precision
from trainer.distributed import DistEnv
from trainer.models.weights import Block, WeightSource, canonical_name
from trainer.strategies.adam_state import AdamState
from trainer.strategies.base import (
    Strategy,
    hold_in,
    optimizer_state_tensors,
    peak_device_bytes,
    tensor_bytes,
    trainable,
)


class TorchStrategy(Strategy):
    """DDP and FSDP2: a torch optimizer over the wrapped module, torch's clipping and scaler."""

    model: nn.Module
    optimizer: torch.optim.Optimizer

    def __init__(self, cfg: Config, env: DistEnv):
        super().__init__(cfg, env)
        self.scaler = self.make_grad_scaler() if self.precision.setting is Precision.fp16 else None
        self.precision.loss_scale = TorchLossScale(self.scaler) if self.scaler else None

    def make_grad_scaler(self):
        return torch.amp.GradScaler(self.env.device.type)

    @abstractmethod
    def wrap(self, model: nn.Module, weights: WeightSource) -> nn.Module:
        """The model wrapped/sharded for this backend, with this rank's values from `weights`."""

    def setup(self, model, optimizer_factory, weights):
        if self.precision.mixed:
            hold_in(model, self.precision.dtype, frozen_only=True)
        self.model = self.wrap(model, weights)
        self.optimizer = optimizer_factory(trainable(self.model, self.full_shape))
        # a frozen parameter gets no state
        self.adam = AdamState(self.optimizer, [p for p in self.model.parameters() if p.requires_grad])
        return self.model, self.optimizer

    def backward(self, loss, measure_memory=False):  # gradients peak after backward: measured by the loop
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def grad_norm(self):
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        self._norm = self.total_norm([p for p in self.model.parameters() if p.grad is not None])
        return self._norm

    def total_norm(self, params: list[nn.Parameter]) -> torch.Tensor:
        """The norm of the gradients of `params`, all ranks'."""
        return torch.nn.utils.get_total_norm([p.grad for p in params])

    def apply(self, max_grad_norm):
        if max_grad_norm:
            self.clip(max_grad_norm)
        if self.scaler:
            self.scaler.step(self.optimizer)  # found no inf: grad_norm was finite
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def clip(self, max_grad_norm: float) -> None:
        torch.nn.utils.clip_grads_with_norm_(self.model.parameters(), max_grad_norm, self._norm)

    def skip(self, finite_gradients):
        with self.precision.kept(finite_gradients):
            if self.scaler:  # what it found in unscale_: an overflow backs off, as the scaler's own skip does
                self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)

    @abstractmethod
    def local_range(self, tensor: torch.Tensor) -> tuple[int, torch.Tensor, int, int, Block | None]:
        """(start, this rank's flat range, replicas holding the same range, our replica index, the `Block`
        of columns it is a range of: None, a run of the flat tensor)."""

    def _tensors(self, model_only: bool = False) -> Iterator[tuple[str, torch.Tensor, nn.Parameter]]:
        """Every parameter, and the Adam moments of the trainable ones: zeros for a parameter that
        has had no gradient yet (Adam's own start), none for a frozen one; each with its parameter."""
        for name, p in self.module.named_parameters():
            keys = state_keys(canonical_name(name))
            yield keys["param"], p, p
            if not model_only and p.requires_grad:
                state = self.optimizer.state.get(p, {})
                yield from ((keys[k], state[k] if k in state else torch.zeros_like(p), p) for k in ADAM_KEYS)

    def flat_range(self, tensor: torch.Tensor, param: nn.Parameter) -> tuple[int, torch.Tensor, int, int, Block | None]:
        """`local_range` of `tensor` (a parameter, or one of its moments) in the full tensor of `param`:
        strategy.ep's experts begin at this rank's first expert (lora_B's: in its `block`)."""
        start, flat, replicas, index, block = self.local_range(tensor)
        return start + self._experts.start(param), flat, replicas, index, block or self._experts.block(param)

    def state_dict(self, model_only=False):
        if not model_only:  # also before the first update (step 1 skipped): moments of zeros, step 0
            self.adam.create()
        pieces = {key: replica_slice(*self.flat_range(t, p)) for key, t, p in self._tensors(model_only)}
        if self.env.is_main and not model_only:
            pieces[STEP_KEY] = Piece(0, torch.tensor([self.adam.step_count()]))
        return pieces

    def state_layout(self):
        self.adam.create()
        layout = {key: (start, flat.numel(), block) for key, t, p in self._tensors()
                  for start, flat, _, _, block in [self.flat_range(t, p)]}
        return {**layout, STEP_KEY: (0, 1)}

    @torch.no_grad()
    def load_state_dict(self, values):
        for key, t, _ in self._tensors():
            if key in values:  # not: frozen pretrained weights, which a checkpoint does not save
                self.local_range(t)[1].copy_(values[key])
        self.adam.set_step_count(values[STEP_KEY].item())

    def memory_bytes(self):
        params = list(self.model.parameters())
        return {"params": tensor_bytes(params) + self._held_bytes(), "grads": tensor_bytes(p.grad for p in params),
                "optim": tensor_bytes(optimizer_state_tensors(self.optimizer)), "peak": peak_device_bytes(self.env.device)}


class TorchLossScale:
    """torch's GradScaler and FSDP's ShardedGradScaler alike."""

    def __init__(self, scaler: torch.amp.GradScaler):
        self.scaler = scaler

    def state(self):
        state = self.scaler.state_dict()
        return {"scale": float(state["scale"]), "good_steps": int(state["_growth_tracker"])}

    def load(self, state):
        self.scaler.load_state_dict({**self.scaler.state_dict(), "scale": state["scale"],
                                     "_growth_tracker": state["good_steps"]})
