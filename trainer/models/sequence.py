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

Packed rows (documents whose position ids restart at 0) attend within each document without any
[t, t] tensor: `documents(position_ids)` finds the documents' boundaries once per micro-batch from
the whole rows' position ids (O(t)), and `within_documents` attends each document causally: on CUDA
in half precision with varlen flash attention (`torch.nn.attention.varlen.varlen_attn`, the whole
micro-batch in one call), elsewhere with causal SDPA per document (never wider than the longest).

Who calls what:
- the loop enters `sharded(group, position_ids)` around a micro-batch's forward and backward, with
  the whole rows' position ids (None: plain causal rows), at any sp;
- a model's attention calls `attention(q, k, v)` where it would call SDPA: the built-in model,
  Hugging Face models through the attention function registered in transformers (models/hf.py),
  and a custom model through the same call (its documented hook); a model that runs packed rows
  outside the loop (the packing check) gives it `documents=documents_for(position_ids)`;
- `active()` says whether a sharded forward is running (None outside one, or at sp=1 on plain rows).
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F
from torch.distributed.nn.functional import all_to_all_single

# torch 2.13 marks the autograd all-to-all deprecated, one warning per call per rank (two per attention
# layer and forward); its successor in _functional_collectives is private. Not repeated on the console.
warnings.filterwarnings("ignore", message="torch.distributed.nn.functional.all_to_all_single is deprecated",
                        category=FutureWarning)
warnings.filterwarnings("ignore", message="torch.distributed.nn.functional.all_reduce is deprecated",
                        category=FutureWarning)  # SequenceGroup.summed, per call as the all-to-all


