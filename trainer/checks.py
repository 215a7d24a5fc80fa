"""The checks before any work: settings that Hydra's schema cannot reject alone (`validate`, the
cross-field rules) and overrides mistyped on the command line (`check_overrides`, before Hydra).
Each raises ConfigError naming the key.
"""
from __future__ import annotations

import dataclasses
import typing
from enum import Enum
from importlib import resources
from pathlib import Path
from typing import Any

from trainer.config import (
    BadRows,
    Config,
    DataName,
    ModelKind,
    ObjectiveName,
    PeftConfig,
    PeftName,
    Precision,
    ReduceDtype,
    Sharding,
    StrategyName,
    TrainOn,
    known_keys,
    profile_steps,
    unknown_key_message,
)
from trainer.data import check_data
from trainer.data.mixture_checks import EXAMPLE, check_mixture, check_source_nodes
from trainer.errors import ConfigError
from trainer.extras import require_hf, require_hydra_plugin
from trainer.layout import Degrees
from trainer.losses.router_loss import check_router_loss
from trainer.models import initial_weights, meta_model
from trainer.models.blocks import find_blocks
from trainer.models.checks import check_model_sequence_parallel, check_output_layer
from trainer.models.experts import check_expert_parallel
from trainer.models.lora import read_adapter_folder
from trainer.models.tensor_plan import check_model_tensor_parallel, uses_sequence_parallel
from trainer.strategies import preflight


def check_settings(cfg: Config, world_size: int) -> tuple[Any, Any]:
    """The settings' checks before work: a user's command (`check_before_work`), and a plan adapted
    after an out-of-memory (training/adapt.py), the same. Returns the model built on the meta
    device and its first weights' source."""
    validate(cfg)
    preflight(cfg, world_size)
    model = meta_model(cfg.model, cfg.peft)  # LoRA's targets must exist
    find_blocks(model, cfg.strategy.wrap)
    check_sequence_parallel(cfg, world_size, model)
    check_expert_parallel(cfg.strategy.ep, world_size, model, StrategyName(cfg.strategy.name).value)
    check_tensor_parallel(cfg, world_size, model)
    check_router_loss(cfg.model.router_aux_loss, model)
    if cfg.train.fused_loss:
        check_output_layer(cfg.model, model)
    # a sequence group, and a tensor group, reads the same samples
    data_parallel = Degrees(world_size, cfg.strategy.sp, cfg.strategy.ep, cfg.strategy.tp).dp
    weights = initial_weights(cfg.model, model, cfg.train.seed, cfg.peft)  # pretrained files must fit the model
    check_data(cfg, data_parallel)
    return model, weights


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


