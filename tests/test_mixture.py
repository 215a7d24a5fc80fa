"""`data=mixture`. Sources drawn by weight, exactly, in a fresh order every epoch that is
the same at any world size and continues exactly on resume; counts per source in the step records."""
from __future__ import annotations

import collections
import json

import numpy as np
import pytest

from tests.harness import (
    LOSS_RTOL,
    assert_close,
    assert_resumes,
    case,
    losses,
    on_ranks,
    records,
    refusal,
    resuming,
    saving,
    train_cases,
    with_overrides,
)
from trainer.config import Exhausted, SourceKind
from trainer.data import BatchStream
from trainer.data.mixture import MixtureRows
from trainer.data.mixture_sources import Source, target_counts
from trainer.data.sampling import split_in_proportion
from trainer.data.sources import Tokens

SEQ_LEN = 128
MARKERS = {"short": 1, "medium": 2, "long": 3}  # the first token of each document tells its source


def source(name: str, n_docs: int, lengths: tuple[int, int], weight: float) -> Source:
    """A source of `n_docs` documents of lengths in [lengths): its marker, then tokens 10..99."""
    rng = np.random.default_rng(MARKERS[name])
    sizes = rng.integers(*lengths, n_docs)
    ids = np.concatenate([[MARKERS[name], *rng.integers(10, 100, n - 1)] for n in sizes]).astype(np.uint16)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    tokens, spans = Tokens(ids, starts), np.stack([starts, starts + sizes], axis=1)
    return Source(name, SourceKind.hf, weight, tokens, spans, target_counts(tokens, spans), pad_id=0)


def three_sources(weights=(0.6, 0.3, 0.1), sizes=(3000, 800, 200)) -> list[Source]:
    """Documents of 3-7, 30-59 and 100-128 tokens."""
    return [source("short", sizes[0], (3, 8), weights[0]), source("medium", sizes[1], (30, 60), weights[1]),
            source("long", sizes[2], (100, 129), weights[2])]


def mixture(seed: int = 1234, packing: bool = True, exhausted: Exhausted = Exhausted.repeat, epoch_samples: int = 0,
            **kwargs) -> MixtureRows:
    return MixtureRows(three_sources(**kwargs), SEQ_LEN, 256, packing, seed, epoch_samples, exhausted)


def documents_in(batch) -> list[tuple[int, ...]]:
    """The documents of a micro-batch of packed rows, as token tuples (position ids restart at each)."""
    x, _, position_ids = (t.tolist() for t in batch)
    docs = []
    for row, positions in zip(x, position_ids):
        starts = [i for i, p in enumerate(positions) if p == 0] + [len(row)]
        docs += [tuple(row[a:b]) for a, b in zip(starts, starts[1:]) if row[a] in MARKERS.values()]
    return docs


def epoch_documents(stream: BatchStream) -> list[tuple[int, ...]]:
    """Every document this rank reads in the rest of its epoch, in order."""
    epoch, done, docs = stream.epoch, stream.samples_consumed // (stream.per_step * stream.world_size), []
    if done == stream.steps_in(epoch):  # at an epoch's end: the next step starts the next one
        epoch, done = epoch + 1, 0
    for _ in range(stream.steps_in(epoch) - done):
        for batch in stream.next_step():
            docs += documents_in(batch)
    return docs


def test_allocation_is_exact():
    assert split_in_proportion(10, np.array([0.6, 0.3, 0.1])).tolist() == [6, 3, 1]
    assert split_in_proportion(7, np.array([1.0, 1.0, 1.0])).tolist() == [3, 2, 2]  # the earlier source takes a tie
    assert split_in_proportion(100, np.array([0.7, 0.2, 0.1])).tolist() == [70, 20, 10]
    for total in range(1, 50):
        counts = split_in_proportion(total, np.array([0.55, 0.3, 0.15]))
        assert counts.sum() == total and np.all(np.abs(counts - total * np.array([0.55, 0.3, 0.15])) < 1)


