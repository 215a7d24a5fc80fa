"""The weights a run starts from. Fresh ones have the spread transformers gives the same config; a
pretrained folder is read whole (persistent buffers too) or refused naming what it cannot take: a
key that is neither a parameter nor a persistent buffer, quantised weights. Under bf16 every
strategy starts from the same fp32 master weights."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.harness import assert_saved_the_fp32_start, case, on_ranks, refusal, train_cases, with_overrides

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

    from trainer.models.weights import InitWeights, allocate_params, fill, params_on_meta

    config = AutoConfig.for_model(family, **FRESH_INIT_FAMILIES[family])
    torch.manual_seed(0)
    theirs = dict(AutoModelForCausalLM.from_config(config).named_parameters())
    with params_on_meta():
        ours = AutoModelForCausalLM._model_mapping[type(config)](config)
    allocate_params(ours, torch.device("cpu"))
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
    from trainer.demo import make_model_dir

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


@pytest.mark.slow
def test_persistent_buffers_are_read_from_a_pretrained_folder(tmp_path):
    """Gemma4's `layer_scalar` (a persistent buffer that scales each layer's output), saved with
    values other than its start value: the model the trainer builds gives transformers' logits."""
    from tests.toys import save_gemma4_with_scaled_buffers
    from trainer.config import ModelConfig, ModelKind
    from trainer.models import build_model, initial_weights, logits_of
    from trainer.models.weights import allocate_params, fill, params_on_meta

    theirs = save_gemma4_with_scaled_buffers(tmp_path / "gemma4")
    cfg = ModelConfig(name="hf", kind=ModelKind.hf, path=str(tmp_path / "gemma4"), seq_len=16, vocab_size=128)
    ours = build_model(cfg, params_on_meta())
    weights = initial_weights(cfg, ours, seed=0)
    allocate_params(ours, torch.device("cpu"))
    fill(ours, weights)
    assert [layer.layer_scalar.item() for layer in ours.model.layers] == [0.5, 0.25]
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        assert torch.equal(logits_of(ours.eval()(ids)), logits_of(theirs.eval()(ids)))


STRATEGIES = ["ddp", "fsdp", "zero1", "zero2", "zero3"]


@pytest.mark.slow
def test_under_bf16_every_strategy_starts_from_the_same_fp32_masters(tmp_path):
    # lr 0, one step: what each saves is where it started. DeepSpeed clones its masters from the
    # bf16 parameters unless they are set again from the fp32 values.
    configs = {s: with_overrides(case(s, steps=1), train__precision="bf16", optim__lr=0.0,
                                 checkpoint__dir=str(tmp_path / s)) for s in STRATEGIES}
    on_ranks(2, train_cases, configs, str(tmp_path / "runs"))
    assert_saved_the_fp32_start(configs, tmp_path)
