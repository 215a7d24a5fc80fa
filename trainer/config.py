"""Typed config schema, registered in Hydra's ConfigStore, and the typed `Config` read from what
Hydra composed (`to_config`). The checks Hydra cannot express are trainer/checks.py's.

Hydra already rejects an unknown group option (`strategy=zero4`), an unknown key and an enum
value out of range (`train.precision=fp8`), naming the key and the allowed values.
"""
from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trainer.errors import ConfigError


class StrategyName(str, Enum):
    auto = "auto"  # the planner picks (trainer/plan/)
    ddp = "ddp"
    fsdp = "fsdp"
    zero1 = "zero1"
    zero2 = "zero2"
    zero3 = "zero3"


class Sharding(str, Enum):
    FULL_SHARD = "FULL_SHARD"
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    HYBRID_SHARD = "HYBRID_SHARD"
    NO_SHARD = "NO_SHARD"


class Precision(str, Enum):
    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"


class DataName(str, Enum):
    text = "text"  # byte-level text (vocabulary 256)
    synthetic = "synthetic"
    tokens = "tokens"  # a flat file of token ids (nanoGPT / Megatron .bin)
    hf = "hf"  # text read with `datasets`, tokenised with a Hugging Face tokenizer
    chat = "chat"  # conversations read with `datasets`, rendered with a chat template
    mixture = "mixture"  # several sources of the kinds above, drawn by weight (data.sources)
    preference = "preference"  # {prompt, chosen, rejected} rows for objective=dpo, rendered like data=chat


class TrainOn(str, Enum):
    """data=chat: which tokens are targets (the others are context only)."""
    assistant = "assistant"  # each assistant message's content and its end-of-turn token
    all = "all"  # every token of the rendered conversation
    completion = "completion"  # prompt/completion rows: the completion's messages (or text + EOS)


class BadRows(str, Enum):
    """data=chat: a row that cannot be read (found while tokenising, past the rows checked before work)."""
    error = "error"  # stop, naming the file and the row
    skip = "skip"  # leave it out; the start line counts them


class SourceKind(str, Enum):
    """data=mixture: what one source is (the keys of data=<kind> that it takes, trainer/data/mixture.py)."""
    text = "text"
    tokens = "tokens"
    hf = "hf"
    chat = "chat"


class Exhausted(str, Enum):
    """data=mixture: a source whose share of an epoch is more than its documents, or (HF
    interleave_datasets' stopping strategies) an epoch sized by when the sources run out."""
    repeat = "repeat"  # goes through its documents again, in a fresh order
    stop = "stop"  # gives each once: its share ends there
    first_exhausted = "first_exhausted"  # the epoch ends as the first source has given all its documents
    all_exhausted = "all_exhausted"  # the epoch ends as every source has given each of its documents; the others go round again


class WeightsBy(str, Enum):
    """data=mixture: what a source's weight is a share of."""
    documents = "documents"  # of the documents drawn (HF interleave_datasets' probabilities)
    tokens = "tokens"  # of the tokens drawn (Megatron's and MosaicML's blends): a source of longer documents draws fewer


class LongDocuments(str, Enum):
    """data=mixture: an hf or chat source's document longer than model.seq_len + 1 tokens."""
    split = "split"  # hf only: cut into windows of seq_len + 1 tokens (as data=hf's packing keeps every token)
    truncate = "truncate"  # its first seq_len + 1 tokens
    drop = "drop"  # left out


class TokenDtype(str, Enum):
    uint16 = "uint16"
    uint32 = "uint32"


class Device(str, Enum):
    auto = "auto"  # cuda where torch sees a GPU, else cpu
    cpu = "cpu"
    cuda = "cuda"


class GradReduce(str, Enum):
    step = "step"  # once per optimizer step: full gradients held across the micro-steps
    micro_step = "micro_step"  # every micro-step: gradients stay sharded (fsdp, zero2, zero3)


class ReduceDtype(str, Enum):
    fp32 = "fp32"  # gradients reduced (and, on ZeRO-2/3, kept) in fp32 whatever the compute dtype
    bf16 = "bf16"  # reduced in bf16, half the bytes on the wire (train.precision=bf16 only)
    fp16 = "fp16"  # reduced in fp16 (train.precision=fp16 only): DeepSpeed's own default, the ZeRO paper's K=12