def test_each_sources_share_of_an_epoch_is_its_weight():
    rows = mixture()
    stream = BatchStream(rows, 4, 2, 0, 1, seed=1234)
    docs = epoch_documents(stream)
    measured = collections.Counter(doc[0] for doc in docs)
    shares = {name: measured[marker] / len(docs) for name, marker in MARKERS.items()}
    for name, weight in zip(MARKERS, (0.6, 0.3, 0.1)):
        assert abs(shares[name] - weight) <= 0.01 * weight, shares
    # The counts in the step records are what the rows held: documents, and their target tokens.
    counts = stream.counts()
    assert counts["samples_by_source"] == {name: measured[marker] for name, marker in MARKERS.items()}
    # A document of n tokens is n - 1 inputs in its row, each with its target (hf: every token is one).
    read = collections.Counter()
    for doc in docs:
        read[doc[0]] += len(doc)
    assert counts["tokens_by_source"] == {name: read[marker] for name, marker in MARKERS.items()}
    # Packed across the mixture: rows hold whole documents of several sources.
    mixed = [len({doc[0] for doc in documents_in([t[None] for t in rows[0, r]])}) > 1 for r in range(100)]
    assert sum(mixed) > 50, sum(mixed)
    # The long source's documents are 100-128 tokens, 15x the short one's: its share of the tokens is far from 0.1.
    tokens = counts["tokens_by_source"]
    assert tokens["long"] / sum(tokens.values()) > 0.3


def test_epochs_come_in_new_orders_and_the_same_for_the_same_seed():
    stream = BatchStream(mixture(), 4, 2, 0, 1, seed=1234)
    first, second = epoch_documents(stream), epoch_documents(stream)
    assert stream.epoch == 1 and first != second
    again = BatchStream(mixture(), 4, 2, 0, 1, seed=1234)
    assert epoch_documents(again) == first and epoch_documents(again) == second
    assert epoch_documents(BatchStream(mixture(seed=7), 4, 2, 0, 1, seed=7)) != first


def test_a_source_drawn_below_its_size_shows_new_documents_each_epoch_and_repeats_only_after_all():
    # 1000 documents an epoch: the short source gives 600 of its 3000, the long one 100 of its 200.
    rows = mixture(epoch_samples=1000)
    drawn = [rows.plan(e) for e in range(6)]
    long = [set(p.document[p.source == 2].tolist()) for p in drawn]
    assert len(long[0]) == 100 and not long[0] & long[1] and long[0] | long[1] == set(range(200))
    short = [p.document[p.source == 0] for p in drawn[:5]]
    assert sorted(np.concatenate(short).tolist()) == list(range(3000))  # every one, once, in five epochs


def test_a_source_that_runs_out_repeats_or_stops():
    # 2500 documents an epoch: 0.1 of them, 250, from the long source, which has 200.
    repeat, stop = mixture(epoch_samples=2500), mixture(epoch_samples=2500, exhausted=Exhausted.stop)
    long_repeat = repeat.plan(0).document[repeat.plan(0).source == 2].tolist()
    assert len(long_repeat) == 250 and sorted(long_repeat[:200]) == list(range(200))  # all, then again
    assert sorted(collections.Counter(long_repeat).values()) == [1] * 150 + [2] * 50
    long_stop = stop.plan(0).document[stop.plan(0).source == 2]
    assert sorted(long_stop.tolist()) == list(range(200))
    assert len(stop.plan(0).source) == 1500 + 750 + 200  # its share ends at its documents; the others keep theirs


def steps_of(stream: BatchStream, steps: int) -> list[tuple[int, int]]:
    """The (epoch, row) addresses this rank reads in the next `steps` steps."""
    out = []
    for _ in range(steps):
        stream.next_step()
        out += [i for micro in stream.last_indices for i in micro]
    return out


