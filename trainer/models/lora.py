"""peft=lora: LoRA adapters from the `peft` library, added where the model is built (on the meta
device, or inside ZeRO-3's zero.Init), so every strategy shards, fills, saves and resumes them
as it does any parameter. The model's own weights are frozen: no gradients, no optimizer state.

Names: peft moves a wrapped layer's weight to `<layer>.base_layer.weight`; `canonical_name`
drops `base_layer`, so the frozen weights keep the plain model's names (and its pretrained
files fit them), and the adapters are `<layer>.lora_A.default.weight` / `lora_B`. A PEFT
adapter folder names them `base_model.model.<layer>.lora_A.weight` (`peft_key`).

Mixture-of-experts models hold their experts as stacked parameters (`experts.gate_up_proj`
[E, 2I, H]), not linear layers: peft adapts them by `target_parameters` (peft >= 0.17; its
ParamWrapper adds B @ A per expert to the parameter during the forward). Two wrapped parameters of
one module nest (`experts.base_layer`): the inner one's adapters keep that `base_layer` in their
names, as peft's adapter folder does.
"""
from __future__ import annotations

import json
import math
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from trainer.config import PeftConfig, PeftName
from trainer.errors import ConfigError
from trainer.models.weights import Block, Run, ShapeOf, WeightSource, canonical_name, module_seed, tensor_shape

ADAPTER = "default"  # peft's name for the one adapter
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def enabled(cfg: PeftConfig | None) -> bool:
    return cfg is not None and PeftName(cfg.name) is PeftName.lora


