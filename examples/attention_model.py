"""A custom model with attention of its own that sequence parallelism can split (docs/long-context.md):

    trainer nproc=2 strategy.sp=2 model=custom model._target_=examples.attention_model.build model.seq_len=128

The hook is two things: its attention calls `trainer.models.sequence.attention(q, k, v)` where it
would call causal SDPA, and its class says `sequence_parallel = True`. Its forward takes
`position_ids`: at strategy.sp > 1 a rank gets its share of each row, with the positions of the
whole row. Packed rows (data=chat): the forward gives each attention call the documents of its
`position_ids` (`sequence.documents_for`: in the loop, those found once for the whole rows; in a
forward of its own, as in the packing check that runs before any rank starts, those of its rows).
"""
from __future__ import annotations

import torch
from torch import nn

from trainer.models import sequence


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.attn_norm, self.mlp_norm = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, documents: sequence.VarlenDocuments | None = None) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        # causal within each packed document; at strategy.sp > 1 over the whole rows
        y = sequence.attention(q, k, v, documents=documents)
        x = x + self.out(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.mlp_norm(x))


class AttentionLM(nn.Module):
    """Token ids [b, t] -> logits [b, t, vocab], with learned positions."""
    sequence_parallel = True  # its attention is sequence.attention, its forward takes position_ids
    _no_split_modules = ["Block"]

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, max_len: int):
        super().__init__()
        self.embed, self.positions = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        documents = sequence.documents_for(position_ids)  # at sp > 1 the whole rows', found by the loop
        if position_ids is None:
            position_ids = torch.arange(ids.shape[1], device=ids.device)[None]
        x = self.embed(ids) + self.positions(position_ids)
        for layer in self.layers:
            x = layer(x, documents)
        return self.head(self.norm(x))


def build(vocab: int = 256, dim: int = 32, layers: int = 2, heads: int = 4, max_len: int = 2048) -> AttentionLM:
    return AttentionLM(vocab, dim, layers, heads, max_len)