@dataclass(frozen=True)
class SequenceGroup:
    """This rank's sequence-parallel group: `size` ranks, this one `rank` among them."""
    group: dist.ProcessGroup | None
    size: int
    rank: int

    def local(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's consecutive share of a whole-sequence tensor along `dim`."""
        return tensor.chunk(self.size, dim=dim)[self.rank]

    def whole(self, share: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The whole-sequence tensor whose `local` shares the group's ranks hold (no gradient)."""
        if self.size == 1:
            return share
        shares = [torch.empty_like(share) for _ in range(self.size)]
        dist.all_gather(shares, share.contiguous(), group=self.group)
        return torch.cat(shares, dim=dim)

    def summed(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of `tensor` over the group's ranks; with gradients, each rank's gradient is the
        sum of the ranks' gradients of the sum (torch.distributed.nn's all-reduce)."""
        if self.size == 1:
            return tensor
        if tensor.requires_grad:
            return dist_nn.all_reduce(tensor, group=self.group)
        tensor = tensor.clone()
        dist.all_reduce(tensor, group=self.group)
        return tensor


WHOLE_ROWS = SequenceGroup(None, 1, 0)  # strategy.sp=1: every rank holds whole rows


def sequence_group(rank: int, world_size: int, sp: int) -> SequenceGroup:
    """This rank's group of `sp` consecutive ranks (DeepSpeed's layout: ranks 0..sp-1, sp..2sp-1, ...).
    Every rank creates every group, in the same order (torch's `new_group` is collective)."""
    if sp == 1:
        return WHOLE_ROWS
    groups = [dist.new_group(list(range(start, start + sp))) for start in range(0, world_size, sp)]
    return SequenceGroup(groups[rank // sp], sp, rank % sp)


@dataclass(frozen=True)
class VarlenDocuments:
    """The packed documents of a micro-batch's rows [b, t], each within one row: `spans` (row, start,
    end) per document, and the same as varlen attention takes them, over the rows laid end to end:
    `cu_seqlens` (int32 [documents + 1], on the rows' device) and `max_seqlen` (the longest)."""
    spans: tuple[tuple[int, int, int], ...]
    cu_seqlens: torch.Tensor
    max_seqlen: int


def documents(position_ids: torch.Tensor) -> VarlenDocuments:
    """The documents of whole rows [b, t]: one starts where a position id is 0 and at each row's start."""
    b, t = position_ids.shape
    starts = position_ids == 0
    starts[:, 0] = True
    bounds = torch.cat([starts.flatten().nonzero().flatten(),
                        torch.tensor([b * t], device=position_ids.device)])
    edges = bounds.tolist()  # one host sync per micro-batch: the spans CPU attention loops over
    spans = tuple((start // t, start % t, start % t + end - start) for start, end in zip(edges, edges[1:]))
    return VarlenDocuments(spans, bounds.to(torch.int32), max(end - start for start, end in zip(edges, edges[1:])))


@dataclass(frozen=True)
class Sharded:
    group: SequenceGroup
    documents: VarlenDocuments | None  # of the whole rows; None: causal rows


_active: Sharded | None = None


def active() -> Sharded | None:
    return _active


@contextmanager
def sharded(group: SequenceGroup, position_ids: torch.Tensor | None) -> Iterator[None]:
    """The forward inside runs on this rank's share of the rows; `position_ids` are the whole rows'
    (packed documents restart at 0), from which attention's documents are found, once."""
    global _active
    whole = documents(position_ids) if position_ids is not None else None
    previous, _active = _active, Sharded(group, whole) if group.size > 1 or whole is not None else None
    try:
        yield
    finally:
        _active = previous


def documents_for(position_ids: torch.Tensor | None) -> VarlenDocuments | None:
    """The documents a model's forward given `position_ids` attends within: the sharded forward's (of
    the whole rows), else those of `position_ids` (a forward of its own on whole rows); None: causal."""
    if _active is not None:
        return _active.documents
    return documents(position_ids) if position_ids is not None else None


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


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
              documents: VarlenDocuments | None = None) -> torch.Tensor:
    """Causal attention of this rank's tokens, SDPA's layout ([b, heads, tokens, head_dim]; key
    and value heads as many as the queries' or fewer, a divisor of them: grouped-query attention);
    in a sharded forward, over the whole sequence; within each packed document of `documents`, or
    else of the sharded forward's. Else plain causal SDPA."""
    shard = _active
    if documents is None and shard is not None:
        documents = shard.documents
    split = shard is not None and shard.group.size > 1
    if split:
        heads = q.shape[1]
        q, k, v = (heads_to_sequence(q, shard.group), key_values_to_sequence(k, heads, shard.group),
                   key_values_to_sequence(v, heads, shard.group))
    if documents is None:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    else:
        y = within_documents(q, k, v, documents, scale)
    return sequence_to_heads(y, shard.group) if split else y


def varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: VarlenDocuments,
           scale: float | None) -> torch.Tensor:
    """`within_documents` with torch's varlen flash attention: the rows laid end to end, [tokens,
    heads, head_dim], causal within each document of `cu_seqlens`."""
    from torch.nn.attention.varlen import varlen_attn

    b, heads, t, head_dim = q.shape
    flat = [x.transpose(1, 2).reshape(b * t, x.shape[1], head_dim) for x in (q, k, v)]
    cu, longest = documents.cu_seqlens, documents.max_seqlen
    y = varlen_attn(*flat, cu, cu, longest, longest, scale=scale, window_size=(-1, 0), enable_gqa=k.shape[1] != heads)
    return y.reshape(b, t, heads, head_dim).transpose(1, 2)


def within_documents(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: VarlenDocuments,
                     scale: float | None) -> torch.Tensor:
    """Causal attention within each document of whole rows, [b, heads, t, head_dim] in and out (key
    and value heads may be fewer: grouped-query attention). The one place that picks the kernel:
    flash attention over variable lengths on CUDA in half precision (one call; what it keeps for
    backward is q, k, v, the output and the log-sum-exp), else causal SDPA per document."""
    b, heads, t, head_dim = q.shape
    gqa = k.shape[1] != heads
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        return varlen(q, k, v, documents, scale)
    pieces = [F.scaled_dot_product_attention(q[row:row + 1, :, start:end], k[row:row + 1, :, start:end],
                                             v[row:row + 1, :, start:end], is_causal=True, scale=scale, enable_gqa=gqa)
              for row, start, end in documents.spans]  # row by row, in order: the rows laid end to end
    return torch.cat(pieces, dim=2).view(heads, b, t, head_dim).transpose(0, 1)