def validate(cfg: Config) -> None:
    s, t, m, d = cfg.strategy, cfg.train, cfg.model, cfg.data
    name = StrategyName(s.name)
    _require(t.micro_batch_size >= 1, "train.micro_batch_size", f"must be >= 1, got {t.micro_batch_size}")
    _require(t.grad_accum_steps >= 1, "train.grad_accum_steps", f"must be >= 1, got {t.grad_accum_steps}")
    _require(t.max_steps >= 0, "train.max_steps", f"must be >= 0, got {t.max_steps}")
    _require(t.max_steps > 0 or t.epochs >= 1, "train.epochs", "must be >= 1 when train.max_steps=0")
    _require(t.grad_clip >= 0, "train.grad_clip", f"must be >= 0, got {t.grad_clip}")
    _require(t.log_every >= 1, "train.log_every", f"must be >= 1, got {t.log_every}")
    _require(t.profile is None or profile_steps(t.profile) is not None, "train.profile",
             f"START:STOP, the first and last step to trace (1 <= START <= STOP), got {t.profile!r}")
    _require(t.peak_flops is None or t.peak_flops > 0, "train.peak_flops", f"must be > 0, got {t.peak_flops}")
    _require(t.max_bad_steps >= 1, "train.max_bad_steps", f"must be >= 1, got {t.max_bad_steps}")
    _require(t.max_adaptations >= 0, "train.max_adaptations", f"must be >= 0 (0: never adapt), got {t.max_adaptations}")
    _require(ReduceDtype(s.reduce_dtype).value in ("fp32", Precision(t.precision).value), "strategy.reduce_dtype",
             f"fp32, or the training dtype (train.precision={Precision(t.precision).value}); got "
             f"{ReduceDtype(s.reduce_dtype).value}")
    _require(cfg.nproc >= 1, "nproc", f"must be >= 1, got {cfg.nproc}")
    _require(cfg.max_restarts >= 0, "max_restarts", f"must be >= 0, got {cfg.max_restarts}")
    _require(cfg.shutdown_timeout_s >= 0, "shutdown_timeout_s", f"must be >= 0, got {cfg.shutdown_timeout_s}")
    _require(cfg.collective_timeout_s > 0, "collective_timeout_s", f"must be > 0, got {cfg.collective_timeout_s}")
    o, c = cfg.optim, cfg.checkpoint
    _require(o.lr >= 0, "optim.lr", f"must be >= 0, got {o.lr}")
    _require(o.warmup_steps >= 0, "optim.warmup_steps", f"must be >= 0, got {o.warmup_steps}")
    _require(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", f"must be in [0, 1], got {o.min_lr_ratio}")
    _require(o.weight_decay >= 0, "optim.weight_decay", f"must be >= 0, got {o.weight_decay}")
    _require(len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas), "optim.betas",
             f"two values in [0, 1), got {list(o.betas)}")
    _require(o.eps > 0, "optim.eps", f"must be > 0, got {o.eps}")
    _require(o.schedule_steps >= 0, "optim.schedule_steps", f"must be >= 0 (0: the run's steps), got {o.schedule_steps}")
    _require(0 < o.decay_fraction <= 1, "optim.decay_fraction", f"must be in (0, 1], got {o.decay_fraction}")
    _require(c.every_steps >= 0, "checkpoint.every_steps", f"must be >= 0 (0: the last step only), got {c.every_steps}")
    _require(c.keep_last >= 0, "checkpoint.keep_last", f"must be >= 0 (0: keep all), got {c.keep_last}")
    _require(c.max_failed_saves >= 1, "checkpoint.max_failed_saves", f"must be >= 1, got {c.max_failed_saves}")
    if m.kind is ModelKind.reference:
        for key in ("d_model", "n_layers", "n_heads", "d_ff"):
            _require(getattr(m, key) >= 1, f"model.{key}", f"must be >= 1, got {getattr(m, key)}")
        _require(m.d_model % m.n_heads == 0, "model.n_heads", f"must divide model.d_model={m.d_model}")
        _require(m.mlp in ("gelu", "swiglu"), "model.mlp", f"allowed values: gelu, swiglu; got {m.mlp!r}")
        _require(m.norm in ("layernorm", "rmsnorm"), "model.norm",
                 f"allowed values: layernorm, rmsnorm; got {m.norm!r}")
        _require(not m.shape_only, "model", f"model={m.name} is shape-only (for `python -m trainer.plan`); "
                 "train one of tiny, small, gpt_125m, gpt_1b")
    if PeftName(cfg.peft.name) is PeftName.lora:
        check_lora(cfg.peft)
    _require(m.seq_len is None or m.seq_len >= 1, "model.seq_len", f"must be >= 1, got {m.seq_len}")
    _require(0 <= d.val_fraction < 1, "data.val_fraction", f"must be in [0, 1), got {d.val_fraction}")
    _require(not (d.val_fraction and d.val_path), "data.val_fraction",
             "give data.val_path or data.val_fraction, not both")
    data_name = DataName(d.name)
    _require(d.packing or data_name in (DataName.hf, DataName.chat, DataName.preference, DataName.mixture),
             "data.packing",
             f"data={data_name.value} has no documents to keep apart; packing=false needs data=hf, chat or preference")
    _require(not d.drop_long or data_name in (DataName.chat, DataName.preference, DataName.mixture)
             or (data_name is DataName.hf and not d.packing),
             "data.drop_long", "only rows of whole documents drop long ones: data=chat, data=preference, or data=hf with "
             "data.packing=false")
    for key, is_set, readers in (("chat_template", d.chat_template is not None, (DataName.chat, DataName.preference)),
                                 ("train_on", TrainOn(d.train_on) is not TrainOn.assistant, (DataName.chat,)),
                                 ("bad_rows", BadRows(d.bad_rows) is not BadRows.error,
                                  (DataName.chat, DataName.preference, DataName.mixture))):
        _require(not is_set or data_name in readers, f"data.{key}",
                 f"only read by data={' and data='.join(r.value for r in readers)}, not data={data_name.value}")
    check_objective(cfg)
    check_mixture(cfg)
    _require(d.num_workers >= 0, "data.num_workers", f"must be >= 0, got {d.num_workers}")
    _require(cfg.eval.every_steps >= 0, "eval.every_steps", f"must be >= 0, got {cfg.eval.every_steps}")
    _require(cfg.eval.max_batches >= 0, "eval.max_batches", f"must be >= 0, got {cfg.eval.max_batches}")
    _require(cfg.eval.micro_batch_size is None or cfg.eval.micro_batch_size >= 1, "eval.micro_batch_size",
             f"must be >= 1 (or null: train.micro_batch_size), got {cfg.eval.micro_batch_size}")
    _require(cfg.eval.early_stop_patience >= 0, "eval.early_stop_patience",
             f"must be >= 0 (0: never stop early), got {cfg.eval.early_stop_patience}")
    _require(c.keep_best >= 0, "checkpoint.keep_best", f"must be >= 0, got {c.keep_best}")
    for key, is_set in (("eval.early_stop_patience", cfg.eval.early_stop_patience), ("checkpoint.keep_best", c.keep_best)):
        _require(not is_set or bool(d.val_path or d.val_fraction or any(s.val_path for s in d.sources)), key,
                 "compares validation losses, and there is no validation data: set data.val_fraction or data.val_path")
    _require(not (s.offload_params and name not in (StrategyName.fsdp, StrategyName.zero3)),
             "strategy.offload_params", f"only fsdp and zero3 shard parameters; strategy={name.value} "
             "cannot offload them (use strategy=zero3 or strategy=fsdp)")
    _require(not (s.offload_optimizer and name is StrategyName.ddp), "strategy.offload_optimizer",
             "ddp keeps the optimizer on the device; use zero1, zero2, zero3 or fsdp to offload it")
    _require(s.deepspeed_config is None or name.value.startswith("zero"), "strategy.deepspeed_config",
             f"only read by zero1/zero2/zero3, not strategy={name.value}")
    _require(Sharding(s.sharding) is Sharding.FULL_SHARD or name is StrategyName.fsdp,
             "strategy.sharding", f"only read by strategy=fsdp, not strategy={name.value}")


