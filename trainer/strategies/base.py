"""The Strategy interface (docs/design.md, The Strategy, docs/architecture.md), and the small pieces backends share,
as plain functions they call explicitly."""
from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import loss_parallel

from trainer.checkpoint.format import Piece
from trainer.config import Config, GradReduce, Precision
from trainer.distributed import DistEnv
from trainer.layout import Degrees, Layout
from trainer.models.experts import ExpertRows
from trainer.models.weights import WeightSource, allocate_params, fill, params_on_meta, persistent_buffers, tensor_shape
from trainer.strategies.precision import MixedPrecision

# Builds the optimizer over the trainable parameters, each with its full shape.
OptimizerFactory = Callable[[list[tuple[nn.Parameter, tuple[int, ...]]]], torch.optim.Optimizer]


def hold_in(model: nn.Module, dtype: torch.dtype, frozen_only: bool) -> None:
    """Floating-point parameters still on the meta device, in `dtype` before they get storage: the
    frozen ones (LoRA's base; weights that never change need no fp32 copy, and DeepSpeed keeps none
    of them either), or all of them (ZeRO-1/2, whose fp32 masters are DeepSpeed's own partitions)."""
    held: dict[int, nn.Parameter] = {}  # a tied parameter stays one
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and p.is_meta and p.is_floating_point() and not (frozen_only and p.requires_grad):
                if id(p) not in held:
                    held[id(p)] = nn.Parameter(torch.empty_like(p, dtype=dtype), requires_grad=p.requires_grad)
                module._parameters[name] = held[id(p)]


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
    """How one backend (DDP, FSDP2, DeepSpeed ZeRO-1/2/3) holds, steps and saves a model. Called on
    every rank; the loop sees only this class and never asks which backend it runs on.

    A backend must:
    - build: `model_init_context` (parameters on the meta device, or partitioned as built), then
      `setup` wraps or shards per block, fills this rank's part from the weights and builds the
      optimizer; `full_shape` answers a parameter's whole shape wherever this rank holds a part.
      `setup_frozen` holds a model that never trains (DPO's reference) as the policy is held.
    - step: `autocast` and `micro_step(final)` around each forward and backward; `backward` takes
      a loss the loop has already normalised (never divide again); then, once per step, `grad_norm`
      (global, unscaled, the same on every rank), and `apply` (clip, update, zero) or `skip`.
      fp16's loss scaler lives in `precision`, its state the same on every backend.
    - save: `state_dict`/`state_layout`/`load_state_dict` speak flat ranges of full fp32 tensors
      (and blocks of columns), so a checkpoint does not depend on how the backend splits tensors;
      the ranks' pieces together cover every key once.
    - say: `memory_bytes` measured, never computed; `start_settings` for the start line.
    - end: `teardown` frees the backend's state, not the process group.
    `env` is this rank's place in the world, `layout` its groups on the parallel axes (sp, ep)."""

    def __init__(self, cfg: Config, env: DistEnv):
        self.cfg, self.env = cfg, env
        self.precision = MixedPrecision(Precision(cfg.train.precision))
        # strategy.sp, strategy.ep and strategy.tp: this rank's groups, created here on every rank
        self.layout = Layout(Degrees(env.world_size, cfg.strategy.sp, cfg.strategy.ep, cfg.strategy.tp), env.rank)
        self._experts = ExpertRows(self.layout.experts)  # the parameters holding this rank's experts only (ep > 1)
        self._reduce_every_micro_step = GradReduce(cfg.strategy.grad_reduce) is GradReduce.micro_step
        self._held: list[nn.Module] = []  # models held outside the policy (`setup_frozen`, `holds`)

    def model_init_context(self) -> AbstractContextManager:
        """Where the model is built: parameters on the meta device, materialised by `setup`."""
        return params_on_meta()

    def full_shape(self, p: torch.Tensor) -> tuple[int, ...]:
        """A parameter's full shape, also where this rank holds a part of it (ZeRO-3 partitions
        parameters as they are built; strategy.ep: each rank holds its experts' rows): what the first
        weights and the checkpoint fingerprint use."""
        return self._experts.full_shape(p, tensor_shape(p))

    @abstractmethod
    def setup(self, model: nn.Module, optimizer_factory: OptimizerFactory,
              weights: WeightSource) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Wrap/shard per block, give this rank's part of every parameter its values from
        `weights`, then build the optimizer over the parameters that train (`trainable`)."""

    def setup_frozen(self, model: nn.Module, weights: WeightSource) -> nn.Module:
        """A model that never trains (objective=dpo's reference under full fine-tuning), built in
        `model_init_context` like the policy: frozen, filled from `weights`, in eval mode, in no
        optimizer, counted in `memory_bytes`. Here replicated on every rank (ddp, zero1/2), its
        parameters in `_frozen_dtype`."""
        model.requires_grad_(False)
        hold_in(model, self._frozen_dtype(), frozen_only=True)
        allocate_params(model, self.env.device)
        fill(model, weights)
        return self.holds(model.to(self.env.device).eval())  # .to: the buffers

    def _frozen_dtype(self) -> torch.dtype:
        """The dtype of a frozen copy's parameters: the one the policy's training parameters are
        held in where the forward reads them (DeepSpeed's bf16/fp16 module), so that the copy
        computes as the policy does at its start."""
        return self.precision.dtype

    def holds(self, model: nn.Module) -> nn.Module:
        """`model`, held on this rank outside the policy (a frozen copy; objective=dpo's starting
        adapter), counts in `memory_bytes`' params from now on."""
        self._held.append(model)
        return model

    def _held_bytes(self) -> int:
        """Bytes of the parameters of the models `holds` counts, as this rank holds them."""
        return tensor_bytes(p for model in self._held for p in model.parameters())

    @property
    @abstractmethod
    def module(self) -> nn.Module:
        """The model inside the backend's wrapper (DDP's, DeepSpeed's engine), after `setup`."""

    def start_settings(self) -> dict[str, str]:
        """This backend's own settings, as the start line says them; "offload": what it keeps in
        host memory."""
        return {"offload": "+".join(self._offloaded()) or "none"}

    def _offloaded(self) -> list[str]:
        s = self.cfg.strategy
        return [what for what, on in (("optimizer", s.offload_optimizer), ("params", s.offload_params)) if on]

    def autocast(self) -> AbstractContextManager:
        """Around the forward and its loss, and the backward; backends that cast parameters themselves
        need no autocast. strategy.tp: the output layer's logits stay split over the vocabulary (a DTensor
        of the tensor group); torch's loss_parallel computes their cross-entropy where they are."""
        return loss_parallel() if self.layout.degrees.tp > 1 else nullcontext()

    @abstractmethod
    def micro_step(self, final: bool) -> AbstractContextManager:
        """Around a micro-step's forward and backward; `final`: the last of this optimizer step.
        With strategy.grad_reduce=step there is no gradient communication before the final one
        (which reduces once, full gradients held until then); with micro_step every backward
        reduces and gradients stay sharded."""

    @abstractmethod
    def backward(self, loss: torch.Tensor, measure_memory: bool = False) -> None:
        """`loss` is already normalised by the loop: this micro-batch's token-loss sum x world size /
        the target tokens of the whole step (all micro-batches, all ranks), so that the backends'
        average over ranks gives the loss of docs/design.md, The loss. Backends must not divide again. `measure_memory`:
        this step's memory is reported; a backend whose gradients peak inside `backward` (ZeRO-1)
        measures them there, for `memory_bytes`."""

    # The optimizer step, in explicit parts: the loop takes the norm, decides with every rank
    # whether to update (training.faults.StepGuard), then applies or skips.

    @abstractmethod
    def grad_norm(self) -> torch.Tensor:
        """The global norm of this step's gradients before clipping (fp16: unscaled), the same on
        every rank; non-finite where any gradient is. Called once per step, after the last backward."""

    @abstractmethod
    def apply(self, max_grad_norm: float) -> None:
        """Clip to `max_grad_norm` (0: don't), update, zero the gradients."""

    @abstractmethod
    def skip(self, finite_gradients: bool) -> None:
        """No update from this step: the gradients zeroed. An fp16 loss scaler backs off on
        non-finite gradients only, on every backend (`MixedPrecision.kept`)."""

    @abstractmethod
    def memory_bytes(self) -> dict[str, int | None]:
        """Bytes this rank holds: {"params", "grads", "optim", "peak"} (docs/design.md, Step records)."""

    # Portable state (docs/design.md, Checkpoints): keys from checkpoint.format's `state_keys` and STEP_KEY, values as
    # flat ranges, so a checkpoint is independent of how a backend splits tensors.

    @abstractmethod
    def state_dict(self, model_only: bool = False) -> dict[str, Piece]:
        """The ranges this rank saves; together the ranks' pieces cover every key once.
        `model_only`: the parameters alone (export; also before the optimizer's first step)."""

    @abstractmethod
    def state_layout(self) -> dict[str, tuple]:
        """key -> (start, numel[, block]): the ranges this rank needs to resume (a `Block`: of its
        columns, in their order; None or absent: of the flat tensor)."""

    @abstractmethod
    def load_state_dict(self, values: dict[str, torch.Tensor]) -> None:
        """Take the fp32 ranges of `state_layout` (parameters, moments, step)."""

    def teardown(self) -> None:
        """Free backend state; the process group belongs to the caller."""


# -- shared pieces: plain functions the backends (and tests) call explicitly -------------------------

def trainable(model: nn.Module, full_shape: Callable[[torch.Tensor], tuple[int, ...]]
              ) -> list[tuple[nn.Parameter, tuple[int, ...]]]:
    """What the optimizer factory takes: the parameters that train, with their full shapes."""
    return [(p, full_shape(p)) for p in model.parameters() if p.requires_grad]


def optimizer_step(strategy: Strategy, max_grad_norm: float) -> torch.Tensor:
    """A step that skips nothing (tests, benchmarks): the norm, then the update."""
    norm = strategy.grad_norm()
    strategy.apply(max_grad_norm)
    return norm


def follow_rank0_buffers(model: nn.Module, device: torch.device, world_size: int) -> None:
    """DDP's `broadcast_buffers` for a backend without it: every rank takes rank 0's persistent
    buffers (running statistics) before a forward that follows a training forward. Else each
    rank keeps statistics of its own batches, its losses differ from DDP's, and a checkpoint
    (rank 0's) resumes into another run. Within an accumulated step DDP takes them before the
    first micro-batch only; for statistics that a training forward does not read (BatchNorm's)
    that is the same. Only for a model with persistent buffers."""
    if world_size == 1 or not persistent_buffers(model):
        return
    stale = True  # DDP's first forward takes rank 0's too

    @torch.no_grad()
    def before_forward(module, args):
        if stale:
            buffers = list(persistent_buffers(module).values())
            for dtype in dict.fromkeys(b.dtype for b in buffers):  # one broadcast per dtype, in one order
                same = [b for b in buffers if b.dtype == dtype]
                # on the rank's device: NCCL sends no CPU tensor (buffers offloaded with the parameters)
                flat = torch.cat([b.reshape(-1) for b in same]).to(device)
                dist.broadcast(flat, src=0)
                for b, value in zip(same, flat.split([b.numel() for b in same])):
                    b.copy_(value.view_as(b))

    def after_forward(module, args, output):
        nonlocal stale
        stale = torch.is_grad_enabled()  # a training forward may have updated them

    model.register_forward_pre_hook(before_forward)
    model.register_forward_hook(after_forward)


@contextmanager
def toggled(set_flag: Callable[[bool], None], value: bool) -> Iterator[None]:
    """Set a backend flag for the duration of a block, then restore its default (True)."""
    set_flag(value)
    try:
        yield
    finally:
        set_flag(True)