class ObjectiveName(str, Enum):
    lm = "lm"  # next-token loss over the target tokens
    dpo = "dpo"  # direct preference optimisation on data=preference pairs, against a frozen reference


class DpoLoss(str, Enum):
    """objective=dpo: the loss of a pair, as TRL 1.16's DPOTrainer defines it."""
    sigmoid = "sigmoid"  # -log sigmoid(beta x the log-ratio margin)
    ipo = "ipo"  # (the per-token log-ratio margin - 1 / (2 beta))^2


class PeftName(str, Enum):
    none = "none"  # every parameter trains
    lora = "lora"  # LoRA adapters (the `peft` library) train; the model's own weights are frozen


class Schedule(str, Enum):
    cosine = "cosine"  # cosine decay from lr to lr * min_lr_ratio over the schedule
    linear = "linear"  # linear decay to lr * min_lr_ratio
    constant = "constant"  # lr after warmup, throughout
    wsd = "wsd"  # warmup-stable-decay: lr, then a linear decay over the last decay_fraction of the schedule


class OnOom(str, Enum):
    adapt = "adapt"  # a rank out of memory records it and leaves; the restart adapts the plan and resumes
    fail = "fail"  # a rank out of memory stops the run with one line: the step, the bytes, what to change


class LogLevel(str, Enum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


class ModelKind(str, Enum):
    reference = "reference"  # trainer/models/builtin.py: tiny, small, gpt_125m, ...
    hf = "hf"  # a local Hugging Face causal-LM folder
    custom = "custom"  # any nn.Module from a `_target_` factory


@dataclass
class StrategyConfig:
    name: StrategyName = StrategyName.ddp
    offload_optimizer: bool = False  # optimizer state (and DeepSpeed's fp32 masters) in CPU memory, updated there
    offload_params: bool = False  # parameters in CPU memory between uses (fsdp, zero3)
    sharding: Sharding = Sharding.FULL_SHARD  # fsdp only
    wrap: Optional[List[str]] = None  # block classes to shard; None: the model's _no_split_modules
    deepspeed_config: Optional[str] = None  # a ds_config.json merged under ours (zero1/2/3)
    grad_reduce: GradReduce = GradReduce.step  # with grad_accum_steps > 1: when gradients are reduced
    reduce_dtype: ReduceDtype = ReduceDtype.fp32  # the dtype gradients are reduced in, on every backend
    sp: int = 1  # sequence parallelism: ranks that split each sequence (Ulysses attention); the world is dp x sp
    ep: int = 1  # expert parallelism: ranks that split each MoE layer's experts, tokens sent to them (fsdp, zero1/2/3)
    tp: int = 1  # tensor parallelism: ranks that split each layer's weights and read the same rows (fsdp, zero1/2/3); the world is dp x tp
    # strategy.tp on fsdp: the norms (and what runs between the split layers) on each rank's 1/tp of the sequence
    # (Megatron's sequence parallelism, not strategy.sp); null: where the model's plan declares it, true: refused
    # where it does not, false: off
    tp_sequence_parallel: Optional[bool] = None


@dataclass
class ModelConfig:
    """One schema for every kind of model; the `model` node of the Hydra config is open (custom
    models take their factory's arguments as keys) and is checked by `model_config`."""
    name: str = "tiny"  # the preset's name (conf/model/), shown on the start line
    kind: ModelKind = ModelKind.reference
    vocab_size: Optional[int] = 256  # hf and custom: from the model
    seq_len: Optional[int] = 64  # the training context; hf: min(max_position_embeddings, 2048) when null
    # hf
    path: Optional[str] = None  # hf: the model folder (config.json, optional *.safetensors and tokenizer), or a Hub name
    revision: Optional[str] = None  # hf: a Hub name's branch, tag or commit; None: main
    attn_implementation: str = "auto"  # hf: auto (sdpa, else what transformers picks) | sdpa | eager | flex_attention | flash_attention_2
    # hf mixture-of-experts: the router's load-balancing loss on/off; null: as config.json's output_router_logits
    router_aux_loss: Optional[bool] = None
    # custom: `_target_` in the config, and every other key is an argument of the factory
    target: Optional[str] = None  # custom: the factory that builds the model, pkg.module.function
    args: Dict[str, Any] = field(default_factory=dict)
    # reference
    d_model: int = 64  # reference: the width
    n_layers: int = 2  # reference: transformer blocks
    n_heads: int = 4  # reference: attention heads (divides d_model)
    d_ff: int = 256  # reference: the MLP's inner width
    mlp: str = "gelu"  # reference: gelu | swiglu
    norm: str = "layernorm"  # reference: layernorm | rmsnorm
    bias: bool = True  # reference: biases in linear layers and norms
    shape_only: bool = False  # built on the meta device, for planning only (python -m trainer.plan); never trained


@dataclass
class PeftConfig:
    name: PeftName = PeftName.none
    r: int = 16  # the adapters' rank
    alpha: float = 32.0  # scaling alpha / r
    dropout: Optional[float] = None  # dropout on the adapters' input, in [0, 1); null: 0, or peft.init's own
    target_modules: Any = "all-linear"  # or a list of module names (a name matches itself and names ending in .name)
    init: Optional[str] = None  # an existing PEFT adapter folder to continue training (its r, alpha, targets)


@dataclass
class ObjectiveConfig:
    name: ObjectiveName = ObjectiveName.lm
    beta: float = 0.1  # dpo: how far the policy may move from the reference
    loss: DpoLoss = DpoLoss.sigmoid
    precompute_ref: bool = False  # dpo: the reference's log-probs of every pair in one pass before training
    disable_dropout: bool = True  # dpo: no dropout in the policy (TRL's DPOConfig default); false keeps the model's


@dataclass
class SourceConfig:
    """One source of data=mixture. Keys of another kind than its own stay null (checked by
    trainer/data/mixture_checks.py); a null key of its kind reads as data=<kind>'s default
    (trainer/data/read.py, which reads every kind's source the one way)."""
    kind: Optional[SourceKind] = None  # required
    path: Optional[str] = None  # as data.path of data=<kind> (text: null reads the bundled corpus)
    name: Optional[str] = None  # in metrics.jsonl; null: the file's stem
    weight: float = 1.0  # relative: the fraction of each epoch's documents is weight / the sum of the weights; 0: off
    val_path: Optional[str] = None  # this source's held-out data (data.val_fraction holds out a part of each source instead)
    max_samples: Optional[int] = None  # only its first N documents (LLaMA-Factory's max_samples, per source); null: all
    # each epoch draws repeat x its documents (MosaicML's Stream repeat: 0.5 half, 2 twice), in place of
    # weights: all sources give it or none; null: weights
    repeat: Optional[float] = None
    text_field: Optional[str] = None  # hf (default: text)
    dtype: Optional[TokenDtype] = None  # tokens (default: uint16)
    tokenizer: Optional[str] = None  # hf, chat: must be the run's one tokenizer (default: data.tokenizer)
    train_on: Optional[TrainOn] = None  # chat (default: assistant)
    chat_template: Optional[str] = None  # chat
    # hf, chat: a document longer than seq_len + 1 tokens (default: data.drop_long=true drops it, else
    # an hf document is split into windows, a conversation truncated)
    long_documents: Optional[LongDocuments] = None


@dataclass
class DataConfig:
    name: DataName = DataName.text
    path: Optional[str] = None  # text: a file (None: the bundled corpus); tokens: a .bin; hf, chat, preference: a file, folder or Hub name
    revision: Optional[str] = None  # hf, chat, preference: a Hub dataset name's branch, tag or commit; None: main
    num_samples: int = 2048  # synthetic only
    dtype: TokenDtype = TokenDtype.uint16  # tokens only
    text_field: str = "text"  # hf only
    tokenizer: Optional[str] = None  # hf, chat: a tokenizer folder; None: model.path
    # hf: documents joined with EOS into seq_len windows; chat: whole conversations joined into rows
    # of seq_len, attention kept within each; preference: whole pairs joined into rows of 2 x seq_len.
    # false: one padded row per document (hf, chat), one pair per row (preference)
    packing: bool = True
    chat_template: Optional[str] = None  # chat, preference: a Jinja file; None: the tokenizer's own template
    train_on: TrainOn = TrainOn.assistant  # chat: the tokens that are targets
    # chat, preference, or hf unpacked: drop documents (pairs) longer than seq_len + 1 tokens (else truncated)
    drop_long: bool = False
    # chat, preference: a row that cannot be read stops the run, or is skipped and counted
    bad_rows: BadRows = BadRows.error
    val_path: Optional[str] = None  # held-out data of the same kind as `path`
    val_fraction: float = 0.0  # or: hold out this fraction of `path`
    num_workers: int = 1  # background loader processes per rank (0: load in the training process)
    cache_dir: Optional[str] = None  # tokenised data (hf); None: $XDG_CACHE_HOME/trainer or ~/.cache/trainer
    sources: List[SourceConfig] = field(default_factory=list)  # mixture: the sources and their weights
    epoch_samples: int = 0  # mixture: documents drawn per epoch; 0: the sum of the sources' documents
    exhausted: Exhausted = Exhausted.repeat  # mixture: a source with fewer documents than its share, or the epoch sized by when the sources run out (HF stopping strategies)
    weights_by: WeightsBy = WeightsBy.documents  # mixture: a weight's share of the documents drawn, or of the tokens


@dataclass
class EvalConfig:
    every_steps: int = 0  # 0: only after the last step (when there is validation data)
    max_batches: int = 0  # micro-batches per rank and evaluation; 0: the whole validation set
    early_stop_patience: int = 0  # stop after this many evaluations in a row without a lower val loss; 0: never
    micro_batch_size: Optional[int] = None  # rows per rank and evaluation forward; None: train.micro_batch_size


@dataclass
class OptimConfig:
    lr: float = 3e-3  # the peak learning rate, reached after warmup
    weight_decay: float = 0.1  # AdamW's decoupled decay, on tensors of 2 or more dims (not biases, norms)
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])  # Adam's (beta1, beta2)
    eps: float = 1e-8  # Adam's epsilon
    warmup_steps: int = 10  # linear warmup from 0 to lr over this many steps
    min_lr_ratio: float = 0.1  # the schedule decays to lr * min_lr_ratio at its last step
    schedule: Schedule = Schedule.cosine
    schedule_steps: int = 0  # the schedule's length; 0: the run's steps (a resume that trains longer re-plans it)
    decay_fraction: float = 0.1  # wsd: the last fraction of the schedule that decays