def check_objective(cfg: Config) -> None:
    """objective=dpo trains on preference pairs against a reference it can have (docs/design.md, Objectives)."""
    o, data_name = cfg.objective, DataName(cfg.data.name)
    dpo = ObjectiveName(o.name) is ObjectiveName.dpo
    _require(not dpo or data_name is DataName.preference, "objective",
             f"objective=dpo trains on preference pairs, not data={data_name.value}: use data=preference "
             "data.path=PAIRS.jsonl (rows {prompt, chosen, rejected})")
    _require(dpo or data_name is not DataName.preference, "data",
             "data=preference holds pairs for objective=dpo, not for objective=lm; add objective=dpo")
    if not dpo:
        return
    _require(o.beta > 0, "objective.beta", f"must be > 0, got {o.beta}")
    p = cfg.peft
    # a folder that is not there yet (a docs example's earlier step writes it) is refused where it is read (models/lora.py)
    if PeftName(p.name) is PeftName.lora and p.init and not o.precompute_ref and Path(p.init).is_dir():
        # models.lora.StartingAdapters adds the starting adapter to a layer's output, as for a linear
        # layer; peft adds an expert adapter to the stacked weight instead
        experts = read_adapter_folder(Path(p.init)).get("target_parameters")
        _require(not experts, "objective.precompute_ref",
                 f"false: the reference of peft.init={p.init} adds its adapters to linear layers only, and it adapts "
                 f"stacked expert parameters ({', '.join(experts or [])}); set objective.precompute_ref=true "
                 "(the reference's log-probabilities computed once, by the model as it starts)")


def check_sequence_parallel(cfg: Config, world_size: int, model: Any) -> None:
    """strategy.sp=N (docs/long-context.md): the world, the rows and the model split as Ulysses
    attention needs; `model` the run's, built on the meta device."""
    sp, m = cfg.strategy.sp, cfg.model
    _require(sp >= 1, "strategy.sp", f"must be >= 1, got {sp}")
    if sp == 1:
        return
    _require(world_size % sp == 0, "strategy.sp", f"the world size {world_size} must be a multiple of "
             f"strategy.sp={sp}: the world is data-parallel x sequence-parallel ranks")
    _require(m.seq_len % sp == 0, "strategy.sp", f"model.seq_len={m.seq_len} must divide by strategy.sp={sp}: each "
             "rank holds seq_len / sp tokens of every row (rows are not padded to a multiple)")
    check_model_sequence_parallel(m, sp, model)


