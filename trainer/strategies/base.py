"""The Strategy interface (DESIGN §2) and the pieces DDP and FSDP2 share."""
from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Callable, Iterable, Iterator, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from trainer.config import Config, GradReduce, Precision, ReduceDtype
from trainer.distributed import DistEnv
from trainer.models.weights import WeightSource, canonical_name, params_on_meta, persistent_buffers

OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]
DTYPES = {Precision.bf16: torch.bfloat16, Precision.fp16: torch.float16, Precision.fp32: torch.float32}
REDUCE_DTYPES = {r: DTYPES[Precision(r.value)] for r in ReduceDtype}  # the same names as the precisions


ADAM_KEYS = ("exp_avg", "exp_avg_sq")


class Piece(NamedTuple):
    """A contiguous range [start, start + numel) of a flattened tensor, as a 1-D tensor."""
    start: int
    tensor: torch.Tensor


def state_keys(name: str) -> dict[str, str]:
    """Portable keys (DESIGN §5) of one parameter: its fp32 value and its Adam moments."""
    return {"param": f"model.{name}", **{k: f"optim.{name}.{k}" for k in ADAM_KEYS}}


STEP_KEY = "optim.step"  # Adam's step count, one value


def buffer_key(name: str) -> str:
    """Portable key of a persistent buffer (saved whole, by rank 0)."""
    return f"buffer.{name}"


