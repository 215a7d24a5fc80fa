"""The models' checks before any work, each run once before any rank starts, on the CPU: that the
model splits for strategy.sp, keeps packed conversations apart (data.packing) and gives its logits
straight from its output layer (train.fused_loss). Those that run the model run `probe_model` (the
model built as the run's is, small) through `run_probe` (whatever fails, refused in one line).

data.packing (data=chat, preference, mixture): whether a model keeps packed conversations apart is
decided by its numbers, not by its forward's signature (a model may take `position_ids` for its
rotary embedding alone, and attend across conversations all the same): the probe gives two short
sequences packed in one row, `position_ids` restarting at the second, the logits it gives each
alone, within TOLERANCE of their scale; else attention (or any state) crosses from one to the next.
"""
from __future__ import annotations

import inspect
from typing import Callable, TypeVar

import torch
from torch import nn

from trainer.config import Config, ModelConfig, ModelKind, PeftConfig, rows_carry_positions
from trainer.errors import ConfigError
from trainer.log import log
from trainer.models import build_model, custom, hf, logits_of
from trainer.models.fused_loss import fuse_output_layer, the_output_layer
from trainer.models.hf_sequence import PROBE, UNSUPPORTED

T = TypeVar("T")


def probe_model(cfg: ModelConfig, attention: str | None = None) -> tuple[nn.Module, int]:
    """The model as the run builds it, small enough to run on the CPU before any work: a Hugging
    Face model cut to one small layer of each layer type (`hf.small_builder`: the same attention, its kind, heads and
    positions; `attention` as `hf.read_config` takes it), a custom model whole; built with a fixed
    seed, the caller's random state left as it was. With the vocabulary its inputs come from."""
    hf_model = ModelKind(cfg.kind) is ModelKind.hf
    build = hf.small_builder(cfg, attention) if hf_model else custom.builder(cfg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build()
    return model, model.config.get_text_config().vocab_size if hf_model else cfg.vocab_size


def run_probe(forward: Callable[[], T], refusal: Callable[[str], str]) -> T:
    """`forward()` without gradients; whatever it raises is refused in one line, `refusal(reason)`
    with reason "ErrorType: the first line of its message"."""
    try:
        with torch.no_grad():
            return forward()
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else ""
        raise ConfigError(refusal(f"{type(e).__name__}: {first}")) from None


LENGTHS = (7, 5)
# Relative to the largest logit. Measured on Hugging Face families cut as hf.small_builder does: at most
# 2.2e-6 on the 26 that keep sequences apart; 8e-3 (Bloom's ALiBi) to 1.0 (OPT, MPT, Mamba, Jamba) where they cross.
TOLERANCE = 1e-4


def check_packing(cfg: ModelConfig) -> None:
    """Refuse packed rows for a model that does not keep them apart (see the top)."""
    kind = ModelKind(cfg.kind)
    what = (f"the {cfg.attn_implementation} attention of {cfg.path}" if kind is ModelKind.hf else cfg.target)
    model, vocab = probe_model(cfg)
    model.eval()
    parameters = inspect.signature(model.forward).parameters
    if "position_ids" not in parameters and not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        raise ConfigError(f"data.packing: packed conversations pass position_ids (restarting at each one) to the "
                          f"model, and {cfg.target}'s forward takes none; give it a position_ids argument "
                          "that keeps attention within each conversation, or set data.packing=false")
    sequences = [torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(n)) for n in LENGTHS]
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    try:
        apart, packed = run_probe(lambda: (torch.cat([logits_of(model(ids)) for ids in sequences], dim=1),
                                           logits_of(model(torch.cat(sequences, dim=1), position_ids=positions))),
                                  lambda reason: f"data.packing: {what} could not run two sequences packed in one row "
                                                 f"with position_ids ({reason}); set data.packing=false")
    except ConfigError:
        if "flash" in cfg.attn_implementation and kind is ModelKind.hf:
            # Its kernels run on a GPU only; transformers gives them the sequences' bounds from position_ids.
            log.warning(f"data.packing: {what} does not run on the CPU, where packing is checked: not checked")
            return
        raise
    difference = float((packed - apart).abs().max() / apart.abs().max().clamp_min(torch.finfo(apart.dtype).tiny))
    if difference > TOLERANCE:
        raise ConfigError(f"data.packing: packed conversations need a model whose attention stays within each "
                          f"(position_ids restart at each one); {what} gives two sequences packed in one row other "
                          f"logits than each alone (by {difference:.1e} of their scale, more than {TOLERANCE:g}): "
                          "its attention crosses from one to the next; set data.packing=false (a padded row each)")


