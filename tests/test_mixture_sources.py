"""Mixtures: what each source gives. A source's own validation file is not overridden by
data.val_fraction; an hf source's long documents are cut into windows (no token lost) or, on
request, truncated or dropped with what is lost counted; the allocation's rounding is carried
across epochs."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from tests.harness import case, with_overrides
from trainer.config import Exhausted, WeightsBy, to_config
from trainer.data.mixture import MixtureRows, load_mixture

SEQ_LEN = 32


def mixture_config(sources: list[dict], **overrides):
    return to_config(with_overrides(case("ddp"), data__name="mixture", model__seq_len=SEQ_LEN, data__sources=sources,
                                    **overrides))


def test_a_sources_own_validation_file_and_val_fraction_are_refused_together():
    from trainer.checks import validate
    from trainer.errors import ConfigError

    sources = [{"kind": "tokens", "path": "a.bin", "val_path": "a_val.bin"}, {"kind": "tokens", "path": "b.bin"}]
    with pytest.raises(ConfigError, match=r"data.sources\[0\].val_path: give a source's val_path or "
                                          "data.val_fraction"):
        validate(mixture_config(sources, data__val_fraction=0.1))
    validate(mixture_config(sources))


@pytest.fixture(scope="module")
def long_texts(tmp_path_factory):
    """An hf source of 40 documents, 10 of them several rows long, and its tokenizer."""
    from trainer.demo import documents, train_tokenizer, write_jsonl

    root = tmp_path_factory.mktemp("long_texts")
    texts = documents()
    long = [" ".join(texts[i:i + 12]) for i in range(0, 120, 12)]
    return {"tokenizer": str(train_tokenizer(root / "tokenizer", texts)), "cache_dir": str(root / "cache"),
            "path": str(write_jsonl(root / "books.jsonl", texts[:30] + long)), "val": str(write_jsonl(
                root / "val.jsonl", long[:3]))}


def read(long_texts, caplog, **source) -> tuple:
    """The training rows and validation rows of a mixture of the long texts alone, and its source's log line."""
    from trainer.demo import VOCAB

    cfg = mixture_config([{"kind": "hf", "path": long_texts["path"], "val_path": long_texts["val"], **source}],
                         data__tokenizer=long_texts["tokenizer"], data__cache_dir=long_texts["cache_dir"],
                         model__vocab_size=VOCAB)
    with caplog.at_level(logging.INFO, logger="trainer"):
        caplog.clear()
        rows, val = load_mixture(cfg, local_rank=0)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("data source books"))
    return rows, val, line


def test_an_hf_sources_long_documents_are_split_into_windows_or_truncated_as_asked(long_texts, caplog):
    split, split_val, line = read(long_texts, caplog)
    source = split.sources[0]
    tokens, firsts = source.tokens, source.tokens.doc_starts
    lengths = np.diff(np.append(firsts, len(tokens.ids)))
    long = int((lengths > SEQ_LEN + 1).sum())
    assert long >= 10
    every_target = len(tokens.ids) - len(firsts)  # each token after its document's first
    assert int(source.targets.sum()) == every_target
    assert np.all(source.spans[:, 1] - source.spans[:, 0] <= SEQ_LEN + 1)
    assert f"{long} longer than 33 tokens split into windows" in line, line
    # A window's targets are the tokens of the document it covers, each once: the rows hold them all.
    read_back = sum(int((split[0, r][1] != -100).sum()) for r in range(split.rows_in(0)))
    assert read_back == every_target
    truncated, truncated_val, line = read(long_texts, caplog, long_documents="truncate")
    kept = int(truncated.sources[0].targets.sum())
    assert kept < every_target / 2
    assert f"{long} longer than 33 tokens truncated: {every_target - kept:,} target tokens left out" in line, line
    # Validation is cut as training is: the long validation documents give more rows split.
    assert len(split_val) > len(truncated_val)
    dropped, _, line = read(long_texts, caplog, long_documents="drop")
    assert len(dropped.sources[0].spans) == len(lengths) - long
    assert f"{long} longer than 33 tokens dropped: " in line, line


