"""The parameters a token activates. A mixture-of-experts layer holds its experts stacked
(`experts.gate_up_proj` [E, 2I, H], `experts.down_proj`, gpt-oss's per-expert biases [E, ...]);
its router sends each token to `top_k` of the E, so a token multiplies top_k / E of those
parameters. Everything else (attention, the router, shared experts, embeddings) is used by every
token. FLOPs and MFU count active parameters; memory counts them all.

Found from the model's structure, so every family that stacks its experts is counted alike: a
module holding a 3-D parameter holds experts (E: its first dimension); top_k is the `top_k` of a
module in the same block (transformers' routers carry it), else the config's `num_experts_per_tok`.
"""
from __future__ import annotations

from torch import nn


def expert_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The modules that hold stacked experts, by name; the outermost where peft wraps them (its
    ParamWrapper: `experts`, `experts.base_layer`, ... are one module of experts)."""
    modules = dict(model.named_modules())
    holding = [name for name, module in modules.items()
               if any(len(getattr(p, "ds_shape", p.shape)) == 3 for p in module.parameters(recurse=False))]
    outermost = {}
    for name in holding:  # the wrapper's name is the stacked module's with `.base_layer` parts dropped
        wrapper = name
        while wrapper.endswith(".base_layer"):
            wrapper = wrapper.removesuffix(".base_layer")
        outermost[wrapper] = modules[wrapper]
    return outermost


def experts_per_token(model: nn.Module, experts_name: str) -> int | None:
    """top_k of the block that holds `experts_name`: its router's, else the config's."""
    block = model.get_submodule(experts_name.rpartition(".")[0]) if "." in experts_name else model
    for module in block.modules():
        if isinstance(getattr(module, "top_k", None), int):
            return module.top_k
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "num_experts_per_tok", None)


def active_fractions(model: nn.Module) -> dict[int, float]:
    """id(parameter) -> the fraction of it a token uses, for the experts' parameters (top_k / E);
    every parameter not here is used whole. Experts whose top_k is not known count whole."""
    fractions: dict[int, float] = {}
    for name, module in expert_modules(model).items():
        top_k = experts_per_token(model, name)
        stacked = next(p for p in module.parameters() if len(getattr(p, "ds_shape", p.shape)) == 3)
        n_experts = getattr(stacked, "ds_shape", stacked.shape)[0]
        if top_k:
            fractions.update({id(p): min(top_k, n_experts) / n_experts for p in module.parameters()})
    return fractions


def active_count(model: nn.Module) -> int:
    """The parameters one token activates (each counted once: ties are one parameter)."""
    fractions = active_fractions(model)
    return round(sum(p.numel() * fractions.get(id(p), 1.0) for p in model.parameters()))


def short_count(n: int) -> str:
    """30.5B, 3.3B, 125.0M, 12.3K: a count for a line of text."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)
