"""Mixture-of-experts checkpoints as people download them (one tensor per expert, which transformers
fuses as it loads): every family starts where `from_pretrained` starts, under every sharding strategy,
each rank reading its own range of the fused tensors; and the attention each family can run."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.harness import case, full_state, on_ranks, records, refusal, run_cli, with_overrides
from trainer.config import ModelConfig, ModelKind, to_config
from trainer.errors import ConfigError

SEQ = 16


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict[str, Path]:
    from trainer.demo import MOE_FAMILIES, make_model_dir

    root = tmp_path_factory.mktemp("moe")
    return {family: make_model_dir(root / family, family, weights=True, seed=1) for family in MOE_FAMILIES}


def moe_case(strategy: str, path: Path, **overrides) -> dict:
    """One step on synthetic tokens, fp32, from the folder's weights (model node as the CLI resolves it)."""
    from trainer.demo import VOCAB

    cfg = with_overrides(case(strategy, steps=1), data__name="synthetic", data__num_samples=64, **overrides)
    cfg["model"] = {"name": "hf", "kind": "hf", "path": str(path), "seq_len": SEQ, "vocab_size": VOCAB}
    return cfg


def loaded_then_trained(env, cfgs: dict[str, dict], out_dir: str) -> dict:
    """Each config's weights as its strategy loaded them (whole, on rank 0), then one step of each."""
    from tests.test_core_behaviour import build
    from trainer.training.run import train_configs

    loaded = {}
    for name, cfg in cfgs.items():
        strategy, _, _ = build(env, cfg)
        loaded[name] = full_state(strategy)
        strategy.teardown()
    train_configs(env, cfgs, out_dir)
    return loaded


def transformers_start(cfg: dict, path: Path, ranks: int) -> tuple[dict, float]:
    """`from_pretrained`'s parameters, and its loss on the trainer's first global batch."""
    from transformers import AutoModelForCausalLM

    from trainer.data import BatchStream, load_data
    from trainer.losses.objectives import token_loss_sum

    typed = to_config(cfg)
    train_set, _ = load_data(typed, local_rank=0)
    [(x, y)] = BatchStream(train_set, typed.train.micro_batch_size * ranks, 1, 0, 1, typed.train.seed).next_step()
    model = AutoModelForCausalLM.from_pretrained(str(path))
    with torch.no_grad():
        loss = (token_loss_sum(model(x).logits, y) / y.numel()).item()
    return dict(model.named_parameters()), loss


def assert_starts_as_transformers(loaded: dict, run_dir: Path, cfg: dict, path: Path, ranks: int) -> None:
    params, loss = transformers_start(cfg, path, ranks)
    assert loaded.keys() == params.keys()
    for name, value in params.items():
        assert torch.equal(loaded[name], value.detach()), name
    first = records(run_dir)[0]["loss"]
    assert abs(first - loss) <= 1e-6 * loss, (path.name, first, loss)


def test_every_family_loads_as_transformers_does_on_one_rank(moe_dirs, tmp_path):
    """Qwen3-MoE, Mixtral (block_sparse_moe, w1/w2/w3), Qwen2-MoE (shared expert), OLMoE, DeepSeek-V3,
    gpt-oss (stored fused; eager attention): the same parameters and first loss as from_pretrained."""
    cfgs = {family: moe_case("ddp", path) for family, path in moe_dirs.items()}
    loaded = on_ranks(1, loaded_then_trained, cfgs, str(tmp_path))[0]
    for family, path in moe_dirs.items():
        assert_starts_as_transformers(loaded[family], tmp_path / family, cfgs[family], path, 1)


@pytest.mark.slow  # one launch of 2 ranks: 3 min here (2 shared cores, other work running)
def test_two_ranks_read_their_own_ranges_of_the_fused_experts(moe_dirs, tmp_path):
    """fsdp (meta model, each rank its rows), zero3 (zero.Init, each its partition) and zero2, 2 ranks:
    the parameters and first loss of from_pretrained; Mixtral renames and fuses. Under bf16 (zero3)
    the fp32 masters are the stored values too."""
    path = moe_dirs["mixtral"]
    cfgs = {strategy: moe_case(strategy, path, train__micro_batch_size=2) for strategy in ("fsdp", "zero3", "zero2")}
    cfgs["zero3_bf16"] = moe_case("zero3", path, train__micro_batch_size=2, train__precision="bf16")
    loaded = on_ranks(2, loaded_then_trained, cfgs, str(tmp_path))[0]
    for strategy in ("fsdp", "zero3", "zero2"):
        assert_starts_as_transformers(loaded[strategy], tmp_path / strategy, cfgs[strategy], path, 2)
    params, _ = transformers_start(cfgs["zero3_bf16"], path, 2)
    for name, value in params.items():
        assert torch.equal(loaded["zero3_bf16"][name], value.detach()), name