def check_tensor_parallel(cfg: Config, world_size: int, model: Any) -> None:
    """strategy.tp=N (docs/strategies.md, Tensor parallelism): the world splits into tensor groups, the
    backend splits weights (fsdp, zero1/2/3), no setting it does not yet cross with is on, and the model
    splits (its plan, its heads); `model` the run's, built on the meta device. Each refusal one line."""
    s, t, tp = cfg.strategy, cfg.train, cfg.strategy.tp
    _require(tp >= 1, "strategy.tp", f"must be >= 1 (1: every rank holds every weight whole), got {tp}")
    _require(not s.tp_sequence_parallel or uses_sequence_parallel(s, model), "strategy.tp_sequence_parallel",
             f"true needs strategy=fsdp, strategy.tp > 1 (got {StrategyName(s.name).value}, tp={tp}), no peft=lora and a "
             "model whose plan declares it (`_tp_sequence_plan`: the built-in transformer's, a Hugging Face family's "
             "of Llama's layout); use null (where the plan declares it) or false")
    if tp == 1:
        return
    _require(world_size % tp == 0, "strategy.tp", f"the world size {world_size} must be a multiple of strategy.tp={tp}: "
             "the world is data-parallel x tensor-parallel ranks")
    strategy = StrategyName(s.name).value
    not_yet = [
        (strategy == "ddp", "needs strategy=fsdp, zero1, zero2 or zero3 (each weight split over the tensor group, "
                            "sharded over the data-parallel ranks); ddp holds every weight whole on every rank"),
        (s.sp > 1, f"with strategy.sp={s.sp}: sequence and tensor parallelism do not cross yet; use one of them"),
        (s.ep > 1, f"with strategy.ep={s.ep}: expert and tensor parallelism do not cross yet; use one of them"),
        (strategy == "fsdp" and Sharding(s.sharding) in (Sharding.HYBRID_SHARD, Sharding.NO_SHARD),
         f"with strategy.sharding={Sharding(s.sharding).value}: strategy=fsdp splits weights over a tensor group with "
         "FULL_SHARD or SHARD_GRAD_OP only"),
        (strategy == "fsdp" and (s.offload_params or s.offload_optimizer),
         "with offload: strategy=fsdp does not offload tensor-parallel weights yet; set "
         "strategy.offload_params/offload_optimizer=false (zero1/2/3 do)"),
        (strategy != "fsdp" and PeftName(cfg.peft.name) is PeftName.lora,
         f"with peft=lora: strategy={strategy} does not split LoRA's adapters over a tensor group yet; use "
         "strategy=fsdp (or strategy.tp=1)"),
        (t.compile, f"with train.compile=true: strategy={strategy} does not compile tensor-parallel blocks yet"),
        (t.fused_loss, "with train.fused_loss=true: the output layer is split over the tensor group, which the fused "
                       f"loss does not take yet (strategy={strategy})"),
        (Precision(t.precision) is Precision.fp16, f"with train.precision=fp16: strategy={strategy}'s loss scaler does "
                                                   "not take tensor-parallel gradients yet; use bf16 or fp32"),
        (ObjectiveName(cfg.objective.name) is ObjectiveName.dpo, f"with objective=dpo: strategy={strategy} does not "
                                                                 "split the policy and its reference over a tensor "
                                                                 "group yet"),
    ]
    refused = next((why for wrong, why in not_yet if wrong), None)
    if refused:
        raise ConfigError(f"strategy.tp={tp} {refused}")
    check_model_tensor_parallel(tp, model, uses_sequence_parallel(s, model))
    _require(not uses_sequence_parallel(s, model) or cfg.model.seq_len % tp == 0, "strategy.tp_sequence_parallel",
             f"model.seq_len={cfg.model.seq_len} must be a multiple of strategy.tp={tp} (each rank of the tensor group "
             "holds 1/tp of the sequence between the split layers); set strategy.tp_sequence_parallel=false")


def check_validation_rows(cfg: Config, rows: int) -> None:
    """An empty validation split (a small data.val_fraction, or every document dropped) would give
    a val loss of 0/0: refused once the data is read, before training."""
    d = cfg.data
    _require(rows > 0, "data.val_path" if d.val_path else "data.val_fraction",
             f"the validation split holds no row of model.seq_len={cfg.model.seq_len} tokens with a target"
             + (" (data.drop_long=true drops documents longer than model.seq_len + 1)" if d.drop_long else "")
             + "; give more validation data, or none")


def check_lora(p: PeftConfig) -> None:
    require_hf("peft=lora", "peft", extra="ft")
    _require(p.r >= 1, "peft.r", f"the adapters' rank must be >= 1, got {p.r}")
    _require(p.alpha > 0, "peft.alpha", f"must be > 0, got {p.alpha}")
    _require(p.dropout is None or 0 <= p.dropout < 1, "peft.dropout", f"must be in [0, 1), got {p.dropout}")
    targets = p.target_modules
    _require(targets == "all-linear" or (isinstance(targets, list) and targets and all(
        isinstance(t, str) and t for t in targets)), "peft.target_modules",
             f"all-linear, or a list of module names such as [q_proj,v_proj]; got {targets!r}")


