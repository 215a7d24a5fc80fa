"""The check before any rank starts runs every layer type a Hugging Face model has, not only
its first layer's (hf.small_builder keeps the first layer of each type): a sliding window in later
layers only (Qwen2 with use_sliding_window past max_window_layers) is refused at sp > 1, in one line."""
from __future__ import annotations

import pytest

from tests.test_sequence_hf import SEQ, TINY, family_dir


def test_the_probe_keeps_one_layer_of_each_type():
    from types import SimpleNamespace

    from trainer.models.hf import first_of_each_layer_type

    gpt_oss = SimpleNamespace(layer_types=["sliding_attention", "full_attention"] * 3)
    qwen2 = SimpleNamespace(layer_types=["full_attention"] * 2 + ["sliding_attention"] * 4)
    assert first_of_each_layer_type(gpt_oss) == [0, 1]
    assert first_of_each_layer_type(qwen2) == [0, 2]
    assert first_of_each_layer_type(SimpleNamespace()) == [0]


def test_a_sliding_window_in_later_layers_only_is_refused_before_any_rank_starts(tmp_path):
    from trainer.config import ModelConfig
    from trainer.errors import ConfigError
    from trainer.models.checks import check_hf_sequence_parallel

    # layers 0 and 1 full attention, 2 and 3 a window of 8 tokens, rows of SEQ = 16
    config = {**TINY, "num_hidden_layers": 4, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}
    cfg = ModelConfig(name="hf", kind="hf", path=str(family_dir(tmp_path, "qwen2", config)), seq_len=SEQ)
    with pytest.raises(ConfigError) as refused:
        check_hf_sequence_parallel(cfg, 2)
    assert "sliding window of 8 tokens is shorter than model.seq_len=16" in str(refused.value)
    assert "\n" not in str(refused.value)
