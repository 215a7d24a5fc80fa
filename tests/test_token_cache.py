"""The tokenised-data cache (data.cache_dir): ranks wait for the rank that tokenises however long it
takes, beyond the collective timeout; an entry is keyed by the tokenizer's own files, not the
folder around them; a writer killed midway leaves a partial entry the next run continues to the
same bytes; two nodes sharing the cache dir tokenise once."""
from __future__ import annotations

import json
import logging
import os
import shutil
import time

import pytest

from tests.harness import case, on_ranks


def hf_data_config(hf_assets, cache) -> dict:
    cfg = case("ddp", data__name="hf", data__path=str(hf_assets.jsonl), data__tokenizer=str(hf_assets.tokenizer),
               data__cache_dir=str(cache))
    cfg["model"] = {"name": "hf", "kind": "hf", "path": str(hf_assets.config_only["qwen2"]), "seq_len": 32,
                    "vocab_size": 512}
    return cfg


def source_of(cfg: dict):
    from trainer.config import to_config
    from trainer.data.read import the_source, token_cache

    c = to_config(cfg)
    return token_cache(c, the_source(c), c.data.path, "data.path")


def slow_tokenising_rank_0_under_a_1_s_collective_timeout(env, cfg):
    """Rank 0 tokenises for longer than the collective timeout while rank 1 waits."""
    from datetime import timedelta

    import torch.distributed as dist

    from trainer.config import to_config
    from trainer.data import load_data
    from trainer.data.tokenized import TokenizedText

    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=1))
    tokenise = TokenizedText._tokenise

    def slowly(self):
        time.sleep(3)
        tokenise(self)

    TokenizedText._tokenise = slowly
    train, _ = load_data(to_config(cfg), env.local_rank)
    dist.barrier()
    return len(train)


@pytest.mark.slow
def test_ranks_wait_for_tokenising_outside_the_collective_timeout(hf_assets, tmp_path):
    lengths = on_ranks(2, slow_tokenising_rank_0_under_a_1_s_collective_timeout,
                       hf_data_config(hf_assets, tmp_path / "cache"))
    assert lengths[0] == lengths[1] > 0


def test_the_cache_key_is_the_tokenizer_not_the_folder_around_it(hf_assets, tmp_path):
    folder = tmp_path / "tok"
    shutil.copytree(hf_assets.tokenizer, folder)
    cfg = hf_data_config(hf_assets, tmp_path / "cache")
    cfg["data"]["tokenizer"] = str(folder)
    key = source_of(cfg).dir.name
    (folder / "model.safetensors").write_bytes(b"weights trained further")
    assert source_of(cfg).dir.name == key
    (folder / "tokenizer.json").write_text((folder / "tokenizer.json").read_text() + " ")  # other content
    assert source_of(cfg).dir.name != key


def test_a_partial_cache_is_continued_and_gives_the_same_entry(hf_assets, tmp_path, monkeypatch, caplog):
    from trainer.data import tokenized

    monkeypatch.setattr(tokenized, "BATCH_DOCUMENTS", 100)
    load = tokenized.load_tokenizer
    calls = []

    def dies_in_the_fourth_batch(*args):
        tokenizer = load(*args)

        def call(texts, **kwargs):
            calls.append(len(texts))
            if len(calls) == 4:
                raise KeyboardInterrupt  # the writer is killed
            return type(tokenizer).__call__(tokenizer, texts, **kwargs)
        return type("Dying", (), {"__call__": staticmethod(call), "eos_token_id": tokenizer.eos_token_id,
                                  "pad_token_id": tokenizer.pad_token_id, "__len__": lambda self: len(tokenizer)})()

    source = source_of(hf_data_config(hf_assets, tmp_path / "cache"))
    monkeypatch.setattr(tokenized, "load_tokenizer", dies_in_the_fourth_batch)
    with pytest.raises(KeyboardInterrupt):
        source.prepare()
    assert not source.ready and json.loads((source._tmp / "progress.json").read_text())["documents"] == 300
    monkeypatch.setattr(tokenized, "load_tokenizer", load)
    with caplog.at_level(logging.INFO, logger="trainer"):
        source.prepare()
    assert "continuing after 300" in caplog.text
    fresh = source_of(hf_data_config(hf_assets, tmp_path / "fresh"))
    fresh.prepare()
    for name in ("ids.bin", "doc_starts.npy", "meta.json"):
        assert (source.dir / name).read_bytes() == (fresh.dir / name).read_bytes() or name == "meta.json", name
    assert not list(source.dir.parent.glob(".*")), "no temporary dir, no lock left"


def tokenise_and_say(cfg, tokenised_by):
    from trainer.data.tokenized import TokenizedText

    tokenise = TokenizedText._tokenise

    def noted(self):
        with open(tokenised_by, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(1)  # long enough for the other process to find the lock taken
        tokenise(self)

    TokenizedText._tokenise = noted
    source = source_of(cfg)
    source.prepare()
    return source.ready


@pytest.mark.slow
def test_two_nodes_sharing_a_cache_dir_tokenise_once(hf_assets, tmp_path):
    import multiprocessing

    cfg = hf_data_config(hf_assets, tmp_path / "cache")
    # spawn: a fork of this many-threaded process can deadlock in the child (seen: a futex, forever)
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        ready = pool.starmap(tokenise_and_say, [(cfg, tmp_path / "tokenised_by")] * 2)
    assert ready == [True, True]
    assert len((tmp_path / "tokenised_by").read_text().splitlines()) == 1
