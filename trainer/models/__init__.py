"""Every kind of model behind one `build_model`: the reference transformer (`model=tiny|small|...`),
a Hugging Face causal-LM folder (`model=hf`), any nn.Module from a factory (`model=custom`).

A model maps token ids [b, t] to logits [b, t, vocab] (`logits_of` also takes an output with
`.logits`); the loop computes the loss. `resolve_model` fills what comes from the model itself
(vocabulary; for hf, the default context length) once, before any rank starts.
"""
from __future__ import annotations

import dataclasses
import json
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from trainer.config import ModelConfig, ModelKind, PeftConfig, model_node
from trainer.models import custom, hf, lora
from trainer.models.builtin import Transformer, shape_of
from trainer.models.custom import logits_of as logits_of  # trainer.models.logits_of, for every kind
from trainer.models.weights import InitWeights, ShapeOf, WeightSource, canonical_name, tensor_shape


def builder(cfg: ModelConfig, sp: int = 1, packed: bool = False) -> Callable[[], nn.Module]:
    """A function that builds the model (for `sp` ranks per sequence: strategy.sp; for rows of
    `packed` documents); everything it imports is imported now."""
    kind = ModelKind(cfg.kind)
    if kind is ModelKind.hf:
        return hf.builder(cfg, sp, packed)
    if kind is ModelKind.custom:
        return custom.builder(cfg)
    return lambda: Transformer(shape_of(cfg))


def build_model(cfg: ModelConfig, context: AbstractContextManager, peft: PeftConfig | None = None,
                sp: int = 1, packed: bool = False) -> nn.Module:
    """The model built inside `context`: the strategy's (parameters on meta, ZeRO-3's zero.Init),
    or `torch.device("meta")` to count and check; with LoRA adapters where `peft` asks for them;
    its attention split over `sp` ranks per sequence (strategy.sp; a Hugging Face model's differs)
    and, for rows of `packed` documents, a Hugging Face model's through the trainer's attention
    (`packed` only where the family takes it: models.checks.attends_packed_rows)."""
    make = builder(cfg, sp, packed)
    with context, own_build_context(cfg):
        model = make()
        return lora.add_adapters(model, peft, cfg.vocab_size) if lora.enabled(peft) else model


def disable_dropout(model: nn.Module) -> None:
    """No dropout anywhere in `model`, in place: every nn.Dropout's p (TRL's disable_dropout_in_model:
    the model's own, LoRA's lora_dropout) and the probabilities Hugging Face attention reads from a
    float attribute in train mode (`attention_dropout`, `dropout_p`, ...), which TRL's misses."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        for name, value in vars(module).items():
            if "drop" in name and isinstance(value, float):
                setattr(module, name, 0.0)


def own_build_context(cfg: ModelConfig) -> AbstractContextManager:
    """What a family needs around its own build, whatever the strategy's context: a Hugging Face
    model skips transformers' weight init (`hf.without_initialisation`), the values come afterwards."""
    return hf.without_initialisation() if ModelKind(cfg.kind) is ModelKind.hf else nullcontext()


_META_MODELS: dict[str, nn.Module] = {}


def meta_model(cfg: ModelConfig, peft: PeftConfig | None = None) -> nn.Module:
    """The model on the meta device, to count and to check (never changed): built once per
    process for the settings, however many checks and counts ask for it."""
    adapters = dataclasses.asdict(peft) if lora.enabled(peft) else None
    key = json.dumps([model_node(cfg), adapters], sort_keys=True, default=str)
    if key not in _META_MODELS:
        _META_MODELS[key] = build_model(cfg, torch.device("meta"), peft)
    return _META_MODELS[key]


def resolve_model(cfg: ModelConfig) -> ModelConfig:
    kind = ModelKind(cfg.kind)
    if kind is ModelKind.hf:
        return hf.resolve(cfg)
    if kind is ModelKind.custom:
        return custom.resolve(cfg)
    return cfg


def param_shapes(model: nn.Module, shape_of: ShapeOf = tensor_shape) -> dict[str, tuple[int, ...]]:
    """Canonical parameter name -> full shape (`shape_of`: the strategy's, for a model it built)."""
    return {canonical_name(n): shape_of(p) for n, p in model.named_parameters()}


def initial_weights(cfg: ModelConfig, model: nn.Module, seed: int, peft: PeftConfig | None = None,
                    shape_of: ShapeOf = tensor_shape) -> WeightSource:
    """Pretrained weights where a Hugging Face folder has them, else the model's own init; LoRA
    adapters as peft starts them, or from `peft.init`."""
    adapters = lora.adapter_shapes(model, shape_of)
    shapes = {name: shape for name, shape in param_shapes(model, shape_of).items() if name not in adapters}
    pretrained = hf.pretrained_weights(cfg, model, shapes) if ModelKind(cfg.kind) is ModelKind.hf else None
    base = pretrained or InitWeights(model, seed, shape_of)
    if not adapters:
        return base
    return lora.AdapterWeights(base, adapters, seed, Path(peft.init) if peft and peft.init else None)


