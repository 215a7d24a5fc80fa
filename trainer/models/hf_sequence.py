"""strategy.sp=N for model=hf: every Hugging Face family's attention through Ulysses (models/sequence.py).

transformers dispatches a family's attention by `config._attn_implementation` to a function of its
`AttentionInterface`. At sp > 1 the model is built with ATTENTION, registered there: it calls
`sequence.attention` with the family's key and value heads as they are (grouped-query attention:
fewer than the queries'; that call sends as few as the split allows), which
trades this rank's tokens of every head for every token of heads / sp, attends within each packed
document of the whole rows (their position ids, from `sequence.active()`) and trades back. The
name has no mask function in transformers' `AttentionMaskInterface`, so the model builds no mask
of its own (one would be the local length): whatever the family, the mask comes from the whole
rows' position ids alone. At sp=1 on packed rows the model is built with ATTENTION too where the
family takes it (`models.checks.attends_packed_rows`): documents attended without a [t, t] mask.
The positions the model gets are the global ones (the loop gives it its share of the rows' position
ids), so rotary and learned positions are right; a rotary embedding whose frequencies depend on the
positions it sees (longrope, dynamic) takes them from the whole rows' largest position
(`whole_row_rotary`).

What works: families whose attention goes through the interface, with `sdpa` (SDPA runs inside);
`eager`, flash and flex implementations are refused (SDPA is what attends the whole sequence here),
as are what `sequence.attention` does not do: a sliding window shorter than the sequence, logit
soft-capping, attention sinks, position biases, attention dropout. models/checks.py finds these
before any rank starts (`check_hf_sequence_parallel`), by running the family cut to one small layer of each of its layer
types (`hf.small_builder`: full and sliding-window attention alike) once on the CPU.
"""
from __future__ import annotations

from types import MethodType

import torch

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
    # the loop's documents; a forward of its own (sp=1) those of the position ids the family passes on
    documents = sequence.documents_for(kwargs.get("position_ids"))
    # key/value heads as they are: grouped-query attention
    out = sequence.attention(query, key, value, scale=scaling, documents=documents)
    return out.transpose(1, 2).contiguous(), None


# transformers' RoPE types that pick their frequencies from the largest position they are given
# (modeling_rope_utils.dynamic_rope_update): at sp > 1 a rank's share would give each rank other ones.
POSITION_DEPENDENT_ROPE = ("longrope", "dynamic")


def whole_row_rotary(model: torch.nn.Module) -> torch.nn.Module:
    """`model` (in place) with each rotary embedding whose frequencies depend on the positions it sees
    (longrope: Phi-3; dynamic) choosing them from the whole rows' largest position in a sharded forward:
    its own update runs once on that position alone, then its cos/sin are computed for the rank's
    positions with those frequencies (the undecorated forward, `__wrapped__`)."""
    for module in model.modules():
        types = getattr(module, "rope_type", None)
        types = types.values() if isinstance(types, dict) else [types]  # one per layer type (Gemma 3)
        if hasattr(type(module).forward, "__wrapped__") and any(
                isinstance(t, str) and t.startswith(POSITION_DEPENDENT_ROPE) for t in types):
            module.forward = MethodType(_whole_row_forward, module)  # bound: a deep copy binds to the copy
    return model


def _whole_row_forward(self, x: torch.Tensor, position_ids: torch.Tensor, *args, **kwargs):
    updating = type(self).forward  # transformers' decorated forward: the frequency update, then cos/sin
    shard = sequence.active()
    if shard is None:
        return updating(self, x, position_ids, *args, **kwargs)
    # the whole rows' largest position: their longest document's last (positions restart at 0 in each),
    # or of plain rows 0 .. tokens x sp - 1
    last = torch.tensor(shard.documents.max_seqlen - 1 if shard.documents is not None
                        else position_ids.shape[-1] * shard.group.size - 1)
    updating(self, x, last.to(position_ids).view(1, 1), *args, **kwargs)
    return updating.__wrapped__(self, x, position_ids, *args, **kwargs)