def _values(value: str) -> list[str]:
    """What an override sets: several values in a sweep (a,b); none to check where Hydra or
    OmegaConf computes them (choice(...), ${...}, [...]) or for null."""
    return [] if any(c in value for c in "()${}[]") or value == "null" else [v.strip() for v in value.split(",")]


def _group_options(group: str) -> list[str]:
    folder = resources.files("trainer.conf") / group
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml")) \
        if folder.is_dir() else []


def _enum_of(key: str) -> type[Enum] | None:
    """The Enum a schema key takes, if any (train.precision: Precision)."""
    cls: Any = Config
    for part in key.split("."):
        hint = typing.get_type_hints(cls).get(part) if dataclasses.is_dataclass(cls) else None
        cls = next((t for t in (hint, *typing.get_args(hint)) if isinstance(t, type)
                    and (dataclasses.is_dataclass(t) or issubclass(t, Enum))), None)
    return cls if isinstance(cls, type) and issubclass(cls, Enum) else None


def check_sources_override(key: str, value: str) -> None:
    """data.sources=[{kind:...,path:...,weight:...}, ...]: parsed as Hydra parses it, each source checked."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    try:
        nodes = OverridesParser.create().parse_overrides([f"{key}={value}"])[0].value()
    except OverrideParseException as e:
        raise ConfigError(f"{key}: {str(e).splitlines()[0]}; e.g. '{EXAMPLE}'") from None
    check_source_nodes(nodes, key)


def check_grammar(args: list[str]) -> None:
    """Each override of the command line in Hydra's grammar (a placeholder such as `...` left in
    a command is not): Hydra's own message is a multi-line report and exit 1."""
    from hydra._internal.utils import get_args_parser  # the parse of hydra.main's command line
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    for arg in get_args_parser().parse_known_args(args)[0].overrides:
        try:
            parser.parse_overrides([arg])
        except OverrideParseException as e:
            raise ConfigError(f"{arg!r} is not an override (KEY=VALUE in Hydra's grammar, "
                              f"https://hydra.cc/docs/advanced/override_grammar/basic/): {str(e).splitlines()[0]}") from None


def check_own_data_file(args: list[str], name: str) -> None:
    """data=NAME from the user's --config-dir: its data.sources, which Hydra would refuse in several lines."""
    import yaml

    dirs = [a.split("=", 1)[1] for a in args if a.startswith(("--config-dir=", "-cd="))]
    dirs += [args[i + 1] for i, a in enumerate(args[:-1]) if a in ("--config-dir", "-cd")]
    for file in (Path(d) / "data" / f"{name}.yaml" for d in dirs):
        node = yaml.safe_load(file.read_text()) if file.is_file() else None
        if isinstance(node, dict) and "sources" in node:
            check_source_nodes(node["sources"], f"{file}: data.sources")


def check_overrides(overrides: list[str]) -> None:
    """Caught before Hydra, whose own messages are tracebacks or suggest adding a key with `+`: an
    override out of Hydra's grammar, a mistyped key (the closest valid one is named), a config
    group option or an enum value that does not exist (the allowed ones are listed), a Hydra
    plugin that is not installed (its extra is named). `+model.*` stays open: a custom model's
    factory arguments."""
    check_grammar(overrides)
    known = set(known_keys())
    # a config dir of the user's may add group options that ours lack
    own_groups = not any(a.startswith(("-cd", "--config-dir", "-cp", "--config-path", "hydra.searchpath"))
                         for a in overrides)
    for arg in overrides:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        added = key.startswith("+")
        key = key.lstrip("+~")
        if key.startswith("hydra"):
            require_hydra_plugin(key, value)
            continue  # Hydra's own settings and groups (its plugins add launchers and sweepers)
        if "." not in key and not added:  # a config group choice
            allowed = _group_options(key) if own_groups else []
            if key == "data" and not own_groups:
                check_own_data_file(overrides, value)
        elif key == "data.sources":  # its elements, whose errors Hydra says in several lines
            check_sources_override(key, value)
            continue
        elif key in known:
            allowed = [m.value for m in _enum_of(key) or ()]
        elif added and key.startswith("model."):
            continue
        else:
            raise ConfigError(unknown_key_message(key))
        wrong = [v for v in _values(value) if allowed and v not in allowed]
        if wrong:
            raise ConfigError(f"{key}: allowed values: {', '.join(allowed)}; got {wrong[0]}")