@dataclass
class TrainConfig:
    max_steps: int = 60  # 0: run `epochs` full epochs
    epochs: int = 1  # full passes over the data, when max_steps=0
    micro_batch_size: int = 8  # rows per rank and micro-step
    grad_accum_steps: int = 1  # micro-steps per optimizer step (global batch: micro_batch_size x this x ranks)
    grad_clip: float = 1.0  # 0: no clipping (the norm is still reported)
    seed: int = 1234  # weights' initialisation, data order, dropout
    precision: Precision = Precision.fp32  # the compute dtype; the weights the optimizer updates stay fp32
    activation_checkpointing: bool = False  # recompute each block's activations in backward instead of keeping them
    log_every: int = 10  # a step record (metrics.jsonl, the loggers, the bar) every N steps
    device: Device = Device.auto
    compile: bool = False  # torch.compile each block (regional), before sharding
    fused_loss: bool = False  # the output layer and cross-entropy in chunks: no [tokens, vocab] logits are held
    peak_flops: Optional[float] = None  # per device, for mfu; None: known GPUs' bf16/fp16 peak, else (fp32) no mfu
    profile: Optional[str] = None  # "START:STOP": a torch profiler trace of those steps, in the run dir
    max_bad_steps: int = 10  # steps in a row with a non-finite loss or gradient norm (each skipped) that stop the run
    on_oom: OnOom = OnOom.adapt  # a rank out of memory: adapt the plan on the restart (micro-batch, AC, fused loss, strategy) or fail
    max_adaptations: int = 4  # on_oom=adapt: changes of the plan after out-of-memory, each a restart of its own, apart from max_restarts


