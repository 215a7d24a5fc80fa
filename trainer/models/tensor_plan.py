"""Tensor parallelism (`strategy.tp=N`, docs/strategies.md, Tensor parallelism): how a model's layers split
over a tensor group, as the model declares it, and the checks before any work that it splits.

A model declares its plan as transformers 5 does: `_tp_plan`, module names (a `*` for any one part)
to a style name. A Hugging Face family's is its own (`base_model_tp_plan` of its config, under the
base model's prefix, with its output layer's: Llama's q/k/v and gate/up "colwise", o and down
"rowwise", the embedding "embedding_rowwise", lm_head "colwise_gather_output"); the built-in
transformer's is in models/builtin.py; a custom model may declare one. The styles this trainer
splits (strategies/tensor_parallel.py turns them into torch's):

- colwise: a Linear's output features split, the input whole (each rank: its heads, its features);
- rowwise: a Linear's input features split, the outputs summed over the group;
- colwise_gather_output: the output layer, colwise (transformers gathers its logits whole; here they stay
  split over the vocabulary, and the loss is computed where they are: the strategy's loss_parallel);
- embedding_rowwise: an Embedding's rows (tokens) split, the lookups summed over the group;
- packed_colwise[:K]: a Linear whose output packs K projections of equal size one after another (2 if
  not given: transformers' gate and up; the built-in qkv: 3): each rank keeps its share of each;
- replicated_with_grad_allreduce: whole on every rank, its gradient summed over the group (Qwen3's
  per-head q_norm/k_norm, which each rank applies to its own heads only).

A model may declare, beside it, `_tp_sequence_plan`: the modules of sequence parallelism (Megatron's, torchtitan's
plan; `strategy.tp_sequence_parallel`, fsdp only), where the tensors between the split layers (the residual
stream, the norms) are split over the sequence (dim 1) instead of whole on every rank. With it the plan's
rowwise and embedding_rowwise layers scatter their sums over the sequence, and the output layer gathers its
input; its own styles, each whole on every rank of the group, its gradient summed over it:

- sequence_parallel: a norm, computing on its rank's tokens;
- sequence_positions: an Embedding of positions (the built-in's), looking up its rank's share of them;
- sequence_gathered: a module (attention, the MLP) whose first input, its rank's tokens, is gathered whole;
- sequence_split: a module (a Hugging Face family's first decoder layer) whose first input, whole on every rank,
  it takes its rank's tokens of (a local slice; its gradient all-gathered back). A model that declares it keeps
  its embeddings' sums whole (an all-reduce, as without), for a forward that reads the whole sequence from them
  (transformers' causal mask and rotary positions are built from the embeddings' shape).

The built-in transformer declares one; a Hugging Face family of Llama's layout (Llama, Qwen2/3, Mistral, ...:
`llama_sequence_plan`) is given one, read from its own plan's names.

LoRA's adapters (peft=lora: `lora_A`, `lora_B` beside a planned layer's `base_layer`) follow their layer's
split, as Megatron's and NeMo's do: the adapter on the split side takes the layer's style (a colwise or
packed layer's lora_B its rows, packed alike; a rowwise layer's lora_A its columns), the other stays whole.

A tied output layer (its matrix is the embedding's) stays whole on every rank of the group: both its
entries leave the plan. So does an embedding with a `padding_idx`: its backward skips that row by the
index it sees, which on a rank holding other rows is another token's.
"""
from __future__ import annotations

import inspect
from fnmatch import fnmatchcase
from typing import Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from trainer.config import StrategyConfig, StrategyName
from trainer.errors import ConfigError
from trainer.models.builtin import Transformer
from trainer.models.weights import canonical_name

STYLES = ("colwise", "rowwise", "colwise_gather_output", "embedding_rowwise", "packed_colwise",
          "replicated_with_grad_allreduce")
SEQUENCE_STYLES = ("sequence_parallel", "sequence_positions", "sequence_gathered", "sequence_split")


def style_and_parts(value: str) -> tuple[str, int]:
    """("packed_colwise", 3) of "packed_colwise:3"; a style without parts: 1 (packed_colwise: 2)."""
    style, _, parts = value.partition(":")
    return style, int(parts) if parts else 2 if style == "packed_colwise" else 1


def matches(pattern: str, name: str) -> bool:
    """torch's parallelize_module's reading of a plan's key: part by part, `*` any one part."""
    parts, names = pattern.split("."), name.split(".")
    return len(parts) == len(names) and all(fnmatchcase(n, p) for p, n in zip(parts, names))


# the adapter of a LoRA layer whose input (lora_A) or output (lora_B) is split as its layer's: by style
SPLIT_ADAPTER = {"colwise": "lora_B", "colwise_gather_output": "lora_B", "packed_colwise": "lora_B",
                 "rowwise": "lora_A"}


