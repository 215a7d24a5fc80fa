"""Packed rows attend within their documents without a [t, t] mask (trainer/models/sequence.py): the
built-in model's logits and gradients on packed rows are those of each document in a padded row of its
own (fp32, 1e-6), at sp=1 in-process and at sp=2 on 2 gloo ranks; and a packed row keeps for backward
about what an unpacked row of the same length keeps (`SavedBytes`, what mem.activations measures), at
a length where a [t, t] document mask would be the larger part."""
from __future__ import annotations

import torch

from tests.harness import on_ranks

VOCAB = 64
DOCUMENTS = (7, 3, 11, 1, 10)  # one packed row of 32 tokens; a second row holds them in reverse order
TOLERANCE = 1e-6


def tiny_model(seq_len: int, n_heads: int = 4):
    from trainer.models.builtin import ModelShape, Transformer

    torch.manual_seed(0)
    return Transformer(ModelShape(VOCAB, seq_len, 32, 2, n_heads, 64))


def packed_rows() -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids [2, 32], position ids restarting at each document)."""
    ids = torch.randint(0, VOCAB, (2, sum(DOCUMENTS)), generator=torch.Generator().manual_seed(0))
    positions = torch.stack([torch.cat([torch.arange(n) for n in order]) for order in (DOCUMENTS, DOCUMENTS[::-1])])
    return ids, positions


def padded(model, ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Each document in a row of its own, padded to the row's length (padding after it, causal: it
    changes nothing before it): the logits put back in the packed layout, and the gradients of the
    summed logits' squares."""
    logits = torch.empty(*ids.shape, VOCAB)
    model.zero_grad()
    for row in range(ids.shape[0]):
        starts = (positions[row] == 0).nonzero().flatten().tolist() + [ids.shape[1]]
        for start, end in zip(starts, starts[1:]):
            alone = torch.zeros(1, ids.shape[1], dtype=torch.long)
            alone[0, :end - start] = ids[row, start:end]
            out = model(alone)[0, :end - start]
            out.square().sum().backward()
            logits[row, start:end] = out.detach()
    return logits, {n: p.grad.clone() for n, p in model.named_parameters()}


def largest_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_packed_rows_give_each_documents_padded_logits_and_gradients_at_sp1():
    from trainer.models import sequence

    model = tiny_model(32)
    ids, positions = packed_rows()
    expected_logits, expected_grads = padded(model, ids, positions)
    model.zero_grad()
    with sequence.sharded(sequence.SequenceGroup(None, 1, 0), positions):  # as the loop runs it
        logits = model(ids, position_ids=positions)
        logits.square().sum().backward()
    assert largest_difference(logits.detach(), expected_logits) < TOLERANCE
    for name, p in model.named_parameters():
        assert largest_difference(p.grad, expected_grads[name]) < TOLERANCE, name
    model.zero_grad()  # a forward of its own (the packing check): the documents of its own position ids
    assert largest_difference(model(ids, position_ids=positions).detach(), expected_logits) < TOLERANCE


def sharded_packed(env) -> dict[str, float]:
    """On each of 2 ranks: this rank's half of the packed rows, inside `sharded` with the whole rows'
    position ids; its logits and summed gradients against the padded documents at sp=1."""
    import torch.distributed as dist

    from trainer.models import sequence

    model = tiny_model(32)
    ids, positions = packed_rows()
    expected_logits, expected_grads = padded(model, ids, positions)
    model.zero_grad()
    group = sequence.SequenceGroup(dist.group.WORLD, 2, dist.get_rank())
    with sequence.sharded(group, positions):
        logits = model(group.local(ids), position_ids=group.local(positions))
        logits.square().sum().backward()
    gathered = [torch.empty_like(logits) for _ in range(2)]
    dist.all_gather(gathered, logits.detach().contiguous())
    found = {"logits": largest_difference(torch.cat(gathered, 1), expected_logits)}
    for name, p in model.named_parameters():
        dist.all_reduce(p.grad)  # each rank's gradient is its own tokens' share
        found[name] = largest_difference(p.grad, expected_grads[name])
    return found


def test_packed_rows_give_each_documents_padded_logits_and_gradients_at_sp2():
    for rank, found in on_ranks(2, sharded_packed).items():
        for what, difference in found.items():
            assert difference < TOLERANCE, (rank, what, difference)


LONG = 1024  # a [t, t] fp32 mask per layer (4 MiB) would be about 3x the rest the tiny model keeps


def saved_bytes(sp: int, rank: int, group, packed: bool) -> int:
    """The bytes one forward and loss of a row of LONG tokens keeps for backward on this rank: four
    documents packed, or one plain row."""
    from trainer.models import sequence
    from trainer.saved_bytes import SavedBytes

    model = tiny_model(LONG)
    ids = torch.randint(0, VOCAB, (1, LONG), generator=torch.Generator().manual_seed(0))
    whole = torch.arange(LONG)[None] % (LONG // 4) if packed else torch.arange(LONG)[None]
    shares = sequence.SequenceGroup(group, sp, rank)
    with sequence.sharded(shares, whole if packed else None), SavedBytes() as saved:
        model(shares.local(ids), position_ids=shares.local(whole)).square().sum()
    return saved.bytes


def bytes_on_rank(env) -> tuple[int, int]:
    import torch.distributed as dist

    return saved_bytes(2, dist.get_rank(), dist.group.WORLD, True), saved_bytes(2, dist.get_rank(), dist.group.WORLD, False)


def test_a_packed_row_keeps_about_what_an_unpacked_row_keeps_at_sp1_and_sp2():
    found = {"sp=1": (saved_bytes(1, 0, None, True), saved_bytes(1, 0, None, False))}
    found.update({f"sp=2 rank {rank}": kept for rank, kept in on_ranks(2, bytes_on_rank).items()})
    for where, (packed, plain) in found.items():
        assert abs(packed - plain) <= 0.1 * plain, (where, packed, plain)


def varlen_as_documented(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                         enable_gqa=False):
    """torch's varlen_attn as its docstring says (its flash kernel runs on CUDA only, which this suite
    has not): [tokens, heads, head_dim], each sequence of `cu_seq_q` alone, causal for (-1, 0)."""
    assert window_size == (-1, 0) and cu_seq_q.dtype == torch.int32 and torch.equal(cu_seq_q, cu_seq_k)
    edges = cu_seq_q.tolist()
    assert max_q == max_k == max(end - start for start, end in zip(edges, edges[1:]))
    return torch.cat([torch.nn.functional.scaled_dot_product_attention(
        *(x[start:end].transpose(0, 1) for x in (query, key, value)), is_causal=True, scale=scale,
        enable_gqa=enable_gqa).transpose(0, 1) for start, end in zip(edges, edges[1:])])


def test_the_cuda_kernels_layout_gives_what_sdpa_per_document_gives(monkeypatch):
    """sequence.varlen (CUDA, half precision) lays the rows end to end for varlen_attn and back, with
    grouped-query key/value heads: checked against the CPU path with varlen_attn as documented."""
    import torch.nn.attention.varlen

    from trainer.models import sequence

    monkeypatch.setattr(torch.nn.attention.varlen, "varlen_attn", varlen_as_documented)
    _, positions = packed_rows()
    documents = sequence.documents(positions)
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, positions.shape[1], 8, generator=generator)
    k, v = (torch.randn(2, 2, positions.shape[1], 8, generator=generator) for _ in range(2))
    expected = sequence.within_documents(q, k, v, documents, None)
    assert largest_difference(sequence.varlen(q, k, v, documents, None), expected) < TOLERANCE
