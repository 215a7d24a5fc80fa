"""Hub data set names for data=preference and for a mixture's sources, resolved to
the Hugging Face cache's snapshot as data=hf|chat's are (offline, from a cache laid out by hand)."""
from __future__ import annotations

from tests.test_first_contact import hub_cache


def test_preference_and_mixture_source_hub_names_resolve_to_the_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants
    from omegaconf import OmegaConf

    from trainer.hub import resolve_names

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    pairs = hub_cache(tmp_path / "hf", "tiny-org/pairs", "dataset", {"train.jsonl": "{}\n"})
    chats = hub_cache(tmp_path / "hf", "tiny-org/chats", "dataset", {"train.jsonl": "{}\n"})
    cfg = OmegaConf.create({"model": {"kind": "reference"}, "data": {
        "name": "preference", "path": "tiny-org/pairs", "val_path": "tiny-org/pairs", "tokenizer": None,
        "revision": None}})
    resolve_names(cfg)
    assert (cfg.data.path, cfg.data.val_path) == (str(pairs), str(pairs))
    mixture = OmegaConf.create({"model": {"kind": "reference"}, "data": {
        "name": "mixture", "tokenizer": None, "revision": None,
        "sources": [{"kind": "chat", "path": "tiny-org/chats", "val_path": None}, {"kind": "text", "path": None}]}})
    resolve_names(mixture)
    assert mixture.data.sources[0].path == str(chats) and mixture.data.sources[1].path is None