def keyword_field(namespace: dict, name: str, hint: str, default) -> None:
    """A field named by a Python keyword (`checkpoint.async`), declared in a class body, where
    `async: bool = False` cannot be written: read with getattr. Left out of __init__, repr and ==,
    whose generated code would spell the name; OmegaConf sets it after building the object."""
    namespace["__annotations__"][name] = hint
    namespace[name] = field(default=default, init=False, repr=False, compare=False)


@dataclass
class CheckpointConfig:
    dir: Optional[str] = None  # where step dirs go (multi-node: on storage every node sees); None: no saves
    every_steps: int = 0  # save every N steps; 0: the last step only (always saved when dir is set)
    keep_last: int = 2  # step dirs kept, newest first; 0: keep all
    keep_best: int = 0  # also keep the N checkpoints with the lowest val loss (saved at evaluation steps)
    resume: str = "auto"  # auto | none | PATH
    max_failed_saves: int = 3  # failed saves in a row that stop the run (fewer: reported, training goes on)
    keyword_field(locals(), "async", "bool", False)  # copy the state to host memory at the save step and write, hash and publish it on a thread while training goes on (one save in flight)

    @property
    def async_(self) -> bool:
        """checkpoint.async (`cfg.checkpoint.async` is not Python)."""
        return getattr(self, "async")


