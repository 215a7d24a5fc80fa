"""docs/settings.md is `python -m trainer.settings`'s output: every key of the schema is on it with a
meaning, and it is regenerated from the code as it stands (a key added, renamed or re-commented
without regenerating the page fails here)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from trainer import settings
from trainer.config import known_keys

PAGE = Path(__file__).resolve().parent.parent / "docs" / "settings.md"
REGENERATE = "regenerate it: python -m trainer.settings > docs/settings.md"


def table_rows(text: str) -> dict[str, list[str]]:
    """`key` -> its row's cells, from the page's tables of settings."""
    out = {}
    for line in text.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) == 4 and re.fullmatch(r"`[\w.]+`", cells[0]):
            out[cells[0].strip("`")] = cells
    return out


@pytest.fixture(scope="module")
def generated() -> str:
    return settings.page()


def test_the_page_is_the_generated_one(generated):
    assert PAGE.read_text() == generated, f"docs/settings.md is stale: {REGENERATE}"


def test_every_setting_has_a_row_with_type_default_and_meaning(generated):
    rows = table_rows(generated)
    keys = [k for k in known_keys() if not k.startswith("model.") or k.removeprefix("model.") != "args"]
    missing = [k for k in keys if k not in rows]
    assert not missing, f"settings with no row: {missing}"
    assert len(rows) >= 80, len(rows)  # the parser above found the tables
    unexplained = [k for k, (_, kind, default, what) in rows.items() if not (kind and default and what)]
    assert not unexplained, ("settings without a meaning: add a comment on the field in trainer/config.py, "
                             f"then {REGENERATE}: {unexplained}")


def test_enum_values_and_group_defaults_are_read_from_the_code(generated):
    rows = table_rows(generated)
    assert rows["train.precision"][1] == "one of `bf16`, `fp16`, `fp32`"
    assert rows["model.seq_len"][2] == "`64`"  # model=tiny's, the default preset, not the schema's
    assert rows["data.packing"][2] == "`true`"
    assert "`wsd`: warmup-stable-decay" in rows["optim.schedule"][3]  # the enum value's comment
    assert "| `strategy=ddp` (default) |" in generated
