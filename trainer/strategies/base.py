"""The Strategy interface (DESIGN §2) and the pieces DDP and FSDP2 share."""
from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from trainer.config import Config, Precision
from trainer.distributed import DistEnv

OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]
DTYPES = {Precision.bf16: torch.bfloat16, Precision.fp16: torch.float16, Precision.fp32: torch.float32}


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the storages behind `tensors`, each storage counted once (views share one)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        if hasattr(t, "to_local"):  # DTensor: this rank holds its local shard only
            t = t.to_local()
        storage = t.untyped_storage()
        if t.device.type == "meta" or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for state in optimizer.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def peak_device_bytes(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


class Strategy(ABC):
    """Called on all ranks; the strategy decides who writes. The loop sees only this class."""

    def __init__(self, cfg: Config, env: DistEnv):
        self.cfg, self.env = cfg, env
        self.precision = Precision(cfg.train.precision)

    rank = property(lambda self: self.env.rank)
    world_size = property(lambda self: self.env.world_size)
    local_rank = property(lambda self: self.env.local_rank)
    device = property(lambda self: self.env.device)
    is_main = property(lambda self: self.env.is_main)

    def model_init_context(self) -> AbstractContextManager:
        return nullcontext()

    @abstractmethod
    def setup(self, model: nn.Module, optimizer_factory: OptimizerFactory) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Wrap/shard per block, then build the optimizer over the wrapped parameters."""

    def autocast(self) -> AbstractContextManager:
        """Around the forward; backends that cast parameters themselves need none."""
        return nullcontext()

    @abstractmethod
    def no_sync(self, enabled: bool) -> AbstractContextManager:
        """No gradient communication inside when `enabled` (non-final micro-steps)."""

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """`loss` is already divided by the accumulation steps; backends must not divide again."""

    @abstractmethod
    def step(self, max_grad_norm: float) -> float:
        """Clip (0: don't), step, zero grads; return the global gradient norm before clipping."""

    @abstractmethod
    def memory_bytes(self) -> dict[str, int | None]:
        """Bytes this rank holds: {"params", "grads", "optim", "peak"} (DESIGN §4)."""

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        dist.all_reduce(tensor, op=op)
        return tensor

    def barrier(self) -> None:
        dist.barrier()

    def teardown(self) -> None:
        """Free backend state; the process group belongs to the caller."""


class TorchStrategy(Strategy):
    """DDP and FSDP2: a torch optimizer over the wrapped module, torch's clipping and scaler."""

    model: nn.Module
    optimizer: torch.optim.Optimizer

    def __init__(self, cfg: Config, env: DistEnv):
        super().__init__(cfg, env)
        self.scaler = self.make_grad_scaler() if self.precision is Precision.fp16 else None

    def make_grad_scaler(self):
        return torch.amp.GradScaler(self.device.type)

    @abstractmethod
    def wrap(self, model: nn.Module) -> nn.Module:
        """The model wrapped/sharded for this backend."""

    def setup(self, model, optimizer_factory):
        self.model = self.wrap(model)
        self.optimizer = optimizer_factory(self.model)
        return self.model, self.optimizer

    def backward(self, loss):
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self, max_grad_norm):
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_grad_norm or float("inf"))
        if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor reduced over the mesh
            norm = norm.full_tensor()
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm.item()

    def memory_bytes(self):
        params = list(self.model.parameters())
        return {"params": tensor_bytes(params), "grads": tensor_bytes(p.grad for p in params),
                "optim": tensor_bytes(optimizer_state_tensors(self.optimizer)), "peak": peak_device_bytes(self.device)}


@contextmanager
def toggled(set_flag: Callable[[bool], None], value: bool) -> Iterator[None]:
    """Set a backend flag for the duration of a block, then restore its default (True)."""
    set_flag(value)
    try:
        yield
    finally:
        set_flag(True)