def test_the_rows_are_the_same_at_any_world_size_and_resume_exactly_at_another():
    # Global batch 16: 1 rank x 8 x 2, 2 ranks x 4 x 2, 4 ranks x 4 x 1; about 1,050 rows an epoch.
    one = BatchStream(mixture(), 8, 2, 0, 1, seed=1234)
    straight = steps_of(one, 2 * one.steps_in(0) + 5)  # into the third epoch
    two = [BatchStream(mixture(), 4, 2, r, 2, seed=1234) for r in range(2)]
    stopped = [steps_of(s, one.steps_in(0) + 20) for s in two]
    state = two[0].state_dict()
    assert state["epoch"] == 1 and 0 < state["samples_consumed"] and state == two[1].state_dict()
    four = [BatchStream(mixture(), 4, 1, r, 4, seed=1234) for r in range(4)]
    for s in four:
        s.load_state_dict(state)
    resumed = [steps_of(s, len(straight) // 16 - (one.steps_in(0) + 20)) for s in four]
    per_step = lambda shards, width: [  # noqa: E731 (each step's global rows, sorted)
        sorted(i for shard in shards for i in shard[k * width:(k + 1) * width]) for k in range(len(shards[0]) // width)]
    assert per_step([straight], 16) == per_step(stopped, 8) + per_step(resumed, 4)
    seen = [i for shard in stopped + resumed for i in shard]
    assert len(seen) == len(set(seen)) == len(straight)  # none twice, none skipped
    assert four[0].counts() == one.counts()  # the counts per source go on from the saved ones


def test_the_data_fingerprint_covers_the_sources_and_weights():
    from trainer.checkpoint.resume import data_changes
    from trainer.config import to_config
    from trainer.data import data_fingerprint

    def cfg(weights, val_path=None):
        return to_config(with_overrides(case("ddp"), data__name="mixture", data__sources=[
            {"kind": "tokens", "path": "a.bin", "weight": weights[0], "val_path": val_path},
            {"kind": "tokens", "path": "b.bin", "weight": weights[1]}]))

    saved = {"fingerprint": json.loads(json.dumps(data_fingerprint(cfg((0.7, 0.3)))))}  # as a checkpoint holds it
    assert data_changes(saved, cfg((0.7, 0.3))) == []
    assert data_changes(saved, cfg((0.7, 0.3), val_path="a_val.bin")) == []  # held-out data are not the samples
    assert data_changes(saved, cfg((0.5, 0.5)))[0].startswith("data.sources=")


@pytest.fixture(scope="module")
def token_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("token_files")
    np.arange(2000, dtype=np.uint16).__mod__(256).astype(np.uint16).tofile(root / "a.bin")
    np.arange(3000, dtype=np.uint16).__mod__(200).astype(np.uint16).tofile(root / "b.bin")
    np.zeros(10, dtype=np.uint16).tofile(root / "tiny.bin")
    (root / "conf" / "data").mkdir(parents=True)
    (root / "conf" / "data" / "mine.yaml").write_text("name: mixture\nsources:\n  - {kind: tokens, paht: a.bin}\n")
    return root


BAD_MIXTURES = {
    "no sources": (["data=mixture"], "data.sources: data=mixture needs its sources"),
    "unknown kind": (["data=mixture", "data.sources=[{kind:parquet,path:a.bin}]"],
                     "data.sources[0].kind: allowed values: text, tokens, hf, chat; got parquet"),
    "unknown key": (["data=mixture", "data.sources=[{kind:tokens,paht:a.bin}]"],
                    "data.sources[0].paht: not a key of a source"),
    "key of another kind": (["data=mixture", "data.sources=[{kind:tokens,path:{root}/a.bin,text_field:body}]"],
                            "data.sources[0].text_field: not a key of a kind=tokens source"),
    "weight": (["data=mixture", "data.sources=[{kind:tokens,path:{root}/a.bin,weight:-1}]"],
               "data.sources[0].weight: must be >= 0 (0: the source is off), got -1"),
    "duplicate names": (["data=mixture", "data.sources=[{kind:tokens,path:{root}/a.bin},{kind:tokens,path:x/a.bin}]"],
                        "data.sources[1].name: 'a' names two sources"),
    "no documents": (["data=mixture", "data.sources=[{kind:tokens,path:{root}/a.bin},{kind:tokens,path:{root}/tiny.bin}]"],
                     "data.sources[1].path: {root}/tiny.bin holds fewer than model.seq_len + 1 = 65 tokens: a source "
                     "with no documents"),
    "mixed tokenizers": (["data=mixture", "data.sources=[{kind:text},{kind:hf,path:a.jsonl}]"],
                         "data.sources: mixed tokenizers"),
    "a key in your own yaml": (["--config-dir", "{root}/conf", "data=mine"],
                               "{root}/conf/data/mine.yaml: data.sources[0].paht: not a key of a source"),
    "sources elsewhere": (["data.sources=[{kind:text}]"], "data.sources: only read by data=mixture, not data=text"),
    "a path of its own": (["data=mixture", "data.path=a.bin", "data.sources=[{kind:text}]"],
                          "data.path: data=mixture reads each source's own"),
}


@pytest.mark.parametrize("name", list(BAD_MIXTURES))
def test_bad_mixtures_are_refused_in_one_line_before_any_work(token_files, tmp_path, name):
    overrides, expected = BAD_MIXTURES[name]
    message = refusal(tmp_path, *(o.replace("{root}", str(token_files)) for o in overrides))
    assert expected.replace("{root}", str(token_files)) in message, message


# -- multi-process runs: every strategy at 2 ranks against 1, and a resume at another world size --------------

@pytest.fixture(scope="module")
def chat_and_text(tmp_path_factory):
    """One tokenizer (ChatML's markers, a chat template) for a text source and a chat source."""
    from types import SimpleNamespace

    from trainer.demo import conversations, documents, train_chat_tokenizer, write_jsonl, write_rows

    root = tmp_path_factory.mktemp("mixture")
    texts = documents()
    return SimpleNamespace(tokenizer=train_chat_tokenizer(root / "tokenizer", texts), cache=root / "cache",
                           text=write_jsonl(root / "licenses.jsonl", texts),
                           chat=write_rows(root / "chat.jsonl", conversations(texts, n=200)))


def mixture_case(data, strategy: str, **overrides) -> dict:
    """Text and chat packed together into rows of 128 tokens, 0.7/0.3, 80 documents an epoch (4 steps
    of global batch 16), validation per source every 4 steps."""
    from trainer.demo import VOCAB

    return with_overrides(case(strategy), **{
        "model__vocab_size": VOCAB, "data__name": "mixture", "data__tokenizer": str(data.tokenizer),
        "data__cache_dir": str(data.cache), "data__epoch_samples": 80, "data__val_fraction": 0.05,
        "model__seq_len": 128, "eval__every_steps": 4, "train__micro_batch_size": 8,
        "data__sources": [{"kind": "hf", "path": str(data.text), "weight": 0.7},
                          {"kind": "chat", "path": str(data.chat), "weight": 0.3}], **overrides})


STRATEGIES = ("ddp", "fsdp", "zero1", "zero2", "zero3")


@pytest.fixture(scope="module")
def mixture_runs(chat_and_text, tmp_path_factory):
    out = tmp_path_factory.mktemp("mixture_runs")
    data, ckpt = chat_and_text, out / "ckpt"
    # zero2's run saves at step 6; the 1-rank launch resumes it there (mid-epoch: epoch 1) under
    # another strategy, at the same global batch, after its baseline
    on_ranks(2, train_cases, {**{s: mixture_case(data, s) for s in STRATEGIES},
                              "zero2": saving(mixture_case(data, "zero2"), ckpt, 6)}, str(out))
    on_ranks(1, train_cases, {"baseline": mixture_case(data, "ddp", train__micro_batch_size=16),
                              "resumed": resuming(mixture_case(data, "fsdp", train__micro_batch_size=16), ckpt, 6)},
             str(out))
    return {name: records(out / name) for name in ("baseline", *STRATEGIES, "resumed")}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_at_two_ranks_gives_the_one_rank_losses(mixture_runs, strategy):
    base, runs = mixture_runs["baseline"], mixture_runs[strategy]
    assert base[-1]["epoch"] >= 1, "the runs must cross an epoch"
    train = [r for r in runs if "split" not in r]
    assert_close(losses(train), losses(r for r in base if "split" not in r), strategy)
    for key in ("samples_by_source", "tokens_by_source"):
        assert [r[key] for r in train] == [r[key] for r in base if "split" not in r], key
    val = [r for r in runs if "split" in r]
    assert [r["step"] for r in val] == [4, 8]
    for name in ("loss", "loss/licenses", "loss/chat"):
        assert_close([r[name] for r in val], [r[name] for r in base if "split" in r], f"{strategy} {name}")


@pytest.mark.slow
def test_the_step_records_count_each_sources_documents_and_target_tokens(mixture_runs):
    train = [r for r in mixture_runs["baseline"] if "split" not in r]
    for before, after in zip(train, train[1:]):
        for key in ("samples_by_source", "tokens_by_source"):
            assert all(after[key][s] >= before[key][s] for s in ("licenses", "chat")), key
    assert all(sum(r["tokens_by_source"].values()) == r["tokens"] for r in train)
    samples = train[-1]["samples_by_source"]
    assert abs(samples["licenses"] / sum(samples.values()) - 0.7) < 0.05, samples


@pytest.mark.slow
def test_a_resume_at_another_strategy_and_world_size_continues_exactly(mixture_runs):
    resumed, saved = mixture_runs["resumed"], mixture_runs["zero2"]
    assert_resumes(resumed, saved, at=6, rtol=LOSS_RTOL)
    for key in ("samples_by_source", "tokens_by_source", "epoch"):
        assert [r[key] for r in resumed if "split" not in r] == [r[key] for r in saved if "split" not in r][6:], key


def test_a_sources_own_validation_data_counts_as_validation_data():
    from trainer.checks import validate
    from trainer.config import to_config
    from trainer.errors import ConfigError

    def early_stop(val_path):
        return to_config(with_overrides(case("ddp"), data__name="mixture", eval__early_stop_patience=2, data__sources=[
            {"kind": "tokens", "path": "a.bin", "val_path": val_path}, {"kind": "tokens", "path": "b.bin"}]))

    validate(early_stop("a_val.bin"))
    with pytest.raises(ConfigError, match="there is no validation data"):
        validate(early_stop(None))
