"""train.precision as a backend applies it (Fabric's precision plugin): the compute dtype, and fp16's
loss scaler, whose state has the same keys on every backend so that a checkpoint's trainer state
resumes it under any strategy."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Protocol

import torch

from trainer.config import Precision, ReduceDtype

DTYPES = {Precision.bf16: torch.bfloat16, Precision.fp16: torch.float16, Precision.fp32: torch.float32}
REDUCE_DTYPES = {r: DTYPES[Precision(r.value)] for r in ReduceDtype}  # the same names as the precisions


class LossScale(Protocol):
    """A backend's dynamic loss scaler, read and set as {"scale", "good_steps"} (steps since it last
    backed off or grew). A backend may add keys of its own (DeepSpeed: "hysteresis"); the others
    ignore them."""

    def state(self) -> dict: ...

    def load(self, state: dict) -> None: ...


class MixedPrecision:
    """The run's precision: `dtype` for compute (and for parameters that never train), and the loss
    scaler where fp16 has one."""

    def __init__(self, setting: Precision):
        self.setting = setting
        self.dtype = DTYPES[setting]
        self.loss_scale: LossScale | None = None  # fp16's, set by the backend that makes its scaler

    @property
    def mixed(self) -> bool:
        """Compute in a 16-bit dtype: parameters that never train are held in it."""
        return self.setting is not Precision.fp32

    def scale_state(self) -> dict | None:
        """The loss scaler's state, kept in a checkpoint's trainer state; None without one."""
        return self.loss_scale.state() if self.loss_scale else None

    def load_scale_state(self, state: dict) -> None:
        """Take a `scale_state` (from any backend) into this backend's scaler."""
        if self.loss_scale:
            self.loss_scale.load(state)

    @contextmanager
    def kept(self, finite_gradients: bool) -> Iterator[None]:
        """Around a backend's skip: a loss scaler reacts to non-finite gradients only, so a skip with
        finite gradients (a non-finite loss) leaves it as it was, on every backend."""
        kept = self.scale_state() if finite_gradients else None
        yield
        if kept is not None:
            self.load_scale_state(kept)
