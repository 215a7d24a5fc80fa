"""Ulysses sequence parallelism (`strategy.sp=N`): the attention of one sequence split over N ranks.

Each rank of a sequence-parallel group holds `seq_len / N` consecutive tokens of the same samples
(consecutive ranks form a group: DeepSpeed's layout). Everything but attention is per token and
runs on the local tokens alone. Attention needs the whole sequence: before it, an all-to-all
trades the sequence for heads (each rank gets every token of `heads / N` heads), attention runs
on the whole sequence of those heads, and a second all-to-all trades back. With fewer key/value
heads than query heads (grouped-query attention) the keys and values travel as few as the split
allows (`key_value_heads_sent`) and attention pairs them with their queries (`enable_gqa`). Both are autograd
all-to-alls, so each rank's gradients are those of its own tokens' loss and the backends'
average over all ranks (dp x sp) gives the gradient of the global mean: no backend is told.

Who calls what:
- the loop enters `sharded(group, position_ids)` around a micro-batch's forward, with the whole
  rows' position ids (None: plain causal rows);
- a model's attention calls `attention(q, k, v)` where it would call SDPA: the built-in model,
  Hugging Face models through the attention function registered in transformers (models/hf.py),
  and a custom model through the same call (its documented hook);
- `active()` says whether a sharded forward is running (None outside one, or at sp=1).
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.nn.functional import all_to_all_single

# torch 2.13 marks the autograd all-to-all deprecated, one warning per call per rank (two per attention
# layer and forward); its successor in _functional_collectives is private. Not repeated on the console.
warnings.filterwarnings("ignore", message="torch.distributed.nn.functional.all_to_all_single is deprecated",
                        category=FutureWarning)


@dataclass(frozen=True)
class SequenceGroup:
    """This rank's sequence-parallel group: `size` ranks, this one `rank` among them."""
    group: dist.ProcessGroup | None
    size: int
    rank: int

    def local(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's consecutive share of a whole-sequence tensor along `dim`."""
        return tensor.chunk(self.size, dim=dim)[self.rank]


def sequence_group(rank: int, world_size: int, sp: int) -> SequenceGroup:
    """This rank's group of `sp` consecutive ranks (DeepSpeed's layout: ranks 0..sp-1, sp..2sp-1, ...).
    Every rank creates every group, in the same order (torch's `new_group` is collective)."""
    if sp == 1:
        return SequenceGroup(None, 1, 0)
    groups = [dist.new_group(list(range(start, start + sp))) for start in range(0, world_size, sp)]
    return SequenceGroup(groups[rank // sp], sp, rank % sp)


@dataclass(frozen=True)
class Sharded:
    group: SequenceGroup
    position_ids: torch.Tensor | None  # [b, s] of the whole rows; None: causal rows


_active: Sharded | None = None


def active() -> Sharded | None:
    return _active


@contextmanager
def sharded(group: SequenceGroup, position_ids: torch.Tensor | None) -> Iterator[None]:
    """The forward inside runs on this rank's share of the rows; `position_ids` are the whole rows'
    (packed documents restart at 0), from which attention's document mask is built."""
    global _active
    previous, _active = _active, Sharded(group, position_ids) if group.size > 1 else None
    try:
        yield
    finally:
        _active = previous


def document_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """Block-causal [b, 1, t, t] (True: may attend): a position attends to the positions before it
    in its own document, documents starting where `position_ids` is 0."""
    document = (position_ids == 0).cumsum(-1)
    t = position_ids.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=position_ids.device).tril()
    return ((document[:, :, None] == document[:, None, :]) & causal)[:, None]


def heads_to_sequence(x: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
    """[b, h, s/N, d] of every head -> [b, h/N, s, d]: this rank's heads over the whole sequence."""
    b, h, s, d = x.shape
    if h % group.size:
        raise ValueError(f"sequence parallelism: {h} attention heads do not split over strategy.sp={group.size} ranks")
    chunks = x.reshape(b, group.size, h // group.size, s, d).transpose(0, 1).contiguous()  # [N: heads, ...]
    received = all_to_all_single(torch.empty_like(chunks), chunks, group=group.group)  # [N: sequence, ...]
    return received.permute(1, 2, 0, 3, 4).reshape(b, h // group.size, group.size * s, d)


def sequence_to_heads(x: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
    """The inverse: [b, h/N, s, d] -> [b, h, s/N, d]."""
    b, h, s, d = x.shape
    chunks = x.reshape(b, h, group.size, s // group.size, d).permute(2, 0, 1, 3, 4).contiguous()  # [N: sequence, ...]
    received = all_to_all_single(torch.empty_like(chunks), chunks, group=group.group)  # [N: heads, ...]
    return received.transpose(0, 1).reshape(b, h * group.size, s // group.size, d)


def key_value_heads_sent(heads: int, kv_heads: int, sp: int) -> int:
    """How many key/value heads the all-to-all carries for `heads` query heads at strategy.sp=`sp`
    (grouped-query attention, DeepSpeed ALST's scheme): the `kv_heads` themselves where they split
    over the ranks (kv_heads / sp a rank); `sp` where there are fewer (each repeated sp / kv_heads
    times: one a rank); else one per query head, as many as the queries'."""
    if kv_heads % sp == 0:
        return kv_heads
    if sp % kv_heads == 0:
        return sp
    return heads


def key_values_to_sequence(x: torch.Tensor, heads: int, group: SequenceGroup) -> torch.Tensor:
    """Keys or values [b, kv_heads, s/N, d] -> this rank's [b, sent / N, s, d], `sent` of
    `key_value_heads_sent`: each head repeated as often as that takes (in place, so that a rank's
    key/value heads are those of its query heads), then traded like the queries."""
    sent = key_value_heads_sent(heads, x.shape[1], group.size)
    return heads_to_sequence(x.repeat_interleave(sent // x.shape[1], dim=1) if sent != x.shape[1] else x, group)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Causal attention of this rank's tokens, SDPA's layout ([b, heads, tokens, head_dim]; key
    and value heads as many as the queries' or fewer, a divisor of them: grouped-query attention);
    in a sharded forward, over the whole sequence, within each packed document. Outside one: plain
    causal SDPA."""
    shard = _active
    if shard is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    group = shard.group
    heads = q.shape[1]
    q, k, v = heads_to_sequence(q, group), key_values_to_sequence(k, heads, group), key_values_to_sequence(v, heads, group)
    grouped = k.shape[1] != q.shape[1]
    if shard.position_ids is None:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=grouped)
    else:
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(shard.position_ids), scale=scale,
                                           enable_gqa=grouped)
    return sequence_to_heads(y, group)
