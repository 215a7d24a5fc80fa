"""Expert parallelism (`strategy.ep=N`): each rank of an expert group keeps whole experts, and the
tokens travel to them.

transformers 5 keeps a MoE layer's routed experts in one module (Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE,
DeepSeek-V3, gpt-oss, ...: the classes its `use_experts_implementation` decorates), its parameters
stacked by expert ([E, 2I, H], [E, H, I], biases [E, X]) and its forward `(hidden [n, H], top_k_index
[n, k], top_k_weights [n, k]) -> [n, H]`. Sharded here, rank e of an expert group of N keeps rows
[e E/N, (e+1) E/N) of each of them (`shard_experts`, on the meta model), and the module's forward
becomes a dispatch (`dispatch`): every (token, choice) pair goes, sorted by expert, to the rank that
holds its expert (an all-to-all with uneven splits: no capacity, no token dropped), that rank runs
the family's own forward on its experts, the outputs come back (a second all-to-all) and are
combined with the routing weights, in the order one rank adds them. Both all-to-alls are autograd's,
so a rank's expert gradients are those of the tokens of its whole expert group; the backend then
reduces them over the expert-data-parallel group (layout.py), not the world. Shared experts, the
router and everything else stay data-parallel.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.nn.functional import all_to_all_single

from trainer.errors import ConfigError

# torch 2.13 marks the autograd all-to-all deprecated (models/sequence.py: the same)
warnings.filterwarnings("ignore", message="torch.distributed.nn.functional.all_to_all_single is deprecated",
                        category=FutureWarning)

# the config keys that count a family's routed experts
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass(frozen=True)
class ExpertGroup:
    """This rank's expert group: `size` ranks, each holding 1 / size of every layer's experts; this
    one is `rank` among them."""
    group: dist.ProcessGroup | None
    size: int
    rank: int


ONE_EXPERT_GROUP = ExpertGroup(None, 1, 0)  # strategy.ep=1: every rank holds every expert


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The routed-experts modules of a transformers model: those its `use_experts_implementation`
    decorates, which all take the same forward."""
    return [m for m in model.modules() if hasattr(m, "_is_expert_parallel") and hasattr(m, "num_experts")]


def routed_experts(model: nn.Module) -> int | None:
    """How many routed experts a layer of `model` has, by its config; None: not a mixture of experts."""
    config = getattr(model, "config", None)
    counts = [getattr(config, key, None) for key in EXPERT_COUNT_KEYS]
    return next((int(n) for n in counts if isinstance(n, int) and n > 1), None)


def check_expert_parallel(ep: int, world_size: int, model: nn.Module, strategy: str) -> None:
    """strategy.ep=N, before any work: N divides the world, the model has experts this module can
    split and N divides their number, the backend takes it."""
    if ep == 1:
        return
    if ep < 1:
        raise ConfigError(f"strategy.ep: must be >= 1 (1: every rank holds every expert), got {ep}")
    if world_size % ep:
        raise ConfigError(f"strategy.ep: the world size {world_size} must be a multiple of strategy.ep={ep} "
                          "(an expert group is ep of the data-parallel ranks)")
    if strategy == "ddp":
        raise ConfigError("strategy.ep: ddp keeps every weight whole on every rank and all-reduces every gradient "
                          "over the world; expert parallelism needs strategy=fsdp, zero1, zero2 or zero3")
    experts = routed_experts(model)
    family = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    if experts is None:
        raise ConfigError(f"strategy.ep: {family} is not a mixture of experts (no {', '.join(EXPERT_COUNT_KEYS)} in "
                          "its config): there are no experts to split; use strategy.ep=1")
    found = expert_modules(model)
    if not found:
        raise ConfigError(f"strategy.ep: {family} keeps its experts in a layout expert parallelism does not split "
                          "(not one module of stacked experts, as transformers 5's Qwen3-MoE, Mixtral, OLMoE, "
                          "DeepSeek-V3 and gpt-oss do); use strategy.ep=1")
    if experts % ep:
        raise ConfigError(f"strategy.ep: {family} has {experts} experts a layer, which strategy.ep={ep} must divide "
                          "(each rank of an expert group holds experts / ep of them)")
    if any(getattr(m, "base_layer", None) in found for m in model.modules()):
        raise ConfigError("strategy.ep: peft=lora adapts the routed experts (peft's target_parameters), and their "
                          "adapters are not split with their experts yet; adapt the other layers only (e.g. "
                          "peft.target_modules=[q_proj,k_proj,v_proj,o_proj]) or use strategy.ep=1")
    for module in found:
        stacked = [name for name, p in module.named_parameters(recurse=False) if p.shape[0] != module.num_experts]
        if stacked:
            raise ConfigError(f"strategy.ep: {family}'s {type(module).__name__}.{stacked[0]} is not stacked by "
                              f"expert (its first dimension is not the {module.num_experts} experts); use strategy.ep=1")


