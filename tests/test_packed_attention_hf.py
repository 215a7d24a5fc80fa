"""Hugging Face families on packed rows attend within their documents without a [t, t] mask: at sp=1
built for packed rows (models/hf.py: the trainer's attention function where the family takes it), a
tiny Qwen2 (grouped-query attention) gives each document's padded logits (fp32, 1e-6), and a packed row
keeps for backward what an unpacked row of its length keeps with transformers' own attention, at sp=1
in-process and at sp=2 on 2 gloo ranks (the issue measured 2.44x and 3.57x with the mask)."""
from __future__ import annotations

import pytest
import torch

from tests.harness import on_ranks

LONG = 2048  # the issue's rows: transformers' [t, t] mask would be the larger part of what a row keeps


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    from trainer.demo import make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("qwen2"), "qwen2", weights=True, max_position_embeddings=LONG)


def model_config(path, seq_len: int):
    from trainer.config import ModelConfig
    from trainer.models import resolve_model

    return resolve_model(ModelConfig(name="hf", kind="hf", path=str(path), seq_len=seq_len))


def test_a_qwen2_built_for_packed_rows_gives_each_documents_padded_logits(qwen2):
    from trainer.models import hf, sequence

    cfg = model_config(qwen2, 32)
    torch.manual_seed(0)
    own = hf.builder(cfg)()
    packed = hf.builder(cfg, packed=True)()
    assert packed.config._attn_implementation != own.config._attn_implementation
    packed.load_state_dict(own.state_dict())
    lengths = (7, 3, 11, 1, 10)
    ids = torch.randint(0, cfg.vocab_size, (1, sum(lengths)), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    with torch.no_grad():
        alone = torch.cat([own(ids[:, a:b]).logits for a, b in zip(starts, starts[1:])], dim=1)
        with sequence.sharded(sequence.SequenceGroup(None, 1, 0), positions):  # as the loop runs it
            in_loop = packed(ids, position_ids=positions).logits
        of_its_own = packed(ids, position_ids=positions).logits  # the documents of the positions it passes on
    for logits in (in_loop, of_its_own):
        assert float((logits - alone).abs().max() / alone.abs().max()) < 1e-6


def saved_bytes(path: str, sp: int, rank: int, group, packed: bool) -> int:
    """What one forward and loss of a row of LONG tokens keeps for backward on this rank: four
    documents packed (the model built for them), or one plain row (built as for plain data)."""
    from trainer.models import hf, sequence
    from trainer.saved_bytes import SavedBytes

    model = hf.builder(model_config(path, LONG), sp, packed)()
    ids = torch.randint(0, model.config.vocab_size, (1, LONG), generator=torch.Generator().manual_seed(0))
    whole = torch.arange(LONG)[None] % (LONG // 4 if packed else LONG)
    shares = sequence.SequenceGroup(group, sp, rank)
    local = shares.local(whole) if packed or sp > 1 else None  # plain rows at sp=1 carry no position ids
    with sequence.sharded(shares, whole if packed else None), SavedBytes() as saved:
        model(shares.local(ids), position_ids=local).logits.square().sum()
    return saved.bytes


def bytes_on_rank(env, path: str) -> tuple[int, int]:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.group.WORLD
    return saved_bytes(path, 2, rank, world, True), saved_bytes(path, 2, rank, world, False)


def test_a_packed_qwen2_row_keeps_about_what_an_unpacked_row_keeps_at_sp1_and_sp2(qwen2):
    found = {"sp=1": (saved_bytes(str(qwen2), 1, 0, None, True), saved_bytes(str(qwen2), 1, 0, None, False))}
    found.update({f"sp=2 rank {rank}": kept for rank, kept in on_ranks(2, bytes_on_rank, str(qwen2)).items()})
    for where, (packed, plain) in found.items():
        assert abs(packed - plain) <= 0.1 * plain, (where, packed, plain)