def fusable(cfg: Config) -> bool:
    """Whether train.fused_loss can take the run's output layer: a model whose logits are its output
    layer's (`check_output_layer`)."""
    try:
        check_output_layer(cfg.model, build_model(cfg.model, torch.device("meta"), cfg.peft, cfg.strategy.sp))
    except ConfigError:
        return False
    return True


def check_output_layer(cfg: ModelConfig, model: nn.Module) -> None:
    """Before any work: the run's model (`model`, built on the meta device, with its adapters; left
    as it is) has a torch Linear output layer, and its logits are that layer's output unchanged (no
    scaling or capping after it: Gemma 2's softcap, Cohere's logit_scale) for that layer's input
    [b, t, width] of token ids [b, t]: seen in a forward of `probe_model` (a Hugging Face model cut
    to one small layer of each layer type; a custom model whole), on the CPU."""
    the_output_layer(model, cfg.vocab_size)
    kind = ModelKind(cfg.kind)
    if kind is ModelKind.reference:
        return  # the built-in model: its logits are lm_head's output
    probe, vocab = probe_model(cfg)
    head = the_output_layer(probe, vocab)
    seen, marker = {}, torch.empty(1, 2, vocab)

    def replace(module, inputs, output):
        seen["input"] = tuple(inputs[0].shape)
        return marker

    hook = head.register_forward_hook(replace)
    what = type(probe).__name__
    try:
        output = run_probe(lambda: probe(torch.zeros(1, 2, dtype=torch.long)),
                           lambda reason: f"train.fused_loss: {what}'s forward failed on the CPU, where its output "
                                          f"layer is checked ({reason})")
    finally:
        hook.remove()
    logits = output.logits if hasattr(output, "logits") else output
    if logits is not marker or seen.get("input", ())[:2] != (1, 2):
        raise ConfigError(f"train.fused_loss: {what}'s logits are not its output layer's output unchanged (scaled or "
                          "capped after it, or the layer sees other positions), so the loss cannot be computed inside "
                          "that layer; use train.fused_loss=false")


def check_model_sequence_parallel(m: ModelConfig, sp: int, model: nn.Module) -> None:
    """strategy.sp=`sp` > 1 (docs/long-context.md): the model's attention splits as Ulysses attention
    needs; `model` the run's, built on the meta device."""
    kind = ModelKind(m.kind)
    if kind is ModelKind.hf:
        check_hf_sequence_parallel(m, sp)
    elif kind is ModelKind.reference and m.n_heads % sp:
        raise ConfigError(f"strategy.sp: model.n_heads={m.n_heads} must divide by strategy.sp={sp}: each rank attends "
                          "with heads / sp of the attention heads")
    elif kind is ModelKind.custom:
        if getattr(type(model), "sequence_parallel", False) is not True:
            raise ConfigError(f"strategy.sp: {m.target} builds a {type(model).__name__}, which does not declare sequence "
                              "parallelism: its attention must call trainer.models.sequence.attention(q, k, v), and its "
                              "class say so with sequence_parallel = True (docs/long-context.md)")
        parameters = inspect.signature(model.forward).parameters
        if "position_ids" not in parameters and not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
            raise ConfigError(f"strategy.sp: {type(model).__name__}.forward takes no position_ids: at strategy.sp > 1 a "
                              "rank gets its share of the rows with their positions in the whole row")