def with_adapters(plan: dict[str, str]) -> dict[str, str]:
    """The plan and its layers' LoRA adapters (`<layer>.lora_B.<adapter name>` of a colwise layer, ...)."""
    adapters = {f"{pattern}.{SPLIT_ADAPTER[style_and_parts(value)[0]]}.*": value for pattern, value in plan.items()
                if style_and_parts(value)[0] in SPLIT_ADAPTER}
    return {**plan, **adapters}


def planned_modules(model: nn.Module, plan_name: str = "_tp_plan") -> list[tuple[str, nn.Module, str]]:
    """(canonical name, module, style value) of every module the model's plan (`plan_name`: its
    `_tp_sequence_plan`) splits, in model order, LoRA's adapters with their layers (`with_adapters`); a
    module whose parameter another module shares (a tied output layer and its embedding), an embedding with
    a padding row, and the adapters of a layer left whole, are left whole."""
    plan = with_adapters(getattr(model, plan_name, None) or {})
    owners: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    found: dict[str, tuple[str, nn.Module, str]] = {}
    for name, module in model.named_modules():
        if hasattr(module, "base_layer"):  # peft's LoRA layer: its base_layer, of the same canonical name, splits
            continue
        name = canonical_name(name)
        value = next((v for pattern, v in plan.items() if matches(pattern, name)), None)
        shared = any(owners[id(p)] > 1 for p in module.parameters(recurse=False))
        layer, _, adapter = name.rpartition(".")[0].rpartition(".")  # an adapter's: q_proj's, lora_B
        whole_layer = adapter in ("lora_A", "lora_B") and layer not in found  # visited before its adapters
        if value is not None and not shared and getattr(module, "padding_idx", None) is None and not whole_layer:
            found[name] = (name, module, value)
    return list(found.values())


# the layer each style splits (torch's parallel styles take Linear and Embedding layers); the others: a Linear
LAYERS = {"embedding_rowwise": nn.Embedding, "replicated_with_grad_allreduce": nn.Module, "sequence_parallel": nn.Module,
          "sequence_positions": nn.Embedding, "sequence_gathered": nn.Module, "sequence_split": nn.Module}


def split_dims(module: nn.Module, style: str, parts: int) -> list[tuple[str, int, int]]:
    """(what, size, ways) that a style splits `ways` ways per rank of the group (size % (ways x tp) == 0)."""
    if style in ("colwise", "colwise_gather_output", "embedding_rowwise"):
        return [("rows", module.weight.shape[0], 1)]
    if style == "rowwise":
        return [("columns", module.weight.shape[1], 1)]
    if style == "packed_colwise":
        return [("rows", module.weight.shape[0], parts)]
    if style == "sequence_positions":  # the sequence, split as its positions
        return [("positions", module.weight.shape[0], 1)]
    return []


def attention_heads(model: nn.Module) -> dict[str, int | None]:
    """The heads a layer's attention has: a Hugging Face config's, the built-in transformer's shape's."""
    if isinstance(model, Transformer):
        return {"attention heads": model.shape.n_heads}
    text = model.config.get_text_config() if getattr(model, "config", None) is not None else None
    return {"attention heads": getattr(text, "num_attention_heads", None),
            "key-value heads": getattr(text, "num_key_value_heads", None)}


# a Hugging Face decoder layer of Llama's layout: a norm before attention and one before the MLP, each added to the
# residual stream, nothing else on it
LLAMA_LAYER = {"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"}


def llama_sequence_plan(model: nn.Module) -> dict[str, str]:
    """The `_tp_sequence_plan` of a Hugging Face family of Llama's layout, read from its `_tp_plan`'s names
    (`<base>.layers.*.self_attn.o_proj` and `.mlp.down_proj` rowwise, an untied lm_head colwise_gather_output),
    every decoder layer of LLAMA_LAYER's modules and a final `<base>.norm`: the first layer's input split over the
    sequence, the norms on their rank's tokens, attention's and the MLP's inputs gathered (torchtitan's Llama
    plan). Empty for any other model: it keeps its norms whole."""
    plan = getattr(model, "_tp_plan", None) or {}
    layers = next((k.removesuffix(".self_attn.o_proj") for k, v in plan.items()
                   if k.endswith(".layers.*.self_attn.o_proj") and v == "rowwise"), None)
    if layers is None or plan.get(f"{layers}.mlp.down_proj") != "rowwise":
        return {}
    base = layers.removesuffix(".layers.*")
    modules = dict(model.named_modules())
    decoder = [module for name, module in modules.items() if matches(layers, name)]
    output_split = any(name == "lm_head" and value == "colwise_gather_output" for name, _, value in planned_modules(model))
    if not (decoder and output_split and isinstance(modules.get(f"{base}.norm"), nn.Module)
            and all({name for name, _ in layer.named_children()} == LLAMA_LAYER for layer in decoder)):
        return {}
    return {f"{base}.layers.0": "sequence_split", f"{layers}.input_layernorm": "sequence_parallel",
            f"{layers}.self_attn": "sequence_gathered", f"{layers}.post_attention_layernorm": "sequence_parallel",
            f"{layers}.mlp": "sequence_gathered", f"{base}.norm": "sequence_parallel"}


