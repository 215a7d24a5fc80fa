"""`objective.precompute_ref`'s table. Its key follows every split's files (content by size
and mtime), the tokenizer's files and the template; rank 0's cache decides for every rank."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from tests.harness import case, on_ranks, with_overrides
from tests.test_dpo import pair_tokens
from trainer.config import to_config
from trainer.data.preference import PairRows
from trainer.training.dpo_reference import cached_tables, reference_key


def test_the_reference_key_follows_the_validation_file_edits_in_place_the_tokenizer_and_template(tmp_path):
    files = {name: tmp_path / name for name in ("train.jsonl", "val.jsonl", "other_val.jsonl", "t.jinja")}
    for f in files.values():
        f.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n')
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text("{}")

    def key(**data) -> str:
        settings = {"data__name": "preference", "data__path": str(files["train.jsonl"]),
                    "data__tokenizer": str(tokenizer), "objective__name": "dpo", "objective__precompute_ref": True}
        return reference_key(to_config(with_overrides(case("ddp"), **settings, **data)), None)

    first = key(data__val_path=str(files["val.jsonl"]))
    assert key(data__val_path=str(files["val.jsonl"])) == first
    assert key(data__val_path=str(files["other_val.jsonl"])) != first, "another validation file"
    assert key(data__val_path=str(files["val.jsonl"]), data__chat_template=str(files["t.jinja"])) != first
    files["train.jsonl"].write_text('{"prompt": "a", "chosen": "bb", "rejected": "c"}\n')
    assert key(data__val_path=str(files["val.jsonl"])) != first, "the training file edited in place"
    edited = key(data__val_path=str(files["val.jsonl"]))
    (tokenizer / "tokenizer.json").write_text('{"changed": 1}')
    assert key(data__val_path=str(files["val.jsonl"])) != edited, "the tokenizer's files"


class NoForward(torch.nn.Module):
    """A model the test must not run: the table is read, not computed."""

    def forward(self, ids, position_ids=None):
        raise AssertionError(f"rank {os.environ['RANK']} ran the reference's forwards while rank 0 read its file")


def tables_on_nodes(env, root: str) -> torch.Tensor:
    """Each rank's cache on its own node: only rank 0's holds the table."""
    from trainer.strategies import build_strategy

    strategy = build_strategy(to_config(case("ddp")), env)
    rows = PairRows(pair_tokens([(2, 3, 2), (3, 4, 4)]), 8, 64, pad_id=0)
    entry = Path(root) / f"node{env.rank}"
    tables = cached_tables(entry, NoForward(), strategy, {"train": rows}, micro_batch_size=2)
    return tables["train"]


def test_rank_0s_cached_table_serves_every_rank_even_where_their_cache_lacks_it(tmp_path):
    (tmp_path / "node0").mkdir()
    table = torch.tensor([-1.5, -2.25, -3.0, -4.125], dtype=torch.float64)
    torch.save(table, tmp_path / "node0" / "train.pt")
    got = on_ranks(2, tables_on_nodes, str(tmp_path))
    assert torch.equal(got[0], table) and torch.equal(got[1], table), got
