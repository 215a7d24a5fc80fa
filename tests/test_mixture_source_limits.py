"""How much of each source an epoch draws: a source's `max_samples` (LLaMA-Factory's:
only its first N documents), `repeat` (MosaicML's Stream repeat: each epoch draws repeat x its
documents, in place of weights), and HF interleave_datasets' stopping strategies
(`data.exhausted=first_exhausted|all_exhausted`), read in process from token files whose windows
each hold one token value."""
from __future__ import annotations

import numpy as np
import pytest

from tests.harness import case, with_overrides
from trainer.config import to_config
from trainer.data.mixture import load_mixture

SEQ_LEN = 8


@pytest.fixture(scope="module")
def token_files(tmp_path_factory):
    """a.bin: 10 windows of seq_len + 1 tokens, window k all token k + 1; b.bin: 6 windows of token 50."""
    root = tmp_path_factory.mktemp("limits")
    # windows of a running text overlap by one token: window k is tokens [k * 8, k * 8 + 9)
    np.append(np.repeat(np.arange(1, 11, dtype=np.uint16), SEQ_LEN), np.uint16(10)).tofile(root / "a.bin")
    np.full(6 * SEQ_LEN + 1, 50, dtype=np.uint16).tofile(root / "b.bin")
    return root


def mixture(root, a: dict, b: dict, **overrides):
    sources = [{"kind": "tokens", "path": str(root / "a.bin"), **a}, {"kind": "tokens", "path": str(root / "b.bin"), **b}]
    cfg = to_config(with_overrides(case("ddp"), data__name="mixture", data__packing=False, model__seq_len=SEQ_LEN,
                                   data__sources=sources, **overrides))
    return load_mixture(cfg, local_rank=0)[0]


def drawn(rows, epochs: int) -> dict[str, list[int]]:
    """Per source, how many of its documents each epoch drew."""
    return {name: [int(rows.per_epoch(e)[i]) for e in range(epochs)] for i, name in enumerate(rows.names)}


def test_max_samples_keeps_a_sources_first_documents_only(token_files, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="trainer"):
        rows = mixture(token_files, {"max_samples": 4}, {})
    assert [s["documents"] for s in rows.describe()] == [4, 6]
    seen = {int(v) for e in range(3) for r in range(rows.rows_in(e)) for v in rows[(e, r)][0][:1]}
    assert seen == {1, 2, 3, 4, 50}  # a's first 4 windows, every epoch
    assert any("a (tokens): 4 windows" in r.getMessage() and "the 6 after the first 4 left out (max_samples)"
               in r.getMessage() for r in caplog.records)


def test_repeat_draws_that_many_times_each_sources_documents_an_epoch(token_files):
    rows = mixture(token_files, {"repeat": 0.25}, {"repeat": 2.0})
    # a: 10 x 0.25 = 2.5 an epoch (the half carried to the next), b: 6 x 2 = 12
    assert drawn(rows, 4) == {"a": [2, 3, 2, 3], "b": [12, 12, 12, 12]}
    assert [round(s["fraction"], 4) for s in rows.describe()] == [round(2.5 / 14.5, 4), round(12 / 14.5, 4)]


@pytest.mark.parametrize("weights,first_exhausted,all_exhausted", [
    # a (10 documents) and b (6) run out at 20 and 12 draws: epochs of 12 or 20
    ((1.0, 1.0), {"a": [6, 6, 6], "b": [6, 6, 6]}, {"a": [10, 10, 10], "b": [10, 10, 10]}),
    # at 13.3 and 24 draws: epochs of 13 (9.75 and 3.25, the rounding carried) or 24
    ((3.0, 1.0), {"a": [10, 10, 9], "b": [3, 3, 4]}, {"a": [18, 18, 18], "b": [6, 6, 6]}),
])
def test_hfs_stopping_strategies_end_the_epoch_as_the_first_or_the_last_source_runs_out(
        token_files, weights, first_exhausted, all_exhausted):
    for strategy, expected in (("first_exhausted", first_exhausted), ("all_exhausted", all_exhausted)):
        rows = mixture(token_files, {"weight": weights[0]}, {"weight": weights[1]}, data__exhausted=strategy)
        assert drawn(rows, 3) == expected, strategy
        plan = rows.plan(0)
        for i, size in enumerate((10, 6)):
            documents = plan.document[plan.source == i]
            if strategy == "first_exhausted":  # no document twice; the first source through is through
                assert len(set(documents.tolist())) == len(documents)
            else:  # every document at least once
                assert set(documents.tolist()) == set(range(size))


@pytest.mark.parametrize("a,b,overrides,message", [
    ({"repeat": 1.0}, {"repeat": 1.0}, {"data__exhausted": "all_exhausted"}, r"the repeats size the epoch"),
    ({}, {}, {"data__exhausted": "first_exhausted", "data__epoch_samples": 10}, r"data.epoch_samples: .* sizes the epoch"),
    ({"repeat": 2.0}, {}, {}, r"data.sources: repeat on some sources and not on others"),
    ({"repeat": 2.0, "weight": 3.0}, {"repeat": 1.0}, {}, r"data.sources\[0\].repeat: give a weight .* or repeat"),
    ({"repeat": 0.0}, {"repeat": 1.0}, {}, r"data.sources\[0\].repeat: must be > 0"),
    ({"repeat": 1.0}, {"repeat": 1.0}, {"data__epoch_samples": 10}, r"data.epoch_samples must stay 0"),
    ({"repeat": 2.0}, {"repeat": 1.0}, {"data__exhausted": "stop"}, r"which data.exhausted=stop forbids"),
    ({"max_samples": 0}, {}, {}, r"data.sources\[0\].max_samples: must be >= 1"),
])
def test_bad_repeats_and_max_samples_are_one_line_refusals(token_files, a, b, overrides, message):
    from trainer.checks import validate
    from trainer.errors import ConfigError

    sources = [{"kind": "tokens", "path": str(token_files / "a.bin"), **a},
               {"kind": "tokens", "path": str(token_files / "b.bin"), **b}]
    with pytest.raises(ConfigError, match=message):
        validate(to_config(with_overrides(case("ddp"), data__name="mixture", model__seq_len=SEQ_LEN,
                                          data__sources=sources, **overrides)))
