"""The reference decoder-only transformer (GPT / Llama shapes) with a `TransformerBlock` class:
`model=tiny|small|gpt_125m|gpt_1b|llama2_7b`."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from trainer.models import sequence


@dataclass
class ModelShape:
    vocab_size: int
    seq_len: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    mlp: str = "gelu"  # gelu (GPT-2) | swiglu (Llama)
    norm: str = "layernorm"  # layernorm | rmsnorm
    bias: bool = True


def residual_std(shape: ModelShape) -> float:
    """GPT-2 scales the init of projections into the residual stream by 1/sqrt(2 * n_layers)."""
    return 0.02 / math.sqrt(2 * shape.n_layers)


def make_norm(shape: ModelShape) -> nn.Module:
    if shape.norm == "rmsnorm":
        return nn.RMSNorm(shape.d_model, eps=1e-5)
    return nn.LayerNorm(shape.d_model, bias=shape.bias)


# Each layer's reset_parameters() holds its part of the GPT-2 init; trainer/models/weights.py
# runs it module by module, so every strategy starts from the same weights.
class Linear(nn.Linear):
    def __init__(self, d_in: int, d_out: int, bias: bool, std: float = 0.02):
        self.std = std
        super().__init__(d_in, d_out, bias=bias)

    def reset_parameters(self) -> None:
        normal_unless_meta(self.weight, self.std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        normal_unless_meta(self.weight, 0.02)


def normal_unless_meta(weight: torch.Tensor, std: float) -> None:
    # On meta (a build to count or to shard: InitWeights fills the values later, on a real device)
    # torch's normal_ runs its Python reference, whose first call imports torch._dynamo: 1.6 s
    # of every launch.
    if not weight.is_meta:
        nn.init.normal_(weight, mean=0.0, std=std)


class CausalSelfAttention(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        # the head's width, not the head count: DeepSpeed's AutoTP (strategy.tp on zero) divides a layer's
        # `n_heads` by the tensor degree, as it splits its weights
        self.head_dim = shape.d_model // shape.n_heads
        self.qkv = Linear(shape.d_model, 3 * shape.d_model, shape.bias)
        self.proj = Linear(shape.d_model, shape.d_model, shape.bias, std=residual_std(shape))

    def forward(self, x: torch.Tensor, documents: sequence.VarlenDocuments | None = None) -> torch.Tensor:
        """Causal, within each packed document of `documents` (in a sequence-parallel forward, over
        the whole rows: models/sequence.py)."""
        b, t, _ = x.shape
        # heads: -1, as many as qkv gives (strategy.tp: this rank's share of them)
        q, k, v = self.qkv(x).view(b, t, 3, -1, self.head_dim).transpose(1, 3).unbind(2)
        y = sequence.attention(q, k, v, documents=documents)
        return self.proj(y.transpose(1, 2).flatten(2))


class MLP(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        self.gated = shape.mlp == "swiglu"
        self.up = Linear(shape.d_model, shape.d_ff * (2 if self.gated else 1), shape.bias)
        self.down = Linear(shape.d_ff, shape.d_model, shape.bias, std=residual_std(shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            gate, up = self.up(x).chunk(2, dim=-1)
            return self.down(F.silu(gate) * up)
        return self.down(F.gelu(self.up(x)))


class TransformerBlock(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        self.attn_norm = make_norm(shape)
        self.attn = CausalSelfAttention(shape)
        self.mlp_norm = make_norm(shape)
        self.mlp = MLP(shape)

    def forward(self, x: torch.Tensor, documents: sequence.VarlenDocuments | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), documents)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    # Read by blocks.py when `strategy.wrap` is not given (the Hugging Face convention).
    _no_split_modules = ["TransformerBlock"]

    def __init__(self, shape: ModelShape):
        super().__init__()
        self.shape = shape
        # strategy.tp (models/tensor_plan.py): qkv packs q, k and v, the SwiGLU up packs gate and up, so each
        # rank keeps its heads' (its features') share of each; the output layer split by vocabulary rows
        self._tp_plan = {"tok_emb": "embedding_rowwise", "blocks.*.attn.qkv": "packed_colwise:3",
                         "blocks.*.attn.proj": "rowwise",
                         "blocks.*.mlp.up": "packed_colwise:2" if shape.mlp == "swiglu" else "colwise",
                         "blocks.*.mlp.down": "rowwise", "lm_head": "colwise_gather_output"}
        # strategy.tp_sequence_parallel: the residual stream and the norms on each rank's share of the sequence,
        # the positions looked up for it
        self._tp_sequence_plan = {"pos_emb": "sequence_positions", "blocks.*.attn_norm": "sequence_parallel",
                                  "blocks.*.attn": "sequence_gathered", "blocks.*.mlp_norm": "sequence_parallel",
                                  "blocks.*.mlp": "sequence_gathered", "norm": "sequence_parallel"}
        self.tok_emb = Embedding(shape.vocab_size, shape.d_model)
        self.pos_emb = Embedding(shape.seq_len, shape.d_model)
        self.blocks = nn.ModuleList(TransformerBlock(shape) for _ in range(shape.n_layers))
        self.norm = make_norm(shape)
        self.lm_head = Linear(shape.d_model, shape.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [b, t, vocab] of token ids [b, t]. `position_ids` [b, t], for rows of packed
        documents: each document starts where they are 0, and attends to itself only. In a
        sequence-parallel forward (strategy.sp), `idx` and `position_ids` are this rank's share of the
        rows, and attention keeps the documents of the whole rows' apart (models/sequence.py)."""
        documents = sequence.documents_for(position_ids)
        if position_ids is None:
            # [1, t]: the rows' dimension kept, which strategy.tp_sequence_parallel splits the positions' lookups over
            position_ids = torch.arange(idx.shape[1], device=idx.device)[None]
        x = self.tok_emb(idx) + self.pos_emb(position_ids)
        for block in self.blocks:
            x = block(x, documents)
        return self.lm_head(self.norm(x))


def shape_of(cfg) -> ModelShape:
    """The shape from the `model` settings (a ModelConfig)."""
    return ModelShape(cfg.vocab_size, cfg.seq_len, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.d_ff, cfg.mlp,
                      cfg.norm, cfg.bias)
