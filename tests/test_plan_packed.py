"""The planner counts what packing costs (trainer/plan/activations.py): where the data packs rows, its
meta trace gives the model packed position ids, so a model that keeps a [t, t] document mask shows
its square term, and the built-in model (no mask: models/sequence.py) costs what plain rows cost."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.test_activations import resolve_model, to_config


class Attend(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x, mask):
        q, k, v = (t[:, None] for t in self.qkv(x).chunk(3, dim=-1))
        return x + F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)[:, 0]


class MaskedWhenPacked(nn.Module):
    """Keeps packed documents apart with a [b, 1, t, t] mask built from its position ids (as
    transformers' own packed masks do): a square term the planner must see."""
    _no_split_modules = ["Attend"]

    def __init__(self, vocab: int = 64, dim: int = 32):
        super().__init__()
        self.embed, self.attend, self.head = nn.Embedding(vocab, dim), Attend(dim), nn.Linear(dim, vocab)

    def forward(self, ids, position_ids=None):
        mask = None
        if position_ids is not None:
            document = (position_ids == 0).cumsum(-1)
            causal = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool, device=ids.device).tril()
            mask = ((document[:, :, None] == document[:, None, :]) & causal)[:, None]
        return self.head(self.attend(self.embed(ids), mask))


def planned_for(model: dict, data: dict):
    from trainer.plan.activations import planned

    cfg = to_config({"model": model, "data": data})
    cfg.model = resolve_model(cfg.model)
    return planned(cfg, False, False)


CHAT = {"name": "chat", "packing": True}
PLAIN = {"name": "synthetic"}


def test_the_plan_sees_a_packed_rows_mask_and_the_built_in_models_packed_rows_cost_as_plain_ones():
    masked = {"name": "custom", "kind": "custom", "_target_": "tests.test_plan_packed.MaskedWhenPacked"}
    assert planned_for(masked, PLAIN).per_token_squared == 0
    assert planned_for(masked, CHAT).per_token_squared > 0
    for unpacked in ({**CHAT, "packing": False}, PLAIN):
        assert planned_for(masked, unpacked).per_token_squared == 0
    packed, plain = planned_for({"name": "tiny"}, CHAT), planned_for({"name": "tiny"}, PLAIN)
    assert packed.per_token_squared == 0 and abs(packed.bytes(2048) - plain.bytes(2048)) <= 0.1 * plain.bytes(2048)