def splits_at_embeddings(sequence_plan: list[tuple[str, nn.Module, str]]) -> bool:
    """With sequence parallelism: the embeddings' sums scattered over the sequence (the built-in's), or, where a
    module of the plan splits its input (`sequence_split`), whole, as without."""
    return not any(style_and_parts(value)[0] == "sequence_split" for _, _, value in sequence_plan)


def on_first_input(module: nn.Module, change: Callable[[torch.Tensor], torch.Tensor]) -> RemovableHandle:
    """A forward pre-hook passing the module's first input through `change`, the others as they are: the first
    positional one, or, called by name (transformers' decoder layers call attention with hidden_states=...),
    its forward's first parameter."""
    first = next(iter(inspect.signature(module.forward).parameters))

    def hook(_, args, kwargs):
        if args:
            return (change(args[0]), *args[1:]), kwargs
        return args, {**kwargs, first: change(kwargs[first])}

    return module.register_forward_pre_hook(hook, with_kwargs=True)


def uses_sequence_parallel(strategy: StrategyConfig, model: nn.Module) -> bool:
    """strategy.tp_sequence_parallel as a run takes it: on fsdp at strategy.tp > 1 where the model declares a
    `_tp_sequence_plan` and has no LoRA adapters, unless set false. (An adapter left whole would see a rank's
    share of the sequence, or a gathered DTensor, where its layer's split is planned for the whole one.)"""
    adapted = any(hasattr(module, "base_layer") for module in model.modules())
    return (strategy.tp > 1 and StrategyName(strategy.name) is StrategyName.fsdp and not adapted
            and strategy.tp_sequence_parallel is not False and bool(getattr(model, "_tp_sequence_plan", None)))


def check_model_tensor_parallel(tp: int, model: nn.Module, sequence_parallel: bool = False) -> None:
    """strategy.tp=`tp` > 1: the model declares a plan (`_tp_plan`), in styles this trainer splits, and
    every split dimension, and its attention heads, divide by `tp`; so does its `_tp_sequence_plan` where
    `sequence_parallel`. `model` built on the meta device."""
    config = getattr(model, "config", None)
    family = getattr(config, "model_type", None) or type(model).__name__
    if not getattr(model, "_tp_plan", None):
        where = ("its config has no base_model_tp_plan (transformers declares none for this family)" if config
                 is not None else "it declares no `_tp_plan` (module name patterns to styles, as transformers' models do)")
        raise ConfigError(f"strategy.tp={tp}: {family} has no tensor-parallel plan: {where}; use strategy.tp=1")
    plan = model._tp_plan
    parameters = [name for name, _ in model.named_parameters() if any(matches(k, canonical_name(name)) for k in plan)]
    if parameters:
        raise ConfigError(f"strategy.tp={tp}: {family}'s tensor-parallel plan splits the parameter {parameters[0]} "
                          "itself, which this trainer does not (it splits whole layers); use strategy.tp=1")
    planned = planned_modules(model)
    if not planned:
        raise ConfigError(f"strategy.tp={tp}: {family}'s tensor-parallel plan matches none of its modules; "
                          "use strategy.tp=1")
    check_styles(tp, family, planned, STYLES)
    if sequence_parallel:
        check_styles(tp, family, planned_modules(model, "_tp_sequence_plan"), SEQUENCE_STYLES)
    for what, n in attention_heads(model).items():
        if isinstance(n, int) and n % tp:
            raise ConfigError(f"strategy.tp={tp}: {family} has {n} {what}, which strategy.tp={tp} must divide "
                              "(each rank attends with its own heads); use a strategy.tp that divides them")


def check_styles(tp: int, family: str, planned: list[tuple[str, nn.Module, str]], styles: tuple[str, ...]) -> None:
    """Each planned module's style is one of `styles`, on the layer it takes, its split dimensions dividing."""
    for name, module, value in planned:
        style, parts = style_and_parts(value)
        if style not in styles:
            raise ConfigError(f"strategy.tp={tp}: {family}'s plan splits {name} as {value!r}, which this trainer "
                              f"does not split (it splits {', '.join(styles)}); use strategy.tp=1")
        layer = LAYERS.get(style, nn.Linear)
        if not isinstance(module, layer):
            raise ConfigError(f"strategy.tp={tp}: {family}'s plan splits {name} as {value!r}, which takes a torch "
                              f"{layer.__name__}, not a {type(module).__name__}; use strategy.tp=1")
        for what, size, ways in split_dims(module, style, parts):
            if size % (ways * tp):
                raise ConfigError(f"strategy.tp={tp}: {family}'s {name} has {size} {what}, which {ways} x "
                                  f"strategy.tp={tp} must divide (each rank holds 1/{tp} of each); use a strategy.tp "
                                  "that divides them")
