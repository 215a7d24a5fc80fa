"""Preference rows a model can take. A row of pairs is 2 x seq_len wide; its padding's
positions stay within the model's position table, packed or not (item 1); a batch larger than the
packed rows is refused naming what a row holds (item 9)."""
from __future__ import annotations

import pytest
import torch

from tests.test_dpo import pair_tokens
from trainer.config import ModelConfig, ModelKind
from trainer.data.preference import PairRows
from trainer.data.stream import BatchStream
from trainer.errors import ConfigError
from trainer.models import build_model


def test_unpacked_pairs_give_positions_the_built_in_model_has():
    """One short pair per row leaves most of the 2 x seq_len row to padding: its positions
    restart so that the built-in model (positions 0 .. seq_len - 1) forwards every row."""
    seq_len = 10
    rows = PairRows(pair_tokens([(2, 3, 2), (4, 6, 5), (3, 10, 2)]), seq_len, 64, pad_id=0, packing=False)
    positions = torch.stack([rows[i][2] for i in range(len(rows))])
    assert positions.shape == (3, 2 * seq_len) and positions.max() == seq_len - 1, positions
    model = build_model(ModelConfig(name="tiny", kind=ModelKind.reference, seq_len=seq_len, vocab_size=64, d_model=16,
                                    n_layers=1, n_heads=2, d_ff=32), torch.device("cpu"))
    x = torch.stack([rows[i][0] for i in range(len(rows))])
    assert model(x, position_ids=positions).shape == (3, 2 * seq_len, 64)


def test_a_batch_of_more_rows_than_packed_pairs_make_is_refused_naming_packing():
    """Eight short pairs pack into one row: a TRL user's batch of 8 pairs is 8 rows here."""
    tokens = pair_tokens([(2, 3, 2)] * 8)
    packed = PairRows(tokens, 32, 64, pad_id=0)
    assert len(packed) == 1
    with pytest.raises(ConfigError, match=r"exceeds the 1 samples of one epoch \(rows of 64 tokens holding 8 pairs "
                                          r"packed; .*data.packing=false makes each row one pair\)"):
        BatchStream(packed, 8, 1, rank=0, world_size=1, seed=0)
    assert BatchStream(PairRows(tokens, 32, 64, pad_id=0, packing=False), 8, 1, rank=0, world_size=1,
                       seed=0).steps_per_epoch == 1