def shard_experts(model: nn.Module, group: ExpertGroup) -> list[nn.Module]:
    """Each experts module of `model` (built on the meta device) keeps its rows of this rank's experts
    only, and dispatches tokens to the ranks that hold theirs. Returns the modules."""
    modules = expert_modules(model)
    for module in modules:
        local = module.num_experts // group.size
        for name, p in list(module.named_parameters(recurse=False)):
            assert p.is_meta, "experts are split on the meta model, before any rank allocates them"
            module.register_parameter(name, nn.Parameter(torch.empty((local, *p.shape[1:]), dtype=p.dtype,
                                                                     device="meta"), requires_grad=p.requires_grad))
        module.num_experts = local  # what the family's forward loops over
        module.forward = partial(dispatch, module, type(module).forward.__get__(module), group)
    return modules


class ExpertRows:
    """Which parameters hold this rank's experts only: their full shape has ep times the rows, and
    their local rows start at this rank's first expert. Everything else is whole, as built."""

    def __init__(self, group: ExpertGroup):
        self.group, self.ids = group, set()

    def add(self, modules: list[nn.Module]) -> None:
        """The parameters of `modules` as they are now (after the backend wrapped them)."""
        self.ids |= {id(p) for module in modules for p in module.parameters(recurse=False)}

    def __contains__(self, p: torch.Tensor) -> bool:
        return id(p) in self.ids

    def full_shape(self, p: torch.Tensor, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (shape[0] * self.group.size, *shape[1:]) if p in self else shape

    def start(self, p: torch.Tensor) -> int:
        """Where this rank's part of `p` begins in the full flattened tensor: its first expert's row
        (`p.numel()`: the elements of this rank's experts, as the backend sees the parameter)."""
        return self.group.rank * p.numel() if p in self else 0


def exchange(tensor: torch.Tensor, send: list[int], receive: list[int], group: ExpertGroup) -> torch.Tensor:
    """Rows of `tensor`, `send[r]` of them to rank r of the group, in order; `receive[r]` come from r.
    With autograd where `tensor` needs it (its backward is the exchange the other way)."""
    out = tensor.new_empty((sum(receive), *tensor.shape[1:]))
    if tensor.requires_grad:
        return all_to_all_single(out, tensor.contiguous(), receive, send, group=group.group)
    dist.all_to_all_single(out, tensor.contiguous(), receive, send, group=group.group)
    return out


def dispatch(module: nn.Module, local_forward, group: ExpertGroup, hidden: torch.Tensor, top_k_index: torch.Tensor,
             top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts module's forward at ep > 1: each (token, choice) to its expert's rank and back."""
    n, k = top_k_index.shape
    local = module.num_experts
    # the pairs sorted by expert (stable: by token within one), so each rank's share is one run of rows
    expert = top_k_index.reshape(-1)
    order = torch.argsort(expert, stable=True)
    send = torch.bincount(expert[order] // local, minlength=group.size)
    receive = torch.empty_like(send)
    dist.all_to_all_single(receive, send, group=group.group)
    send_sizes, receive_sizes = send.tolist(), receive.tolist()
    arrived = exchange(hidden[order // k], send_sizes, receive_sizes, group)
    arrived_expert = exchange(expert[order], send_sizes, receive_sizes, group) - group.rank * local
    # the family's own forward on this rank's experts, one choice per row at weight 1 (exact); the
    # routing weights are applied below, where one rank applies them too
    out = local_forward(arrived, arrived_expert[:, None], torch.ones(len(arrived), 1, dtype=top_k_weights.dtype,
                                                                          device=hidden.device))
    if not len(arrived):  # no token came: the output still depends on the experts and on what arrived, so
        # that the experts' gradients are zeros, not missing (their reduction waits for them), and the backward
        # of the exchange that brought nothing runs here as on the ranks it is paired with
        out = out + (arrived.sum() + sum(p.sum() for p in module.parameters(recurse=False))) * 0
    back = exchange(out, receive_sizes, send_sizes, group)
    pairs = back[torch.argsort(order)].view(n, k, -1) * top_k_weights[..., None].to(back.dtype)
    # one rank adds a token's choices in the order of their experts: the same order here
    by_expert = torch.argsort(top_k_index, dim=1)
    return pairs.gather(1, by_expert[..., None].expand_as(pairs)).sum(1).to(hidden.dtype)
