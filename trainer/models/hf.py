"""model=hf: a local Hugging Face causal-LM folder (config.json, optional *.safetensors and
tokenizer files). Any architecture that AutoModelForCausalLM knows; its blocks come from
`_no_split_modules`. Export writes such a folder back (`python -m trainer.export CKPT DIR`)."""
from __future__ import annotations

import inspect
import json
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from trainer.config import ModelConfig
from trainer.errors import ConfigError
from trainer.extras import require_hf
from trainer.models.converted import Conversions
from trainer.models.tensor_plan import llama_sequence_plan
from trainer.models.weights import SafetensorsWeights, persistent_buffers, safetensors_files, save_safetensors

DEFAULT_MAX_SEQ_LEN = 2048
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt")


def read_config(cfg: ModelConfig, attention: str | None = None):
    """The model's config; `attention`: the attention function to build it with, in place of
    model.attn_implementation (a name registered in transformers' AttentionInterface)."""
    require_hf("model=hf")
    from transformers import AutoConfig

    if not cfg.path:
        raise ConfigError("model.path: model=hf needs a Hugging Face model folder, e.g. model.path=/models/qwen2-0.5b")
    path = Path(cfg.path)
    if not path.is_dir():
        raise ConfigError(f"model.path: {path} is not a directory")
    if not (path / "config.json").is_file():
        raise ConfigError(f"model.path: {path} has no config.json (not a Hugging Face model folder)")
    config = AutoConfig.from_pretrained(str(path))
    config.use_cache = False  # training: no key/value cache in the outputs
    # `auto`: None, which transformers resolves as the model is built (sdpa where the family has it, else eager)
    config._attn_implementation = attention or (None if cfg.attn_implementation == "auto" else cfg.attn_implementation)
    if cfg.router_aux_loss is not None:  # MoE: the router's loss (losses/router_loss.py) from the command line
        config.output_router_logits = cfg.router_aux_loss
    return config


