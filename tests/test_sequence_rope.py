"""Rotary embeddings that pick their frequencies from the positions they see (Phi-3's longrope,
dynamic NTK scaling) pick them at sp=2 from the whole rows, as at sp=1 (models/hf_sequence.py,
`whole_row_rotary`). Rows of 16 tokens where the model was made for 8: the whole rows take the long
(or scaled) frequencies, while rank 0's half alone would take the short ones. On 2 gloo ranks, one
launch: logits and gradients of the model split over the ranks against the whole model's."""
from __future__ import annotations

from tests.harness import on_ranks
from tests.test_sequence_hf import sharded_against_whole

TINY = dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=1)
HALF_HEAD = 4  # head_dim 8: a rotary factor per pair of dimensions
MODELS = {
    "phi3 longrope": ("phi3", dict(max_position_embeddings=64, original_max_position_embeddings=8, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 8,
        "short_factor": [1.0] * HALF_HEAD, "long_factor": [1.0, 2.0, 4.0, 8.0]})),
    "llama dynamic": ("llama", dict(max_position_embeddings=8, rope_parameters={
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0})),
}


def model_dir(root, family: str, config: dict) -> str:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **{**TINY, **config})).save_pretrained(str(root))
    return str(root)


def against_whole(env, paths: dict[str, str]) -> dict[str, dict[str, float]]:
    return {name: sharded_against_whole(env, path) for name, path in paths.items()}


def test_position_dependent_rope_at_sp2_gives_the_whole_models_logits_and_gradients(tmp_path):
    paths = {name: model_dir(tmp_path / family, family, config) for name, (family, config) in MODELS.items()}
    found = on_ranks(2, against_whole, paths)
    off = [(name, rank, what, difference) for rank, models in found.items() for name, differences in models.items()
           for what, difference in differences.items() if not difference < 1e-5]  # plain rows and two packed documents
    assert not off, off
