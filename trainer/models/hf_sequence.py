"""strategy.sp=N for model=hf: every Hugging Face family's attention through Ulysses (models/sequence.py).

transformers dispatches a family's attention by `config._attn_implementation` to a function of its
`AttentionInterface`. At sp > 1 the model is built with ATTENTION, registered there: it repeats key
and value heads to the queries' (grouped-query attention), then calls `sequence.attention`, which
trades this rank's tokens of every head for every token of heads / sp, attends within each packed
document of the whole rows (their position ids, from `sequence.active()`) and trades back. The
name has no mask function in transformers' `AttentionMaskInterface`, so the model builds no mask
of its own (one would be the local length): whatever the family, the mask comes from the whole
rows' position ids alone. The positions the model gets are the global ones (the loop gives it its
share of the rows' position ids), so rotary and learned positions are right.

What works: families whose attention goes through the interface, with `sdpa` (SDPA runs inside);
`eager`, flash and flex implementations are refused (SDPA is what attends the whole sequence here),
as are what `sequence.attention` does not do: a sliding window shorter than the sequence, logit
soft-capping, attention sinks, position biases, attention dropout. `check` finds these before any
rank starts, by running the family cut to one small layer (`hf.small_builder`) once on the CPU.
"""
from __future__ import annotations

import torch

from trainer.config import ModelConfig
from trainer.errors import ConfigError
from trainer.models import sequence

# "sdpa" in the name: transformers checks at build time that the family can run SDPA.
ATTENTION = "trainer_ulysses_sdpa"
PROBE = "trainer_probe_sdpa"
# Keyword arguments of transformers' attention functions that change what attention computes and
# that sequence.attention does not take: refused where a family passes them set.
UNSUPPORTED = ("softcap", "s_aux", "sinks", "position_bias")


def register() -> str:
    """ATTENTION in transformers' AttentionInterface (idempotent); its name, for config._attn_implementation."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, ulysses_attention)
    return ATTENTION


def ulysses_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: [b, heads, tokens, head_dim] in, [b, tokens, heads,
    head_dim] out, no weights. `attention_mask` is None (ATTENTION has no mask function) and unused."""
    tokens = query.shape[2] * (shard.group.size if (shard := sequence.active()) else 1)
    if dropout or (sliding_window is not None and sliding_window < tokens) or any(
            kwargs.get(k) is not None for k in UNSUPPORTED):
        raise NotImplementedError(f"{type(module).__name__}: sequence parallelism's attention takes no dropout, "
                                  "sliding window shorter than the sequence, soft-capping, sinks or position bias")
    from transformers.integrations.sdpa_attention import repeat_kv

    groups = query.shape[1] // key.shape[1]  # grouped-query attention: key/value heads shared by `groups` queries
    out = sequence.attention(query, repeat_kv(key, groups), repeat_kv(value, groups), scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def check(cfg: ModelConfig, sp: int) -> None:
    """Refuse, in one line, a model=hf that strategy.sp=`sp` cannot split (see the top)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from trainer.models import hf

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
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = hf.small_builder(cfg, PROBE)().train()  # train mode: its attention dropout shows
        with torch.no_grad():
            model(torch.zeros(1, 2 * sp, dtype=torch.long), position_ids=torch.arange(2 * sp)[None])
    except Exception as e:
        reason = str(e).splitlines()[0] if str(e) else ""
        raise ConfigError(f"{what}: {family} does not run with its attention replaced, as sequence parallelism "
                          f"replaces it ({type(e).__name__}: {reason}); strategy.sp=1 trains it") from None
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
