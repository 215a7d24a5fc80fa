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

LoRA on the experts (peft's `target_parameters`: a ParamWrapper around the module per adapted
parameter) splits with them: an expert's adapter lives with its expert. peft keeps one adapter for
all E experts, lora_A [r E, in] (expert e: rows [e r, (e + 1) r)) and lora_B [out, r E] (expert e:
columns e, E + e, ..., the expert its fastest index), and reads them with the wrapper's `num_experts`;
a rank keeps its experts' rows of lora_A and their columns of lora_B, and the wrapper counts its own
experts. The lora_B part is no run of the whole tensor's values: the checkpoint pieces record it as
a `Block` of columns (models/weights.py), so that the whole tensor on disk stays peft's, the same at
every ep (a layout with each expert's block as rows would not be: export, merge and every ep=1 run
would permute it, and FSDP's row shards of lora_B at ep=1 would be E runs each).
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
from trainer.models.weights import Block

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
    for module in found:
        stacked = [name for name, p in module.named_parameters(recurse=False) if p.shape[0] != module.num_experts]
        if stacked:
            raise ConfigError(f"strategy.ep: {family}'s {type(module).__name__}.{stacked[0]} is not stacked by "
                              f"expert (its first dimension is not the {module.num_experts} experts); use strategy.ep=1")
    if strategy == "zero3" and any(adapters_of(model, module) for module in found):
        raise ConfigError("strategy.ep: zero3 does not yet split LoRA adapters on the routed experts with their "
                          "experts; use strategy=fsdp, zero1 or zero2 with strategy.ep, or peft.target_modules "
                          "without the experts")


def adapters_of(model: nn.Module, module: nn.Module) -> list[nn.Module]:
    """peft's LoRA wrappers around an experts module (a ParamWrapper per adapted parameter, each
    around the one before), innermost first."""
    wrappers, inner = [], module
    while outer := next((m for m in model.modules() if getattr(m, "base_layer", None) is inner), None):
        wrappers.append(outer)
        inner = outer
    return wrappers


def on_meta(shape: tuple[int, ...], like: nn.Parameter) -> nn.Parameter:
    assert like.is_meta, "experts are split on the meta model, before any rank allocates them"
    return nn.Parameter(torch.empty(shape, dtype=like.dtype, device="meta"), requires_grad=like.requires_grad)


def shard_experts(model: nn.Module, group: ExpertGroup) -> list[nn.Module]:
    """Each experts module of `model` (built on the meta device) keeps its rows of this rank's experts
    only, and dispatches tokens to the ranks that hold theirs; its LoRA adapters keep this rank's
    experts' blocks. Returns, per module, what holds its experts: its outermost LoRA wrapper, or itself."""
    expert_holders = []
    for module in expert_modules(model):
        local = module.num_experts // group.size
        for name, p in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, on_meta((local, *p.shape[1:]), p))
        wrappers = adapters_of(model, module)
        for wrapper in wrappers:
            for adapter in wrapper.lora_A:  # torch Linears: A [r E, in], B [out, r E]
                a, b = wrapper.lora_A[adapter], wrapper.lora_B[adapter]
                a.weight = on_meta((a.weight.shape[0] // group.size, a.weight.shape[1]), a.weight)
                b.weight = on_meta((b.weight.shape[0], b.weight.shape[1] // group.size), b.weight)
                a.out_features, b.in_features = a.weight.shape[0], b.weight.shape[1]
            wrapper.num_experts = local  # how peft reads its adapters' expert blocks
        module.num_experts = local  # what the family's forward loops over
        module.forward = partial(dispatch, module, type(module).forward.__get__(module), group)
        expert_holders.append(wrappers[-1] if wrappers else module)
    return expert_holders


class ExpertRows:
    """Which parameters hold this rank's experts only: their full shape has ep times the rows, and
    their local rows start at this rank's first expert; LoRA's lora_B of the experts has ep times the
    columns instead, and this rank's are a `Block`. Everything else is whole, as built."""

    def __init__(self, group: ExpertGroup):
        self.group, self.ids = group, set()
        self.columns: dict[int, int] = {}  # id(lora_B) -> the experts this rank holds of its module

    def add(self, units: list[nn.Module]) -> None:
        """The parameters of `units` (`shard_experts`') as they are now (after the backend wrapped them)."""
        for unit in units:
            for name, p in unit.named_parameters():
                self.ids.add(id(p))
                if "lora_B" in name.split("."):
                    self.columns[id(p)] = unit.num_experts  # its wrapper's, as shard_experts set it

    def __contains__(self, p: torch.Tensor) -> bool:
        return id(p) in self.ids

    def full_shape(self, p: torch.Tensor, shape: tuple[int, ...]) -> tuple[int, ...]:
        if id(p) in self.columns:
            return (shape[0], shape[1] * self.group.size, *shape[2:])
        return (shape[0] * self.group.size, *shape[1:]) if p in self else shape

    def start(self, p: torch.Tensor) -> int:
        """Where this rank's part of `p` begins in the full flattened tensor: its first expert's row
        (`p.numel()`: the elements of this rank's experts, as the backend sees the parameter); 0 for
        a `block` (whose ranges count in its own order)."""
        return self.group.rank * p.numel() if p in self and id(p) not in self.columns else 0

    def block(self, p: torch.Tensor) -> Block | None:
        """lora_B of the experts: this rank's experts' columns of it, seen as rows of all experts."""
        local = self.columns.get(id(p))
        return None if local is None else Block(self.group.rank * local, local, local * self.group.size)


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
        # (the experts as the forward reads them: with LoRA's adapters added, which then get zeros too)
        names = [*module._parameters, *getattr(module, "parametrizations", {})]
        out = out + (arrived.sum() + sum(getattr(module, name).sum() for name in names)) * 0
    back = exchange(out, receive_sizes, send_sizes, group)
    pairs = back[torch.argsort(order)].view(n, k, -1) * top_k_weights[..., None].to(back.dtype)
    # one rank adds a token's choices in the order of their experts: the same order here
    by_expert = torch.argsort(top_k_index, dim=1)
    return pairs.gather(1, by_expert[..., None].expand_as(pairs)).sum(1).to(hidden.dtype)