def test_a_conversation_is_not_split():
    from trainer.checks import validate
    from trainer.errors import ConfigError

    with pytest.raises(ConfigError, match=r"data.sources\[0\].long_documents: split is for hf sources"):
        validate(mixture_config([{"kind": "chat", "path": "c.jsonl", "long_documents": "split"}]))


def equal_sources(sizes: tuple[int, ...]) -> list:
    from tests.test_mixture import source

    return [source(name, n, (3, 8), 1.0) for name, n in zip(("short", "medium", "long"), sizes)]


@pytest.mark.parametrize("weights, epoch_samples", [((1, 1, 1), 1000), ((0.97, 0.03), 10), ((0.5, 0.3, 0.2), 7)])
@pytest.mark.parametrize("exhausted", [Exhausted.repeat, Exhausted.stop])  # the others size the epoch themselves
def test_the_rounding_of_the_shares_is_carried_across_epochs(weights, epoch_samples, exhausted):
    sources = equal_sources((1000, 1000, 1000)[:len(weights)])
    for s, w in zip(sources, weights):
        s.weight = float(w)
    rows = MixtureRows(sources, 128, 256, True, 1234, epoch_samples, exhausted)
    drawn = np.zeros(len(weights), dtype=np.int64)
    for epoch in range(30):
        plan = rows.plan(epoch)
        assert len(plan.source) == epoch_samples  # no source is below its share here: stop changes nothing
        drawn += np.bincount(plan.source, minlength=len(weights))
        expected = np.array(weights) / sum(weights) * epoch_samples * (epoch + 1)
        assert np.all(np.abs(drawn - expected) < 1), (epoch, drawn, expected)
    if weights == (0.97, 0.03):
        assert drawn[1] == 9  # the small source is drawn: 0.3 an epoch, 9 in 30
    # Each source's documents still come as its stream of passes: every one once before any twice.
    for i, s in enumerate(sources):
        seen = np.concatenate([rows.plan(e).document[rows.plan(e).source == i] for e in range(30)])
        n = len(s.spans)
        for p in range(len(seen) // n):
            assert sorted(seen[p * n:(p + 1) * n].tolist()) == list(range(n))


def test_a_source_of_weight_0_is_off_and_not_read(tmp_path):
    from trainer.checks import validate
    from trainer.data import check_data
    from trainer.errors import ConfigError

    (np.arange(3000) % 256).astype(np.uint16).tofile(tmp_path / "a.bin")
    cfg = mixture_config([{"kind": "tokens", "path": str(tmp_path / "a.bin")},
                          {"kind": "tokens", "path": str(tmp_path / "missing.bin"), "weight": 0}])
    validate(cfg)
    check_data(cfg, 1)  # the file of a source that is off is not looked for
    rows, _ = load_mixture(cfg, local_rank=0)
    assert rows.names == ["a"] and rows.per_epoch(0).tolist() == [len(rows.sources[0].spans)]
    with pytest.raises(ConfigError, match="data.sources: every weight is 0"):
        validate(mixture_config([{"kind": "tokens", "path": "a.bin", "weight": 0}]))


def test_weights_by_tokens_give_each_source_its_share_of_the_tokens_drawn():
    """Documents of 3-7 and of 30-59 tokens, weights 1:1: by documents the long source draws about
    ten times the short one's tokens; by tokens, the same tokens within a long document."""
    from tests.test_mixture import source
    from trainer.checks import validate
    from trainer.errors import ConfigError

    def tokens_drawn(weights_by: WeightsBy) -> np.ndarray:
        sources = [source("short", 2000, (3, 8), 1.0), source("medium", 400, (30, 60), 1.0)]
        plan = MixtureRows(sources, 128, 256, True, 1234, 1000, Exhausted.repeat, weights_by).plan(0)
        lengths = [s.spans[:, 1] - s.spans[:, 0] for s in sources]
        return np.array([lengths[i][plan.document[plan.source == i]].sum() for i in range(2)])

    short, long = tokens_drawn(WeightsBy.documents)
    assert long > 8 * short, (short, long)
    short, long = tokens_drawn(WeightsBy.tokens)
    assert abs(short - long) < 60, (short, long)
    with pytest.raises(ConfigError, match=r"data.weights_by: only read by data=mixture"):
        validate(to_config({"data": {"weights_by": "tokens"}}))
