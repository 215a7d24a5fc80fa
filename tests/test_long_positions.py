"""`model.seq_len` past max_position_embeddings is refused only where the model looks positions
up in an embedding, seen by what the model does (hf.position_embedding), not by an embedding's row
count: a Mistral-7B-v0.3-like model, whose vocabulary is as large as its positions, trains past them
(with a warning); GPT-2's and OPT's learned positions are refused in one line. One process, tiny models."""
from __future__ import annotations

import pytest

POSITIONS = 64
MODELS = {  # family -> its config: each with POSITIONS positions
    "mistral": dict(vocab_size=POSITIONS, max_position_embeddings=POSITIONS, hidden_size=32, intermediate_size=64,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    "gpt2": dict(vocab_size=512, n_positions=POSITIONS, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0),
    "opt": dict(vocab_size=512, max_position_embeddings=POSITIONS, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                num_attention_heads=4, word_embed_proj_dim=32, pad_token_id=1, bos_token_id=0, eos_token_id=0),
}
REFUSED = {"gpt2": "transformer.wpe", "opt": "model.decoder.embed_positions"}


def resolved(tmp_path, family: str):
    from transformers import AutoConfig

    from trainer.config import ModelConfig
    from trainer.models import hf

    AutoConfig.for_model(family, **MODELS[family]).save_pretrained(str(tmp_path / family))
    return hf.resolve(ModelConfig(name="hf", kind="hf", path=str(tmp_path / family), seq_len=2 * POSITIONS))


def test_a_vocabulary_as_large_as_the_positions_is_not_learned_positions(tmp_path, caplog):
    cfg = resolved(tmp_path, "mistral")  # rotary: trains past its positions, with a warning
    assert cfg.seq_len == 2 * POSITIONS
    assert f"longer than the {POSITIONS} positions (max_position_embeddings)" in caplog.text


@pytest.mark.parametrize("family", list(REFUSED))
def test_learned_positions_are_refused_past_their_rows(tmp_path, family):
    from trainer.errors import ConfigError

    with pytest.raises(ConfigError) as refused:
        resolved(tmp_path, family)
    assert str(refused.value) == (
        f"model.seq_len: {2 * POSITIONS} is longer than this {family} model's {POSITIONS} positions, which are "
        f"learned ({REFUSED[family]}: one row per position); use model.seq_len <= {POSITIONS}")
