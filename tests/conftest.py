"""Shared, built once per test session: tiny Hugging Face models, a tokenizer, text data."""
from __future__ import annotations

from types import SimpleNamespace

import pytest


@pytest.fixture(scope="session")
def hf_assets(tmp_path_factory):
    from examples.tiny_hf import FAMILIES, documents, make_model_dir, train_tokenizer, write_jsonl

    root = tmp_path_factory.mktemp("hf")
    docs = documents()
    tokenizer = train_tokenizer(root / "tokenizer", docs)
    return SimpleNamespace(
        root=root, docs=docs, tokenizer=tokenizer,
        jsonl=write_jsonl(root / "train.jsonl", docs),
        cache=root / "cache",
        # from config.json only, and with saved weights + the tokenizer
        config_only={f: make_model_dir(root / f"{f}_config", f, weights=False) for f in FAMILIES},
        pretrained={f: make_model_dir(root / f"{f}_weights", f, weights=True, tokenizer=tokenizer, seed=1)
                    for f in FAMILIES},
    )