@dataclass
class JsonlConfig:
    """metrics.jsonl in the run dir: written whatever `logger=` lists (it is the run's record)."""


@dataclass
class TensorBoardConfig:
    dir: Optional[str] = None  # None: <run dir>/tensorboard


@dataclass
class WandbConfig:
    project: str = "trainer"  # the W&B project
    entity: Optional[str] = None  # the W&B team or user; None: your default
    name: Optional[str] = None  # the run's name; None: the run dir's name
    mode: Optional[str] = None  # online | offline; None: offline unless WANDB_API_KEY or ~/.netrc is set


@dataclass
class MLflowConfig:
    tracking_uri: Optional[str] = None  # None: a SQLite store, <run dir>/mlflow.db
    experiment: str = "trainer"  # the MLflow experiment
    run_name: Optional[str] = None  # None: the run dir's name


@dataclass
class LoggerConfig:
    """The loggers chosen (`logger=tensorboard`, `logger=[jsonl,wandb]`): a node each; None: off
    (jsonl's metrics.jsonl is written either way)."""
    jsonl: Optional[JsonlConfig] = None
    tensorboard: Optional[TensorBoardConfig] = None
    wandb: Optional[WandbConfig] = None
    mlflow: Optional[MLflowConfig] = None


@dataclass
class PlanConfig:
    world_size: Optional[int] = None  # None: the run's (nproc, or the launcher's WORLD_SIZE)
    gpu_memory_gb: Optional[float] = None  # the budget per device; None: the local GPU's memory, else 80
    master_weights: bool = True  # False: pure bf16 training, no fp32 copy of the weights
    json: bool = False  # print the plan as JSON instead of a table
    run_dir: Optional[str] = None  # a run that ran out of memory: what failed, and the plan at the one it adapted to
    # Step-time estimate: compute at this rate per device, communication over these links.
    flops_per_s: float = 4e14  # achieved, per device (H100 bf16 at ~40 % MFU)
    link_gbps: float = 400.0  # per device, between ranks: NVLink ~7200, InfiniBand 400, 10 GbE 10
    pcie_gbps: float = 256.0  # host <-> device, for offload (PCIe 4 x16)


@dataclass
class Config:
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    # Open in the Hydra schema (a custom model's arguments are its keys); a ModelConfig after `to_config`.
    model: Any = field(default_factory=dict)
    peft: PeftConfig = field(default_factory=PeftConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    nproc: int = 1  # local ranks to spawn when no launcher started this process
    max_restarts: int = 0  # restarts of all ranks after one dies or fails (not out of memory: train.max_adaptations), each resuming from the newest checkpoint
    shutdown_timeout_s: int = 120  # nproc > 1: after a stop signal, how long ranks may take to save before SIGKILL
    collective_timeout_s: int = 600  # a rank waiting this long in a collective (a dead or hung peer) ends the job
    log_level: LogLevel = LogLevel.warning  # third-party libraries' console output (DeepSpeed, torch, HF)


CONFIG_MODULE = "trainer.conf"  # conf/ of the repo, installed with the package (trainer, trainer.plan)


def rows_carry_positions(cfg: Config) -> bool:
    """Whether the data gives the model rows of packed documents with their position ids: chat and
    mixture packed, preference always (a pair's two sequences share a row)."""
    name = DataName(cfg.data.name)
    return name is DataName.preference or (name in (DataName.chat, DataName.mixture) and cfg.data.packing)


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="trainer_schema", node=Config)