def linear_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Every layer LoRA can adapt (torch's Linear; transformers' Conv1D, GPT-2's), by name; the output
    layer too, which a list of names may pick (as in peft) and `all-linear` leaves out."""
    return {name: m for name, m in model.named_modules()
            if (type(m).__name__ in ("Linear", "Conv1D") or isinstance(m, nn.Linear)) and name}


def output_layer(model: nn.Module, vocab_size: int) -> nn.Module | None:
    """The layer that makes the logits. peft's `all-linear` leaves out a Hugging Face model's
    `get_output_embeddings()` and nothing on other models; here it is left out on every kind: the
    reference and custom models have no such method, so theirs is the last linear layer whose
    outputs are the vocabulary (the logits come last; a layer before it may be as wide), the outermost:
    with LoRA on it, peft's layer, not its base_layer or lora_B inside."""
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if output is not None:
        return output
    widths = {name: getattr(m, "out_features", getattr(m, "nf", None)) for name, m in linear_layers(model).items()}
    heads = [name for name, width in widths.items() if width == vocab_size]
    outermost = [name for name in heads if not any(name.startswith(f"{head}.") for head in heads)]
    return model.get_submodule(outermost[-1]) if outermost else None


def matches(name: str, target: str) -> bool:
    """peft's rule for a list of target names: the name itself, or a name that ends in `.target`."""
    return name == target or name.endswith(f".{target}")


def expert_parameters(model: nn.Module) -> list[str]:
    """The stacked expert matrices of a mixture-of-experts model, by canonical name: its 3-D
    parameters ([experts, out, in] or [experts, in, out]; ZeRO-3's partitions keep the shape in
    `ds_shape`). Their biases ([experts, out]) and the router are not among them."""
    return sorted(canonical_name(n) for n, p in model.named_parameters()
                  if len(getattr(p, "ds_shape", p.shape)) == 3 and not is_adapter(canonical_name(n)))


def routers(model: nn.Module) -> set[str]:
    """Linear layers that are direct children of a module holding experts (the MoE block): the
    router (`mlp.gate`, where it is a Linear) and Qwen2-MoE's `shared_expert_gate`. They decide
    where tokens go; `all-linear` leaves them out."""
    blocks = {name.rpartition(".")[0].rpartition(".")[0] for name in expert_parameters(model)}
    return {name for name in linear_layers(model) if canonical_name(name).rpartition(".")[0] in blocks}


def short_names(chosen: list[str], every: list[str]) -> list[str]:
    """The last two parts of each chosen name (`experts.down_proj`) where they pick exactly the
    chosen ones among `every`, as peft matches a name; else the full names."""
    tails = sorted({".".join(n.split(".")[-2:]) for n in chosen})
    return tails if sorted(n for n in every if any(matches(n, t) for t in tails)) == sorted(chosen) else chosen


def target_parameters(model: nn.Module, cfg: PeftConfig) -> list[str]:
    """The stacked expert parameters to adapt: all of them for `all-linear`, else those a
    target name matches (`experts.gate_up_proj`, `gate_up_proj`, or a full name)."""
    experts = expert_parameters(model)
    if cfg.target_modules == "all-linear":
        chosen = experts
    else:
        chosen = [n for n in experts if any(matches(n, t) for t in cfg.target_modules)]
    return short_names(chosen, experts) if chosen else []


def target_modules(model: nn.Module, cfg: PeftConfig, vocab_size: int) -> list[str]:
    """The names to give peft: the leaf names (q_proj, ...) where they pick exactly the layers meant,
    else full names. `all-linear`: every linear layer but the output layer (`output_layer`). A given
    name that matches no linear layer is refused, naming those there are."""
    layers = linear_layers(model)
    if cfg.target_modules == "all-linear":
        output, gates = output_layer(model, vocab_size), routers(model)
        chosen = sorted(name for name, m in layers.items() if m is not output and name not in gates)
    else:
        experts = expert_parameters(model)
        unknown = [t for t in cfg.target_modules if not any(matches(n, t) for n in [*layers, *experts])]
        if unknown:
            # the last part of each name (q_proj), with its parent's where it is an index (mlp.0)
            leaves = sorted({".".join(n.split(".")[-2:] if n.rpartition(".")[2].isdigit() else n.split(".")[-1:])
                             for n in layers})
            raise ConfigError(f"peft.target_modules: {', '.join(unknown)} matches no linear layer of "
                              f"{type(model).__name__}; its linear layers: {', '.join(leaves)}"
                              + (f"; its experts: {', '.join(short_names(experts, experts))}" if experts else ""))
        chosen = sorted(n for n in layers if any(matches(n, t) for t in cfg.target_modules))
    leaves = sorted({n.rpartition(".")[2] for n in chosen})
    every_linear = [n for n, _ in model.named_modules() if any(matches(n, leaf) for leaf in leaves)]
    return leaves if sorted(every_linear) == chosen else chosen


def lora_config(settings: dict):
    """peft's LoraConfig from what a checkpoint records (`settings`)."""
    from peft import LoraConfig

    targets = settings["target_modules"]  # a list of names, or (from an adapter folder) peft's regex string
    experts = settings.get("target_parameters")  # only where experts are adapted: older settings lack it
    return LoraConfig(r=settings["r"], lora_alpha=settings["alpha"], lora_dropout=settings["dropout"],
                      target_modules=targets if isinstance(targets, str) else list(targets), bias="none",
                      **({"target_parameters": list(experts)} if experts else {}))


def add_adapters(model: nn.Module, cfg: PeftConfig, vocab_size: int) -> nn.Module:
    """The model (whose logits are `vocab_size` wide) with LoRA adapters on its target layers, the
    rest frozen; in place."""
    from peft import inject_adapter_in_model

    settings = from_init(cfg) if cfg.init else adapter_settings(model, cfg, vocab_size)
    inject_adapter_in_model(lora_config(settings), model)
    model.lora_settings = settings  # read by the checkpoint's manifest (export needs them)
    return model


def adapter_settings(model: nn.Module, cfg: PeftConfig, vocab_size: int) -> dict:
    settings = {"r": cfg.r, "alpha": cfg.alpha, "dropout": cfg.dropout or 0.0,
                "target_modules": target_modules(model, cfg, vocab_size)}
    experts = target_parameters(model, cfg)
    if experts and cfg.dropout:  # peft's ParamWrapper raises a ValueError deep in the build
        raise ConfigError(f"peft.dropout={cfg.dropout}: peft's LoRA on stacked expert parameters "
                          f"({', '.join(experts)}) has no dropout; use peft.dropout=0")
    return {**settings, "target_parameters": experts} if experts else settings


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def peft_key(name: str) -> str:
    """A canonical adapter name as a PEFT adapter folder keys it (no adapter name, under base_model.model)."""
    return "base_model.model." + name.replace(f".{ADAPTER}.", ".")


def read_adapter_folder(path: Path) -> dict:
    """peft.init=DIR: its settings, from adapter_config.json (refused unless LoRA)."""
    if not (path / ADAPTER_CONFIG).is_file() or not (path / ADAPTER_WEIGHTS).is_file():
        raise ConfigError(f"peft.init: {path} is not a PEFT adapter folder ({ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    if config.get("peft_type") != "LORA" or config.get("use_dora") or config.get("use_rslora"):
        raise ConfigError(f"peft.init: {path} holds a {config.get('peft_type')} adapter"
                          f"{' with DoRA or rsLoRA' if config.get('peft_type') == 'LORA' else ''}; "
                          "the trainer continues plain LoRA adapters")
    targets, experts = config["target_modules"], config.get("target_parameters")
    settings = {"r": config["r"], "alpha": config["lora_alpha"], "dropout": config.get("lora_dropout", 0.0),
                "target_modules": sorted(targets) if isinstance(targets, list) else targets}
    return {**settings, "target_parameters": sorted(experts)} if experts else settings


def from_init(cfg: PeftConfig) -> dict:
    """peft.init=DIR: the folder's settings, which the adapters' shapes and names follow. A peft.r,
    alpha or target_modules set to something else (not its default) would be ignored without a
    word: refused, naming both values. Dropout is no part of the adapters: peft.dropout, where
    given, replaces the folder's."""
    settings = read_adapter_folder(Path(cfg.init))
    if cfg.dropout is not None:
        settings["dropout"] = cfg.dropout
    defaults = PeftConfig()
    given = {"r": cfg.r, "alpha": cfg.alpha, "target_modules": cfg.target_modules}
    for key, value in given.items():
        saved = settings[key]
        if value == getattr(defaults, key):
            continue
        same = (sorted(value) == sorted(saved) if isinstance(value, (list, tuple)) and isinstance(saved, list)
                else value == saved)
        if not same:
            raise ConfigError(f"peft.{key}={value if not isinstance(value, (list, tuple)) else list(value)}: "
                              f"peft.init={cfg.init} holds adapters with {key} {saved!r}, which the run continues; "
                              f"leave peft.{key} unset (or start new adapters without peft.init)")
    return settings


class AdapterWeights:
    """The first values of a LoRA model: the base's from `base` (pretrained files or the model's
    own init), the adapters' as peft makes them (A: Kaiming-uniform, seeded per layer; B: zeros, so
    training starts at the base model), or from a PEFT adapter folder (`peft.init`)."""

    def __init__(self, base: WeightSource, shapes: dict[str, tuple[int, ...]], seed: int, init: Path | None):
        self.base, self.shapes, self.seed, self.init = base, shapes, seed, init
        self.fingerprint = getattr(base, "fingerprint", None)
        count = sum(math.prod(shape) for shape in shapes.values())
        self.description = (f"{base.description}, frozen; {count:,} parameters of LoRA adapters train"
                            + (f", from {init}" if init else ""))
        if init is not None:
            from safetensors import safe_open

            with safe_open(str(init / ADAPTER_WEIGHTS), framework="pt") as f:
                stored = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
            wrong = [f"{name}: {'missing' if peft_key(name) not in stored else list(stored[peft_key(name)])}, "
                     f"model {list(shape)}" for name, shape in shapes.items() if stored.get(peft_key(name)) != shape]
            if wrong:
                raise ConfigError(f"peft.init: the adapters in {init} do not fit this model ({len(wrong)}):\n  "
                                  + "\n  ".join(wrong[:10]))

    def read(self, name: str, start: int, numel: int, block: Block | None = None) -> torch.Tensor:
        if name not in self.shapes:
            return self.base.read(name, start, numel, block)
        return Run(start, numel, block).of(self._values(name).view(-1))

    def read_buffer(self, name: str) -> torch.Tensor | None:
        return self.base.read_buffer(name)

    def _values(self, name: str) -> torch.Tensor:
        if self.init is not None:
            from safetensors import safe_open

            with safe_open(str(self.init / ADAPTER_WEIGHTS), framework="pt") as f:
                return f.get_tensor(peft_key(name)).float()
        values = torch.zeros(self.shapes[name])
        if ".lora_A." in name:  # as peft's reset_lora_parameters, seeded by the layer's name
            generator = torch.Generator().manual_seed(module_seed(self.seed, name))
            nn.init.kaiming_uniform_(values, a=math.sqrt(5), generator=generator)
        return values


def write_adapter_folder(adapters: dict[str, torch.Tensor], settings: dict, base_path: str | None, out: Path) -> None:
    """A folder `PeftModel.from_pretrained(base, out)` loads: adapter_config.json and
    adapter_model.safetensors (`adapters` by canonical name)."""
    from trainer.models.weights import save_safetensors

    out.mkdir(parents=True, exist_ok=True)
    config = lora_config(settings)
    config.base_model_name_or_path = base_path
    config.save_pretrained(str(out))
    save_safetensors({peft_key(n): w.contiguous() for n, w in adapters.items()}, out / ADAPTER_WEIGHTS,
                     metadata={"format": "pt"})


@torch.no_grad()
def merged(weights: dict[str, torch.Tensor], settings: dict, build: Callable[[], nn.Module]) -> dict[str, torch.Tensor]:
    """The plain model's weights with the adapters merged in, by peft itself (`merge_and_unload`):
    `weights` holds the base's and the adapters' values by canonical name; `build` makes the plain model."""
    from peft import get_peft_model, set_peft_model_state_dict

    from trainer.models.weights import allocate_params, params_on_meta

    with params_on_meta():
        model = build()
    allocate_params(model, torch.device("cpu"))  # ties kept: a tied matrix is loaded once
    base = {n: w for n, w in weights.items() if not is_adapter(n)}
    missing = set(n for n, _ in model.named_parameters()) - set(base)
    if missing:
        raise ConfigError(f"merge: no values for {len(missing)} parameters of the model, e.g. {sorted(missing)[0]}")
    model.load_state_dict(base, strict=False)
    with warnings.catch_warnings():  # peft asks transformers a deprecated question
        warnings.simplefilter("ignore", FutureWarning)
        peft_model = get_peft_model(model, lora_config(settings))
    loaded = set_peft_model_state_dict(peft_model, {peft_key(n): w for n, w in weights.items() if is_adapter(n)})
    if loaded.unexpected_keys:
        raise ConfigError(f"merge: adapters the model does not have: {loaded.unexpected_keys[:5]}")
    plain = peft_model.merge_and_unload()
    return {canonical_name(n): p.detach() for n, p in plain.named_parameters()}


def adapter_shapes(model: nn.Module, shape_of: ShapeOf = tensor_shape) -> dict[str, tuple[int, ...]]:
    return {canonical_name(n): shape_of(p) for n, p in model.named_parameters() if is_adapter(canonical_name(n))}


@contextmanager
def adapters_disabled(model: nn.Module):
    """The model as its base: every LoRA layer's adapters switched off, then on again. peft's own
    `enable_adapters(False)` also sets the adapters' requires_grad, which sharded strategies have
    already planned around (FSDP2's DTensors, DeepSpeed's hooks); its `_disable_adapters` flag,
    which each layer's forward reads, is all that is switched (peft 0.21.2)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    if not layers:  # the reference would silently be the policy itself (the loss stays at ln 2)
        raise RuntimeError("the reference with adapters off: this model has no LoRA layers")
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield model
    finally:
        for layer in layers:
            layer._disable_adapters = False


class StartingAdapters(nn.Module):
    """objective=dpo's reference when training continues from an adapter (`peft.init`): the
    adapters the run started from, frozen, held whole on every rank in the training dtype (an
    adapter's few parameters need no sharding, so no strategy has to gather them), outside the
    policy's parameters (its checkpoints and exports are unchanged). Inside `applied(model)`, every
    LoRA layer's own adapter is off and a forward hook adds these instead, as peft adds its adapter:
    base(x) + B(A(x)) x scaling (no dropout: the reference runs in eval mode). The hooks are on the
    layers from the start, switched by a flag, so a compiled block traces them with the flag guarded.
    Not the bare base, which gives loss 0 once the starting adapter is good (LLaMA-Factory#8459)."""

    def __init__(self, model: nn.Module, folder: Path, dtype: torch.dtype, device: torch.device):
        super().__init__()
        from peft.tuners.lora import LoraLayer
        from safetensors import safe_open

        self.weights = nn.ParameterList()  # [A, B] of each layer, for the memory they take
        self.on, self.applied_to = False, set()
        self.layers = {canonical_name(name): m for name, m in model.named_modules()
                       if isinstance(m, LoraLayer) and ADAPTER in m.lora_A}
        if not self.layers:
            raise RuntimeError("the starting adapters as the reference: this model has no LoRA layers")
        with safe_open(str(folder / ADAPTER_WEIGHTS), framework="pt") as f:
            for name, layer in self.layers.items():
                a, b = (nn.Parameter(f.get_tensor(peft_key(f"{name}.{part}.{ADAPTER}.weight")).to(device, dtype),
                                     requires_grad=False) for part in ("lora_A", "lora_B"))
                self.weights.extend([a, b])
                layer.register_forward_hook(self._hook(name, a, b, layer.scaling[ADAPTER]))

    def _hook(self, name: str, a: torch.Tensor, b: torch.Tensor, scaling: float):
        def add_starting_adapter(layer, args, output):
            if not self.on:
                return output
            self.applied_to.add(name)
            x = args[0].to(a.dtype)  # as peft casts the input to its adapter's dtype
            return (output + nn.functional.linear(nn.functional.linear(x, a), b) * scaling).to(output.dtype)
        return add_starting_adapter

    @contextmanager
    def applied(self, model: nn.Module):
        """The model with its LoRA layers as they started, for a forward; every layer must have
        taken them (a layer that did not would silently be the bare base)."""
        self.applied_to = set()
        with adapters_disabled(model):
            self.on = True
            try:
                yield model
            finally:
                self.on = False
        missed = sorted(set(self.layers) - self.applied_to)
        if missed:
            raise RuntimeError(f"the starting adapters were not applied to {len(missed)} LoRA layers, e.g. {missed[0]}")
