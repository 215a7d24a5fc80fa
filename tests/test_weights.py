"""Every weight right, in process (no ranks): what a pretrained folder may hold, and fresh
initialisation that gives transformers' own `from_config` spread, parameter by parameter."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.harness import refusal

FRESH_INIT_FAMILIES = {
    # 12 layers: GPT-2's residual projections are scaled by 1/sqrt(2 x 12) from their parent module.
    "gpt2": dict(n_layer=12, n_embd=64, n_head=4, vocab_size=256, n_positions=64, bos_token_id=0, eos_token_id=0),
    "llama": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=256),
    "gpt_neox": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                     vocab_size=256),
}


@pytest.mark.parametrize("family", list(FRESH_INIT_FAMILIES))
def test_fresh_init_has_the_spread_of_transformers_from_config(family):
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.models.weights import InitWeights, allocate, fill, params_on_meta

    config = AutoConfig.for_model(family, **FRESH_INIT_FAMILIES[family])
    torch.manual_seed(0)
    theirs = dict(AutoModelForCausalLM.from_config(config).named_parameters())
    with params_on_meta():
        ours = AutoModelForCausalLM._model_mapping[type(config)](config)
    allocate(ours, torch.device("cpu"))
    fill(ours, InitWeights(ours, seed=0))
    for name, p in ours.named_parameters():
        mine, ref = p.detach(), theirs[name].detach()
        if ref.std() == 0:  # a constant (norm weights, biases): the same constant
            assert torch.equal(mine, ref), name
        else:
            assert mine.std() / ref.std() == pytest.approx(1, abs=0.1), (name, mine.std(), ref.std())
            assert abs(mine.mean() - ref.mean()) < 0.3 * ref.std(), name


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from examples.tiny_hf import make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("weights") / "qwen2", "qwen2", weights=True, seed=1)


def variant(model_dir, tmp_path, change_tensors=None, change_config=None):
    """A copy of the pretrained folder with its tensors and/or config.json changed."""
    from safetensors.torch import load_file, save_file

    out = tmp_path / "variant"
    shutil.copytree(model_dir, out)
    if change_tensors:
        tensors = load_file(out / "model.safetensors")
        change_tensors(tensors)
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    if change_config:
        config = json.loads((out / "config.json").read_text())
        change_config(config)
        (out / "config.json").write_text(json.dumps(config))
    return out


def refused(path, tmp_path) -> str:
    return refusal(tmp_path / "run", "model=hf", f"model.path={path}", "data=synthetic")


def test_a_key_the_model_does_not_take_is_named(model_dir, tmp_path):
    def extra(tensors):
        tensors["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(4, 4)

    message = refused(variant(model_dir, tmp_path, extra), tmp_path)
    assert "neither a parameter nor a persistent buffer" in message and "model.layers.0.mlp.extra_proj.weight" \
        in message, message


@pytest.mark.parametrize("how", ["scale_inv", "int8", "quantization_config"])
def test_quantised_weights_are_refused(model_dir, tmp_path, how):
    name = "model.layers.0.mlp.down_proj.weight"

    def fp8_scales(tensors):
        tensors[name.replace("weight", "weight_scale_inv")] = torch.ones(1)

    def int8(tensors):
        tensors[name] = tensors[name].to(torch.int8)

    def config(c):
        c["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3"}

    changes = {"scale_inv": (fp8_scales, None), "int8": (int8, None), "quantization_config": (None, config)}[how]
    message = refused(variant(model_dir, tmp_path, *changes), tmp_path)
    assert "quantis" in message and "float weights only" in message, message


def test_the_unchanged_folder_is_accepted(model_dir, tmp_path):
    with pytest.raises(AssertionError, match="not refused"):
        refused(model_dir, tmp_path)