def test_a_rank_reads_only_the_source_rows_its_range_covers(moe_dirs):
    """A range inside one expert's up_proj rows reads those rows of that one tensor: the pieces say so,
    and the values are those of the fused tensor from_pretrained makes."""
    from transformers import AutoModelForCausalLM

    from trainer.models import build_model, param_shapes
    from trainer.models.hf import pretrained_weights

    path = moe_dirs["qwen3_moe"]
    cfg = ModelConfig(kind=ModelKind.hf, path=str(path), seq_len=SEQ)
    model = build_model(cfg, torch.device("meta"))
    weights = pretrained_weights(cfg, model, param_shapes(model))
    name = "model.layers.1.mlp.experts.gate_up_proj"
    experts, rows, width = weights.converted[name].shape  # [E, 2I, H]: gate rows, then up rows, per expert
    start = 2 * rows * width + rows // 2 * width + 3  # expert 2: a few values into its up_proj
    pieces = weights.converted[name].cut(start, width)
    assert [(key, begin, numel) for _, key, begin, numel in pieces] == [
        ("model.layers.1.mlp.experts.2.up_proj.weight", 3, width)]
    fused = AutoModelForCausalLM.from_pretrained(str(path)).get_parameter(name).detach()
    assert torch.equal(weights.read(name, start, width), fused.reshape(-1)[start:start + width])
    everything = weights.read(name, 0, math.prod(fused.shape))
    assert torch.equal(everything, fused.reshape(-1))


def test_the_fingerprint_of_a_moe_folder_sees_every_expert(moe_dirs, tmp_path):
    """LoRA checkpoints find their frozen base again by it: the same folder gives the same one, and a
    change in one expert's values (same names, shapes and sizes) gives another."""
    import shutil

    from trainer.models import build_model, param_shapes
    from trainer.models.hf import pretrained_weights

    def fingerprint(path: Path) -> str:
        cfg = ModelConfig(kind=ModelKind.hf, path=str(path), seq_len=SEQ)
        model = build_model(cfg, torch.device("meta"))
        return pretrained_weights(cfg, model, param_shapes(model)).fingerprint

    changed = tmp_path / "changed"
    shutil.copytree(moe_dirs["mixtral"], changed)
    tensors = load_file(str(changed / "model.safetensors"))
    tensors["model.layers.0.block_sparse_moe.experts.3.w2.weight"] += 1
    save_file(tensors, str(changed / "model.safetensors"), metadata={"format": "pt"})
    assert fingerprint(moe_dirs["mixtral"]) == fingerprint(moe_dirs["mixtral"]) != fingerprint(changed)


def test_an_op_that_does_not_reorder_is_refused_naming_it(moe_dirs, monkeypatch):
    from transformers import conversion_mapping
    from transformers.core_model_loading import MergeModulelist, Transpose, WeightConverter

    from trainer.models import build_model, param_shapes
    from trainer.models.hf import pretrained_weights

    real = conversion_mapping.get_model_conversion_mapping

    def with_a_transpose(model, *args, **kwargs):
        return [WeightConverter(["mlp.experts.*.down_proj.weight"], "mlp.experts.down_proj",
                                operations=[MergeModulelist(dim=0), Transpose(1, 2)])
                if isinstance(t, WeightConverter) and "down_proj" in t.target_patterns[0] else t
                for t in real(model, *args, **kwargs)]

    monkeypatch.setattr(conversion_mapping, "get_model_conversion_mapping", with_a_transpose)
    cfg = ModelConfig(kind=ModelKind.hf, path=str(moe_dirs["olmoe"]), seq_len=SEQ)
    model = build_model(cfg, torch.device("meta"))
    with pytest.raises(ConfigError, match=r"model.layers.0.mlp.experts.down_proj of this olmoe model with "
                                          r"Transpose.*does not apply range by range"):
        pretrained_weights(cfg, model, param_shapes(model))


def test_auto_attention_is_sdpa_where_the_family_has_it_else_transformers_choice(moe_dirs):
    from trainer.models.hf import resolve

    def attention(family: str, setting: str = "auto") -> str:
        return resolve(ModelConfig(kind=ModelKind.hf, path=str(moe_dirs[family]),
                                   attn_implementation=setting)).attn_implementation

    assert attention("qwen3_moe") == "sdpa"
    assert attention("gpt_oss") == "eager"
    assert attention("gpt_oss", "flex_attention") == "flex_attention"
    with pytest.raises(ConfigError, match=r"model.attn_implementation=sdpa: this gpt_oss model does not run with it "
                                          r"here \(.*\); it takes eager, flex_attention, flash_attention_2, or auto"):
        attention("gpt_oss", "sdpa")


def test_auto_is_the_default_attention_of_model_hf():
    import yaml

    from tests.harness import REPO

    assert yaml.safe_load((REPO / "conf" / "model" / "hf.yaml").read_text())["attn_implementation"] == "auto"
    assert ModelConfig().attn_implementation == "auto"


def test_gpt_oss_trains_from_the_command_line_and_a_wrong_attention_is_one_line(moe_dirs, tmp_path):
    common = ("model=hf", f"model.path={moe_dirs['gpt_oss']}", "model.seq_len=16", "data=synthetic",
              "train.max_steps=1", "train.micro_batch_size=2")
    # `auto` named: an editable install elsewhere may ship another checkout's conf/ (the default is checked apart)
    ran = run_cli(*common, "model.attn_implementation=auto", f"hydra.run.dir={tmp_path / 'auto'}")
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert "attn_implementation=eager" in ran.stdout + ran.stderr
    # the refusal in this process: the checks the command runs before work (tests/harness.py: refusal)
    refused = refusal(tmp_path / "sdpa", *common, "model.attn_implementation=sdpa")
    assert refused.startswith("model.attn_implementation=sdpa: this gpt_oss model"), refused
    assert json.loads((tmp_path / "auto" / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1