def description(cfg: ModelConfig, tokenizer: str | None = None, model: nn.Module | None = None,
                chat_template: str | None = None) -> dict:
    """What a checkpoint records about where the model came from (export needs it); `tokenizer`:
    the data's tokenizer folder, when not the model's own, and `chat_template` its data.chat_template
    file; `model`'s LoRA settings, if it has adapters."""
    found = (hf.description(cfg, tokenizer, chat_template) if ModelKind(cfg.kind) is ModelKind.hf
             else {"kind": ModelKind(cfg.kind).value})
    found["model"] = model_node(cfg)  # to build it again (trainer.convert --to deepspeed)
    settings = getattr(model, "lora_settings", None)
    return {**found, "lora": settings} if settings else found


@dataclass(frozen=True)
class ModelFacts:
    params: int
    n_layers: int  # the blocks found by strategy.wrap / _no_split_modules
    d_model: int  # the width of the input embedding
    flops_per_token: int
    trainable: int  # parameters that train (all but frozen ones: LoRA's base)
    sizes: tuple[int, ...]  # of each parameter
    active: int  # the parameters a token activates: a mixture of experts' top_k of E (active_params)
    experts: int = 0  # routed experts a MoE layer has (its config's count); 0: not a mixture of experts
    expert_params: int = 0  # elements of the routed experts' stacked parameters: what strategy.ep splits
    routed_per_token: int = 0  # (token, expert) pairs a token makes, over all MoE layers: top_k x those layers
    expert_sizes: tuple[int, ...] = ()  # of each of those stacked parameters, whole

    def elements_below(self, size: int) -> int:
        """Elements in parameters of fewer than `size` (what ZeRO-3 keeps whole on every rank)."""
        return sum(n for n in self.sizes if n < size)

    def expert_elements_below(self, size: int, ep: int) -> tuple[int, int]:
        """Of the routed experts' stacked parameters: the elements of those of fewer than `size`, and a
        rank's elements of those whose 1 / ep share is (strategy.ep: ZeRO-3 keeps these whole among
        the ranks that hold the same experts)."""
        return sum(n for n in self.expert_sizes if n < size), sum(n // ep for n in self.expert_sizes if n // ep < size)


def model_facts(cfg: ModelConfig, wrap: list[str] | None, peft: PeftConfig | None = None) -> ModelFacts:
    """Counts from the model built on the meta device (with `peft`'s adapters). Training FLOPs per
    token, as PaLM: per parameter that multiplies (embedding lookups do not; a tied output matrix
    does) 2 forward, 2 backward for its input's gradient and 2 for its own gradient, which a frozen
    one (LoRA's base) does not have: 6 x trainable + 4 x frozen; + 12 x layers x width x context
    for attention. A mixture of experts' parameters count for the share a token activates (top_k of
    the E experts: `active_params`). For strategy.ep: the experts a layer has, the elements of the
    modules that ep splits (models/experts.py) and the (token, expert) pairs a token makes."""
    from trainer.models.active_params import active_count, active_fractions, experts_per_token
    from trainer.models.blocks import find_blocks
    from trainer.models.experts import expert_modules, routed_experts

    model = meta_model(cfg, peft)
    params = sum(p.numel() for p in model.parameters())
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    matmul_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    lookups = {id(e.weight) for e in embeddings if id(e.weight) not in matmul_weights}
    multiplying = [p for p in model.parameters() if id(p) not in lookups]
    n_layers = len(find_blocks(model, wrap))
    d_model = embeddings[0].embedding_dim if embeddings else 0
    active = active_fractions(model)
    flops = round(sum((6 if p.requires_grad else 4) * p.numel() * active.get(id(p), 1.0) for p in multiplying)) \
        + 12 * n_layers * d_model * cfg.seq_len
    names = {id(m): name for name, m in model.named_modules()}
    routed = expert_modules(model)
    experts = (routed_experts(model) or 0) if routed else 0
    return ModelFacts(params, n_layers, d_model, flops, sum(p.numel() for p in model.parameters() if p.requires_grad),
                      tuple(p.numel() for p in model.parameters()), active_count(model),
                      experts=experts,
                      expert_params=sum(p.numel() for m in routed for p in m.parameters(recurse=False)),
                      routed_per_token=sum(experts_per_token(model, names[id(m)]) or 0 for m in routed),
                      expert_sizes=tuple(p.numel() for m in routed for p in m.parameters(recurse=False)))