def check_hf_sequence_parallel(cfg: ModelConfig, sp: int) -> None:
    """Refuse, in one line, a model=hf that strategy.sp=`sp` cannot split (models/hf_sequence.py says what
    it does not do)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    what = f"strategy.sp={sp}: model.path={cfg.path}"
    config = hf.read_config(cfg)
    family = f"this {config.model_type} model"
    if not hf.model_class(config)._supports_sdpa:  # first: `auto` picks eager for it, and sdpa is refused
        raise ConfigError(f"{what}: transformers runs {family}'s attention without SDPA (its class does not support "
                          "it), and sequence parallelism attends through SDPA; strategy.sp=1 trains it")
    if cfg.attn_implementation not in ("sdpa", "auto"):
        raise ConfigError(f"{what}: model.attn_implementation={cfg.attn_implementation} is not taken under sequence "
                          "parallelism, which attends the whole sequence with SDPA; set model.attn_implementation=sdpa")
    calls: list[dict] = []

    def probe(module, query, key, value, attention_mask, **kwargs):
        calls.append({"heads": query.shape[1], "dropout": kwargs.get("dropout") or 0.0,
                      "window": kwargs.get("sliding_window"), **{k: kwargs.get(k) for k in UNSUPPORTED}})
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(PROBE, probe)
    positions = torch.arange(2 * sp)[None]

    def forward():  # in train mode: its attention dropout shows
        return probe_model(cfg, PROBE)[0].train()(torch.zeros_like(positions), position_ids=positions)

    run_probe(forward,
              lambda reason: f"{what}: {family} does not run with its attention replaced, as sequence parallelism "
                             f"replaces it ({reason}); strategy.sp=1 trains it")
    if not calls:
        raise ConfigError(f"{what}: {family}'s attention does not go through transformers' attention functions "
                          "(AttentionInterface), which sequence parallelism replaces; strategy.sp=1 trains it")
    heads = calls[0]["heads"]
    if heads % sp:
        raise ConfigError(f"{what}: its {heads} attention heads do not divide among {sp} ranks (Ulysses gives each "
                          f"rank heads / sp of them); use a strategy.sp that divides {heads}")
    if any(c["dropout"] for c in calls):
        raise ConfigError(f"{what}: {family} drops attention weights in training (attention dropout "
                          f"{max(c['dropout'] for c in calls)}), which sequence parallelism's attention does not do; "
                          "set it to 0 in config.json (attention_dropout, attn_pdrop for GPT-2) or use strategy.sp=1")
    windows = [c["window"] for c in calls if c["window"] is not None and c["window"] < cfg.seq_len]
    if windows:
        raise ConfigError(f"{what}: its sliding window of {windows[0]} tokens is shorter than model.seq_len="
                          f"{cfg.seq_len}, and sequence parallelism attends whole sequences; use model.seq_len <= "
                          f"{windows[0]} or strategy.sp=1")
    if found := next((k for c in calls for k in UNSUPPORTED if c[k] is not None), None):
        raise ConfigError(f"{what}: its attention takes {found}, which sequence parallelism's attention does not "
                          "apply; strategy.sp=1 trains it")


_ATTENDS_PACKED_ROWS: dict[str, bool] = {}


def attends_packed_rows(cfg: ModelConfig) -> bool:
    """Whether the model attends rows of packed documents through the trainer's attention
    (models/sequence.py: within each document, without a [t, t] mask): the built-in and custom models
    always; a Hugging Face family where sequence parallelism's check passes at sp=1 (SDPA through
    transformers' interface, nothing hf_sequence's attention does not do), found once per process.
    Elsewhere transformers' own attention keeps the documents apart with its packed mask."""
    if ModelKind(cfg.kind) is not ModelKind.hf:
        return True
    key = f"{cfg.path}|{cfg.attn_implementation}|{cfg.seq_len}"
    if key not in _ATTENDS_PACKED_ROWS:
        try:
            check_hf_sequence_parallel(cfg, 1)
            _ATTENDS_PACKED_ROWS[key] = True
        except ConfigError:
            _ATTENDS_PACKED_ROWS[key] = False
    return _ATTENDS_PACKED_ROWS[key]


def build_as_trained(cfg: Config, context, peft: PeftConfig | None = None) -> nn.Module:
    """The model as the run trains it, built inside `context`: attention split over strategy.sp
    ranks, through the trainer's attention for rows of packed documents where the family takes it,
    the output layer fused for train.fused_loss; with `peft`'s adapters. The policy, and DPO's frozen
    copy of it, which must compute as the policy does."""
    packed = rows_carry_positions(cfg) and attends_packed_rows(cfg.model)
    model = build_model(cfg.model, context, peft, cfg.strategy.sp, packed)
    if cfg.train.fused_loss:  # before the backend's hooks: they gather the output layer's weight for it
        fuse_output_layer(model, cfg.model.vocab_size)
    return model