def replica_slice(start: int, flat: torch.Tensor, replicas: int, index: int) -> Piece:
    """Of a range held identically by `replicas` ranks, the part replica `index` saves."""
    chunk = -(-flat.numel() // replicas)
    return Piece(start + index * chunk, flat[index * chunk:(index + 1) * chunk])


@contextmanager
def zero_lr(optimizer) -> Iterator[None]:
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    try:
        yield
    finally:
        for g, lr in zip(optimizer.param_groups, lrs):
            g["lr"] = lr


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
        self.reduce_every_micro_step = GradReduce(cfg.strategy.grad_reduce) is GradReduce.micro_step
        # Set by the loop on steps whose memory it reports: a backend whose gradients peak inside
        # `backward` (DeepSpeed) measures them there.
        self.track_memory = False

    rank = property(lambda self: self.env.rank)
    world_size = property(lambda self: self.env.world_size)
    local_rank = property(lambda self: self.env.local_rank)
    device = property(lambda self: self.env.device)
    is_main = property(lambda self: self.env.is_main)

    def model_init_context(self) -> AbstractContextManager:
        """Where the model is built: parameters on the meta device, materialised by `setup`."""
        return params_on_meta()

    @abstractmethod
    def setup(self, model: nn.Module, optimizer_factory: OptimizerFactory,
              weights: WeightSource) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Wrap/shard per block, give this rank's part of every parameter its values from
        `weights`, then build the optimizer over the wrapped parameters."""

    def autocast(self) -> AbstractContextManager:
        """Around the forward; backends that cast parameters themselves need none."""
        return nullcontext()

    @abstractmethod
    def no_sync(self, non_final: bool) -> AbstractContextManager:
        """Around a micro-step's forward and backward; `non_final`: more micro-steps follow in this
        optimizer step. With strategy.grad_reduce=step there is no gradient communication inside
        a non-final one (the final micro-step reduces once, full gradients held until then); with
        micro_step every backward reduces and gradients stay sharded."""

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """`loss` is already divided by the accumulation steps; backends must not divide again."""

    @abstractmethod
    def step(self, max_grad_norm: float,
             allowed: Callable[[torch.Tensor], bool] | None = None) -> torch.Tensor | float:
        """Clip (0: don't), step unless `allowed(global gradient norm)` says no (the same answer on
        every rank: no for a non-finite step), zero grads; return the norm before clipping."""

    @abstractmethod
    def memory_bytes(self) -> dict[str, int | None]:
        """Bytes this rank holds: {"params", "grads", "optim", "peak"} (DESIGN §4)."""

    @property
    @abstractmethod
    def module(self) -> nn.Module:
        """The model inside the backend's wrapper (DDP's, DeepSpeed's engine), after `setup`."""

    def buffers(self) -> dict[str, torch.Tensor]:
        """The persistent buffers (canonical name -> tensor), whole on every rank: a checkpoint
        keeps rank 0's (DDP broadcasts its own at every forward; the others keep each rank's)."""
        return persistent_buffers(self.module)

    # Portable state (DESIGN §5): keys from `state_keys` and STEP_KEY, values as flat ranges,
    # so a checkpoint is independent of how a backend splits tensors.

    @abstractmethod
    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Canonical parameter name -> full shape."""

    @abstractmethod
    def state_dict(self, model_only: bool = False) -> dict[str, Piece]:
        """The ranges this rank saves; together the ranks' pieces cover every key once.
        `model_only`: the parameters alone (export; also before the optimizer's first step)."""

    @abstractmethod
    def state_layout(self) -> dict[str, tuple[int, int]]:
        """key -> (start, numel): the ranges this rank needs to resume."""

    @abstractmethod
    def load_state_dict(self, values: dict[str, torch.Tensor]) -> None:
        """Take the fp32 ranges of `state_layout` (parameters, moments, step)."""

    def loss_scale_state(self) -> dict | None:
        """fp16's loss scaler as {"scale", "good_steps"} (steps since it last backed off or grew),
        the same for every backend, kept in the trainer state of a checkpoint; None without one.
        A backend may add keys of its own (DeepSpeed: "hysteresis"); the others ignore them."""
        return None

    def load_loss_scale_state(self, state: dict) -> None:
        """Take a `loss_scale_state` (from any backend) into this backend's scaler."""

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
    def wrap(self, model: nn.Module, weights: WeightSource) -> nn.Module:
        """The model wrapped/sharded for this backend, with this rank's values from `weights`."""

    def setup(self, model, optimizer_factory, weights):
        if self.precision is not Precision.fp32:
            hold_frozen_in(model, DTYPES[self.precision])
        self.model = self.wrap(model, weights)
        self.optimizer = optimizer_factory(self.model)
        return self.model, self.optimizer

    def backward(self, loss):
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self, max_grad_norm, allowed=None):
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_grad_norm or float("inf"))
        if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor reduced over the mesh
            norm = norm.full_tensor()
        if allowed is None or allowed(norm):
            (self.scaler.step if self.scaler else lambda opt: opt.step())(self.optimizer)
        if self.scaler:  # a skipped fp16 step lowers the loss scale, as the scaler's own skip does
            self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def loss_scale_state(self):
        if not self.scaler:
            return None
        state = self.scaler.state_dict()
        return {"scale": float(state["scale"]), "good_steps": int(state["_growth_tracker"])}

    def load_loss_scale_state(self, state):
        if self.scaler:  # GradScaler and FSDP's ShardedGradScaler alike
            self.scaler.load_state_dict({**self.scaler.state_dict(), "scale": state["scale"],
                                         "_growth_tracker": state["good_steps"]})

    @abstractmethod
    def local_range(self, tensor: torch.Tensor) -> tuple[int, torch.Tensor, int, int]:
        """(start, this rank's flat range, replicas holding the same range, our replica index)."""

    def param_shapes(self):
        return {canonical_name(n): tuple(p.shape) for n, p in self.module.named_parameters()}

    def _tensors(self, model_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter, and the Adam moments of the trainable ones: zeros for a parameter that
        has had no gradient yet (Adam's own start), none for a frozen one."""
        for name, p in self.module.named_parameters():
            keys = state_keys(canonical_name(name))
            yield keys["param"], p
            if not model_only and p.requires_grad:
                state = self.optimizer.state.get(p, {})
                yield from ((keys[k], state[k] if k in state else torch.zeros_like(p)) for k in ADAM_KEYS)

    def _adam_step(self) -> float:
        return float(next(iter(self.optimizer.state.values()))["step"])

    def state_dict(self, model_only=False):
        pieces = {key: replica_slice(*self.local_range(t)) for key, t in self._tensors(model_only)}
        if self.is_main and not model_only:
            pieces[STEP_KEY] = Piece(0, torch.tensor([self._adam_step()]))
        return pieces

    def state_layout(self):
        self._create_optimizer_state()
        layout = {key: (start, flat.numel()) for key, t in self._tensors()
                  for start, flat, _, _ in [self.local_range(t)]}
        return {**layout, STEP_KEY: (0, 1)}

    @torch.no_grad()
    def load_state_dict(self, values):
        for key, t in self._tensors():
            if key in values:  # not: frozen pretrained weights, which a checkpoint does not save
                self.local_range(t)[1].copy_(values[key])
        for state in self.optimizer.state.values():
            state["step"].fill_(values[STEP_KEY].item())

    @torch.no_grad()
    def _create_optimizer_state(self) -> None:
        """Adam creates its moments at the first step: take one with zero gradients and lr 0
        (which leaves the parameters as they are), so a checkpoint has somewhere to go."""
        if self.optimizer.state:
            return
        for p in self.model.parameters():
            if p.requires_grad:  # a frozen parameter gets no state
                p.grad = torch.zeros_like(p)
        with zero_lr(self.optimizer):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def memory_bytes(self):
        params = list(self.model.parameters())
        return {"params": tensor_bytes(params), "grads": tensor_bytes(p.grad for p in params),
                "optim": tensor_bytes(optimizer_state_tensors(self.optimizer)), "peak": peak_device_bytes(self.device)}


def hold_frozen_in(model: nn.Module, dtype: torch.dtype) -> None:
    """Frozen parameters (LoRA's base), still on the meta device, in the training dtype: weights
    that never change need no fp32 master copy (DeepSpeed keeps none of them either)."""
    held: dict[int, nn.Parameter] = {}  # a tied parameter stays one
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and p.is_meta and not p.requires_grad and p.is_floating_point():
                if id(p) not in held:
                    held[id(p)] = nn.Parameter(torch.empty_like(p, dtype=dtype), requires_grad=False)
                module._parameters[name] = held[id(p)]


@contextmanager
def toggled(set_flag: Callable[[bool], None], value: bool) -> Iterator[None]:
    """Set a backend flag for the duration of a block, then restore its default (True)."""
    set_flag(value)
    try:
        yield
    finally:
        set_flag(True)