def profile_steps(spec: str) -> tuple[int, int] | None:
    """train.profile=START:STOP as (START, STOP), or None when malformed."""
    parts = str(spec).split(":")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        return None
    start, stop = int(parts[0]), int(parts[1])
    return (start, stop) if 1 <= start <= stop else None


# Keys of the `model` node that belong to the trainer for each kind; a custom model's other keys
# are its factory's arguments.
MODEL_KEYS = {
    ModelKind.reference: ("name", "kind", "vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "d_ff", "mlp",
                          "norm", "bias", "shape_only"),
    ModelKind.hf: ("name", "kind", "vocab_size", "seq_len", "path", "revision", "attn_implementation",
                   "router_aux_loss"),
    ModelKind.custom: ("name", "kind", "vocab_size", "seq_len", "_target_"),
}


def model_config(node: dict | ModelConfig) -> ModelConfig:
    """The typed model settings from the open `model` node; wrong keys and values name the key."""
    if isinstance(node, ModelConfig):
        return node
    node = dict(node)
    try:
        kind = ModelKind(node.get("kind", ModelKind.reference.value))
    except ValueError:
        raise ConfigError(f"model.kind: allowed values: {', '.join(k.value for k in ModelKind)}; "
                          f"got {node.get('kind')!r}") from None
    allowed = MODEL_KEYS[kind]
    if kind is ModelKind.custom:
        args = {k: node.pop(k) for k in list(node) if k not in allowed}
        node.update(target=node.pop("_target_", None), args=args)
        if not node["target"] or node["target"] == "???":
            raise ConfigError("model._target_: model=custom needs the factory that builds the model, e.g. "
                              "model._target_=my_pkg.models.build")
    else:
        unknown = [k for k in node if k not in allowed]
        if unknown:
            raise ConfigError(f"model.{unknown[0]}: not a setting of a {kind.value} model; settings: "
                              f"{', '.join(allowed)}")
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), node))
    except OmegaConfBaseException as e:
        raise ConfigError(f"model.{e.key}: {e.msg.splitlines()[0]}") from None  # OmegaConf adds lines


def model_node(m: ModelConfig) -> dict:
    """The `model` node that `model_config` reads back as `m` (a checkpoint records it)."""
    kind = ModelKind(m.kind)
    node = {k: getattr(m, k) for k in MODEL_KEYS[kind] if k != "_target_"}
    node["kind"] = kind.value
    if kind is ModelKind.custom:
        node.update({"_target_": m.target, **m.args})
    return node


def to_config(cfg: DictConfig | dict) -> Config:
    """A typed Config (enums as enums) from Hydra's DictConfig or a plain dict sent to a worker."""
    raw = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    model = raw.pop("model", None) or {}
    try:
        config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), raw))
    except OmegaConfBaseException as e:  # e.g. a key added with + that the schema does not have
        raise ConfigError(unknown_key_message(e.full_key) if "not in" in e.msg else f"{e.full_key}: {e.msg}") from None
    config.model = model_config(model)
    return config


def _keys(cls: type, prefix: str = "") -> list[str]:
    """The dotted keys of a dataclass schema, into nested (and optional) dataclasses."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in fields(cls):
        nested = [t for t in (hints[f.name], *typing.get_args(hints[f.name])) if dataclasses.is_dataclass(t)
                  and typing.get_origin(hints[f.name]) is not list]  # a list (data.sources) is set whole
        out += _keys(nested[0], f"{prefix}{f.name}.") if nested else [f"{prefix}{f.name}"]
    return out


def known_keys() -> list[str]:
    """Every key of the schema; a model's keys of every kind."""
    model_keys = sorted({f"model.{k}" for kind_keys in MODEL_KEYS.values() for k in kind_keys})
    return [k for k in _keys(Config) if k != "model"] + model_keys


def unknown_key_message(key: str) -> str:
    close = difflib.get_close_matches(key, known_keys(), n=1, cutoff=0.6)
    return f"{key}: no such setting" + (f"; did you mean {close[0]}?" if close else "")