def model_class(config) -> type:
    """The causal-LM class for this config, imported now: a lazy import inside DeepSpeed's
    zero.Init fails (it patches tensor constructors while torch._dynamo loads)."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        raise ConfigError(f"model.path: a {config.model_type!r} model is not a causal LM (AutoModelForCausalLM "
                          "has no class for it)") from None


def resolve(cfg: ModelConfig) -> ModelConfig:
    """The vocabulary from config.json; seq_len, when not given, the smaller of the model's
    max_position_embeddings and 2048."""
    config = read_config(cfg)
    model_class(config)
    cfg.attn_implementation = attention_implementation(cfg, config)
    cfg.vocab_size = config.vocab_size
    positions = getattr(config, "max_position_embeddings", None)
    if cfg.seq_len is None:
        cfg.seq_len = min(positions or DEFAULT_MAX_SEQ_LEN, DEFAULT_MAX_SEQ_LEN)
    elif positions and cfg.seq_len > positions:
        check_longer_context(cfg, config, positions)
    return cfg


def attention_implementation(cfg: ModelConfig, config) -> str:
    """The attention the model runs: model.attn_implementation's, or for `auto` the one transformers
    picks when it is given none (sdpa, else eager: gpt-oss). Which ones a family takes is known only
    by building it (its class flags, installed kernels): built on the meta device, refused in one line."""
    try:
        with torch.device("meta"):
            return model_class(config)(config).config._attn_implementation
    except (ValueError, ImportError) as e:
        cls = model_class(config)
        takes = ["eager"] + [name for name, flag in (("sdpa", "_supports_sdpa"), ("flex_attention", "_supports_flex_attn"),
                                                    ("flash_attention_2", "_supports_flash_attn")) if getattr(cls, flag)]
        raise ConfigError(f"model.attn_implementation={cfg.attn_implementation}: this {config.model_type} model does "
                          f"not run with it here ({str(e).splitlines()[0][:160]}); it takes {', '.join(takes)}, or "
                          "auto (the fastest of them transformers can run)") from None


def check_longer_context(cfg: ModelConfig, config, positions: int) -> None:
    """model.seq_len past max_position_embeddings: refused where positions are learned (an embedding
    the model looks positions up in: there is no row for the later ones); a warning for the others
    (rotary, ALiBi), which run but were not trained that long."""
    from trainer.log import log

    learned = position_embedding(cfg)
    if learned:
        raise ConfigError(f"model.seq_len: {cfg.seq_len} is longer than this {config.model_type} model's "
                          f"{positions} positions, which are learned ({learned}: one row per position); "
                          f"use model.seq_len <= {positions}")
    log.warning(f"model.seq_len={cfg.seq_len} is longer than the {positions} positions (max_position_embeddings) "
                f"this {config.model_type} model was made for; its positions are computed, so it runs, but "
                "quality past them is not what it was trained for")


class _EmbeddingInputs(TorchFunctionMode):
    """Inside: the weights of the embedding lookups whose indices differ along the row."""

    def __init__(self):
        super().__init__()
        self.varying: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is nn.functional.embedding:
            indices, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            if indices.numel() and bool((indices != indices.flatten()[0]).any()):
                self.varying.append(weight)
        return func(*args, **kwargs)


def position_embedding(cfg: ModelConfig) -> str | None:
    """The name of the embedding the model looks its positions up in, seen by what it does: the model
    cut small (`small_builder`, which keeps its positions), run on the CPU on a row of one token id
    repeated; the embedding whose lookup differs along that row is indexed by position (GPT-2's wpe,
    OPT's offset positions), a token embedding's is not (whatever its rows: Mistral-7B-v0.3 has as
    many words as positions). None: positions are computed (rotary, ALiBi) or not used."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = small_builder(cfg)()
    names = {id(m.weight): name for name, m in model.named_modules() if isinstance(m, nn.Embedding)}
    lookups = _EmbeddingInputs()
    try:
        with torch.no_grad(), lookups:
            model(torch.ones(1, 4, dtype=torch.long))
    except Exception as e:
        raise ConfigError(f"model.seq_len: {cfg.seq_len} is past the model's max_position_embeddings, and how it "
                          f"uses positions is seen by running it on the CPU, which failed ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}); use model.seq_len <= its positions") from None
    return next((names[id(w)] for w in lookups.varying if id(w) in names), None)


def builder(cfg: ModelConfig, sp: int = 1, packed: bool = False) -> Callable[[], nn.Module]:
    """At strategy.sp > 1, with Ulysses attention (hf_sequence): each rank holds its share of the tokens.
    At sp=1 on rows of `packed` documents, with the same attention function (the caller asks for it
    where the family takes it: `models.checks.attends_packed_rows`): documents attended without a
    [t, t] mask (models/sequence.py); elsewhere transformers' own, with its packed mask."""
    from trainer.models import hf_sequence

    replaced = sp > 1 or packed
    config = read_config(cfg, hf_sequence.register() if replaced else None)
    cls = model_class(config)
    if sp > 1:
        return lambda: hf_sequence.whole_row_rotary(without_transformers_aux(cls(config)))
    return lambda: with_sequence_plan(without_transformers_aux(cls(config)))  # fp32 parameters: the masters


def with_sequence_plan(model: nn.Module) -> nn.Module:
    """The model, given the `_tp_sequence_plan` of its layout where it has Llama's (strategy.tp_sequence_parallel,
    models/tensor_plan.py's `llama_sequence_plan`); any other keeps its norms whole."""
    plan = llama_sequence_plan(model)
    if plan:
        model._tp_sequence_plan = plan
    return model


def without_transformers_aux(model: nn.Module) -> nn.Module:
    """A mixture-of-experts model run with `output_router_logits=False`: transformers' own load-balancing
    loss (over the micro-batch) is never computed. The trainer's (losses/router_loss.py) takes the
    routers' logits with hooks of its own; config.output_router_logits still says whether that is on,
    and an exported config.json still says what it said."""
    if "output_router_logits" in inspect.signature(model.forward).parameters:
        model.register_forward_pre_hook(lambda _model, args, kwargs: (args, {**kwargs, "output_router_logits": False}),
                                        with_kwargs=True)
    return model


PROBE_VOCAB, PROBE_WIDTH = 128, 64


def small_builder(cfg: ModelConfig, attention: str | None = None) -> Callable[[], nn.Module]:
    """The model cut to one layer of each of its layer types (`layer_types`: full and sliding-window
    attention, ...; one layer where it names none), a vocabulary of PROBE_VOCAB and MLPs (experts too)
    PROBE_WIDTH wide: the same attention (its kind, heads, positions and implementation) in a fraction
    of the memory, for a check that runs it (a 7B Llama: 69 M parameters); `attention` as read_config's."""
    config = read_config(cfg, attention)
    text = config.get_text_config()
    layers = getattr(text, "num_hidden_layers", None)
    kept = first_of_each_layer_type(text)
    for key, value in text.to_dict().items():
        if isinstance(value, list) and layers and len(value) == layers:  # one entry per layer (layer_types)
            setattr(text, key, [value[i] for i in kept])
        elif key.endswith("intermediate_size") and isinstance(value, int):
            setattr(text, key, min(value, PROBE_WIDTH))
        elif key.endswith("token_id") and isinstance(value, int) and value >= PROBE_VOCAB:
            setattr(text, key, None)  # no such token in the smaller vocabulary
    if layers:
        text.num_hidden_layers = len(kept)
    text.vocab_size = min(text.vocab_size, PROBE_VOCAB)
    cls = model_class(config)
    return lambda: cls(config)


def first_of_each_layer_type(text_config) -> list[int]:
    """The index of the first layer of each type the config's `layer_types` names (in order); [0]
    where it names none."""
    types = getattr(text_config, "layer_types", None) or []
    return [i for i, kind in enumerate(types) if kind not in types[:i]] or [0]


@contextmanager
def without_initialisation() -> Iterator[None]:
    """Models built without transformers' `initialize_weights` (ties are still made): the values come
    from the files or InitWeights afterwards, filled per rank by the strategy, so the init is work
    thrown away; on the meta device it does nothing, and under ZeRO-3's zero.Init it would index into
    empty partitions (an embedding's `padding_idx` row: Phi-3, Gemma). The family's own build context
    (trainer.models.build_model enters it): no strategy needs to know a model family for it."""
    from trainer.patches import INITIALIZE_WEIGHTS, replaced

    with replaced(INITIALIZE_WEIGHTS, lambda own: lambda self: None):
        yield


def pretrained_weights(cfg: ModelConfig, model: nn.Module,
                       shapes: dict[str, tuple[int, ...]]) -> SafetensorsWeights | None:
    """The folder's safetensors weights, checked against the model; None when it has none."""
    path = Path(cfg.path)
    quantisation = getattr(model.config, "quantization_config", None)
    if quantisation:
        method = quantisation.get("quant_method", "?") if isinstance(quantisation, dict) else type(quantisation).__name__
        raise ConfigError(f"model.path: {path}/config.json has a quantization_config ({method}): its weights are "
                          "quantised, and the trainer trains from float weights only; dequantise them first")
    if safetensors_files(path):
        buffers = {name: tuple(b.shape) for name, b in persistent_buffers(model).items()}
        return SafetensorsWeights(path, shapes, checkpoint_key_renamer(model, shapes), buffers, known_extra_keys(model),
                                  Conversions(model, shapes))
    if list(path.glob("*.bin")):
        raise ConfigError(f"model.path: {path} holds *.bin weights; the trainer reads safetensors only "
                          "(save_pretrained(..., safe_serialization=True) writes them)")
    return None


def known_extra_keys(model: nn.Module) -> Callable[[str], bool]:
    """Keys a Hugging Face file may hold besides parameters and buffers: the second name of a tied
    parameter, and what the model's class ignores on load (GPT-2's old `attn.bias`)."""
    import re

    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
    return lambda name: name in names or any(p.search(name) for p in ignored)


def checkpoint_key_renamer(model: nn.Module, shapes: dict) -> Callable[[str], str]:
    """A checkpoint key -> the model's parameter name, as `from_pretrained` renames it: its
    conversion mapping (GPT-NeoX's `embed_out` is the model's `lm_head`, ...) and the base model
    prefix. Keys that a conversion merges into another tensor (fused experts) are `Conversions`'
    (trainer.models.converted), which SafetensorsWeights asks first; any left are refused."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    prefix = getattr(model, "base_model_prefix", None) or None

    def rename(key: str) -> str:
        name, converted = rename_source_key(key, renamings, converters, prefix, shapes)
        if converted is not None:
            raise ConfigError(f"model.path: {key} needs transformers' conversion {converted!r}, which merges or "
                              "splits tensors; the trainer reads weights as they are stored")
        return name
    return rename


def description(cfg: ModelConfig, tokenizer: str | None, chat_template: str | None = None) -> dict:
    """What a checkpoint records to export a Hugging Face folder later: the config itself (the
    source folder may be gone by then), where the tokenizer's files are and the chat template the
    run rendered its conversations with (`data.chat_template`'s text: the file may be gone too)."""
    config = read_config(cfg)
    config.dtype = torch.float32  # the exported weights are the fp32 masters
    config.use_cache = True  # for whoever loads the export to generate
    found = next((Path(c).resolve() for c in (tokenizer, cfg.path)
                  if c and any((Path(c) / f).is_file() for f in TOKENIZER_FILES)), None)
    return {"kind": "hf", "config": config.to_dict(), "path": str(Path(cfg.path).resolve()),
            "tokenizer": str(found) if found else None,
            "chat_template": Path(chat_template).read_text() if chat_template else None}


def config_of(source: dict):
    """The model's config, as a checkpoint's `source` records it."""
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[source["config"]["model_type"]].from_dict(source["config"])


def generation_config(source: dict, config):
    """The source folder's generation_config.json (sampling defaults, stop tokens), else the one
    transformers derives from config.json."""
    from transformers import GenerationConfig

    path = Path(source.get("path") or "")
    if (path / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(str(path))
    return GenerationConfig.from_model_config(config)


def export_folder(weights: dict[str, torch.Tensor], source: dict, out: Path, tokenizer: Path | None,
                  max_shard_size: str = "5GB") -> None:
    """A folder `AutoModelForCausalLM.from_pretrained(out)` loads: config.json, generation_config.json,
    the weights in safetensors (sharded, with an index, above `max_shard_size`) and the tokenizer's files."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from transformers.core_model_loading import revert_weight_conversion

    out.mkdir(parents=True, exist_ok=True)
    config = config_of(source)
    config.save_pretrained(str(out))
    generation_config(source, config).save_pretrained(str(out))
    with torch.device("meta"):
        model = model_class(config)(config)
    weights = revert_weight_conversion(model, weights)  # the keys transformers itself saves
    split = split_torch_state_dict_into_shards(weights, max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        save_safetensors({n: weights[n].contiguous() for n in names}, out / filename, metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(w.numel() * w.element_size() for w in weights.values())},
                 "weight_map": split.tensor_to_filename}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    if tokenizer is not None:
        save_tokenizer(tokenizer, source.get("chat_template"), out)


def save_tokenizer(tokenizer: Path, chat_template: str | None, out: Path) -> None:
    """The tokenizer's files in `out`, with the chat template the run trained with (`data.chat_template`)
    in place of its own: the exported model formats prompts as training did."""
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(str(tokenizer))
    if chat_template is not None:
        loaded.chat_template = chat_template
    loaded.save_pretrained(str(out))
