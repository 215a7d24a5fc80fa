"""A mixture's validation gives each source's loss and one blended by the
weights (the mixture's own loss, as Megatron and MosaicML report it), besides the plain loss over
all held-out tokens. One short run on one rank."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tests.harness import case, on_ranks, train_cases, with_overrides


def test_the_val_record_blends_the_sources_losses_by_their_weights(tmp_path):
    rng = np.random.default_rng(0)
    # a: a running text of tokens 10..99; b: of tokens 100..199, its held-out part 3 times as long as a's
    rng.integers(10, 100, 2000).astype(np.uint16).tofile(tmp_path / "a.bin")
    rng.integers(100, 200, 6000).astype(np.uint16).tofile(tmp_path / "b.bin")
    cfg = with_overrides(case("ddp", steps=2), data__name="mixture", data__val_fraction=0.1, eval__every_steps=2,
                         model__seq_len=32, data__sources=[{"kind": "tokens", "path": str(tmp_path / "a.bin"),
                                                            "weight": 3.0},
                                                           {"kind": "tokens", "path": str(tmp_path / "b.bin")}])
    on_ranks(1, train_cases, {"run": cfg}, str(tmp_path))
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    fractions = {s["name"]: s["fraction"] for s in next(r for r in lines if r.get("event") == "sources")["sources"]}
    assert fractions == {"a": 0.75, "b": 0.25}
    val = next(r for r in lines if r.get("split") == "val")
    assert val["blended_loss"] == pytest.approx(0.75 * val["loss/a"] + 0.25 * val["loss/b"], rel=1e-12)
    # the plain loss weights b by its 3x held-out tokens instead
    assert val["loss"] == pytest.approx(0.25 * val["loss/a"] + 0.75 * val["loss/b"], rel=1e-5)
    assert abs(val["blended_loss"] - val["loss"]) > 1e-4
