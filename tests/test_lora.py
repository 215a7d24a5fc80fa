"""LoRA (peft=lora) under every strategy, on a Hugging Face family the other tests do
not use (Phi-3: fused qkv and gate/up projections, a padding row in its embedding), from saved
weights: only the adapters train, checkpoints hold them alone and resume anywhere, export gives a
PEFT folder and a merged model with the same logits."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.harness import (
    LOSS_RTOL,
    assert_close,
    assert_resumes,
    case,
    on_ranks,
    records,
    refusal,
    resuming,
    saving,
    train_cases,
    with_overrides,
)
from trainer.checkpoint.format import read_manifest

SEQ, VOCAB = 32, 512
PHI3 = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            tie_word_embeddings=False)
LORA = {"name": "lora", "r": 4, "alpha": 8.0}
ADAPTED = ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]  # all-linear: every Linear but lm_head


def make_phi3(out: Path, seed: int = 1, dtype=torch.float32) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("phi3", **PHI3)).to(dtype)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def lora_case(path: Path, strategy: str, world: int, steps: int = 8, **overrides) -> dict:
    """Global batch 16 at any world size, fp32, from the saved weights, every step logged."""
    overrides = {"data__name": "synthetic", "data__num_samples": 512, "optim__lr": 1e-2,
                 "train__micro_batch_size": 16 // world, **overrides}
    cfg = with_overrides(case(strategy, steps=steps), **overrides)
    cfg["model"] = {"name": "hf", "kind": "hf", "path": str(path), "seq_len": SEQ, "vocab_size": VOCAB}
    cfg["peft"] = dict(LORA)
    return cfg


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in records(run_dir)]


@pytest.fixture(scope="module")
def phi3(tmp_path_factory) -> Path:
    return make_phi3(tmp_path_factory.mktemp("phi3") / "model")


def matrix_cases(phi3) -> dict:
    """The other strategies at 2 ranks, and activation checkpointing and train.compile with LoRA."""
    two = {s: lora_case(phi3, s, 2) for s in ("ddp", "zero1", "zero2")}
    two.update({f"{s}:ac": lora_case(phi3, s, 2, train__activation_checkpointing=True) for s in ("fsdp", "zero3")})
    two["ddp:compile"] = lora_case(phi3, "ddp", 2, train__compile=True)
    return two


@pytest.fixture(scope="module")
def core(phi3, tmp_path_factory):
    """Two launches. 2 ranks: fsdp and zero3 (zero3 saving at steps 4 and 8), bf16 runs for the
    bytes, zero3's step 4 resumed by fsdp, and the matrix (in matrix/); then 1 rank: the baseline
    and zero3's step 4 resumed by ddp."""
    root = tmp_path_factory.mktemp("lora")

    def resumed(target: str, world: int) -> dict:
        return {f"zero3->{target}@{world}": resuming(
            lora_case(phi3, target, world, checkpoint__dir=str(root / f"ckpt_{target}@{world}")), root / "ckpt_zero3", 4)}

    two = {s: saving(lora_case(phi3, s, 2), root / f"ckpt_{s}", 4) for s in ("fsdp", "zero3")}
    two.update({f"{s}:bf16": lora_case(phi3, s, 2, steps=2, train__precision="bf16") for s in ("ddp", "fsdp", "zero2")})
    two.update(resumed("fsdp", 2))
    two.update({f"matrix/{name}": cfg for name, cfg in matrix_cases(phi3).items()})
    on_ranks(2, train_cases, two, str(root))
    on_ranks(1, train_cases, {"ddp@1": lora_case(phi3, "ddp", 1), **resumed("ddp", 1)}, str(root))
    return root


@pytest.fixture(scope="module")
def matrix(core):
    return core / "matrix"


@pytest.mark.slow  # make test stays under 8 minutes: the rest of what it covers is in the quick suite
def test_lora_at_two_ranks_matches_one_rank(core):
    base = losses(core / "ddp@1")
    assert base[-1] < base[0] - 0.01, f"the adapters must learn: {base}"
    for strategy in ("fsdp", "zero3"):
        assert_close(losses(core / strategy), base, strategy)


@pytest.mark.slow  # make test stays under 8 minutes: the rest of what it covers is in the quick suite
def test_a_lora_checkpoint_holds_the_adapters_alone_and_resumes_anywhere(core, phi3):
    path = core / "ckpt_zero3" / "step_00000004"
    manifest = read_manifest(path)
    saved = {key for key in manifest["tensors"] if key.startswith("model.")}
    assert saved and all(".lora_A." in key or ".lora_B." in key for key in saved), sorted(saved)[:5]
    assert len(saved) == 2 * len(ADAPTED) * PHI3["num_hidden_layers"]
    assert not any(k.startswith("optim.") and ".lora_" not in k and k != "optim.step" for k in manifest["tensors"])
    base = manifest["base"]
    assert base["path"] == str(phi3.resolve()) and base["fingerprint"] and base["params"] > 0
    assert sorted(manifest["source"]["lora"]["target_modules"]) == ADAPTED
    for resumed in ("zero3->ddp@1", "zero3->fsdp@2"):
        assert_resumes(records(core / resumed), records(core / "zero3"), at=4, what=resumed, rtol=LOSS_RTOL)


@pytest.mark.slow  # make test stays under 8 minutes: the rest of what it covers is in the quick suite
def test_only_the_adapters_have_gradients_and_optimizer_state_and_the_plan_counts_them(core, phi3):
    """bf16 at 2 ranks: the frozen base is held in bf16 with no gradient and no optimizer state,
    the adapters in fp32 (DDP, FSDP2) or bf16 with an fp32 master (ZeRO); the plan's bytes match."""
    from trainer.config import to_config
    from trainer.plan import make_plan

    cfg = to_config(lora_case(phi3, "ddp", 2, train__precision="bf16"))
    plan = make_plan(cfg, 2, 10 ** 12)
    adapters, total = plan.trainable, plan.params
    assert 0 < adapters < total / 2
    frozen = total - adapters
    expected = {"ddp": {"params": 2 * frozen + 4 * adapters, "grads": 4 * adapters, "optim": 8 * adapters},
                "fsdp": {"params": (2 * frozen + 4 * adapters) // 2, "grads": 4 * adapters // 2,
                         "optim": 8 * adapters // 2},
                "zero2": {"params": 2 * total, "grads": 4 * adapters // 2, "optim": 12 * adapters // 2}}
    for strategy, want in expected.items():
        mem = records(core / f"{strategy}:bf16")[-1]["mem"]
        planned = next(o for o in plan.options if o.name == strategy and not o.offload
                       and not o.activation_checkpointing).per_gpu_bytes
        for key, value in want.items():
            assert mem[key] == pytest.approx(value, rel=0.01, abs=16), (strategy, key, mem)
            assert planned[key] == pytest.approx(value, rel=0.01), (strategy, key, planned)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ddp", "zero1", "zero2", "fsdp:ac", "zero3:ac", "ddp:compile"])
def test_lora_parity_under_every_strategy_with_checkpointing_and_compile(core, matrix, name):
    rtol = 1e-5 if name.endswith("compile") else LOSS_RTOL  # compiled kernels round differently
    assert_close(losses(matrix / name), losses(core / "ddp@1"), name, rtol)


def dtypes_after_setup(env, cfg: dict) -> dict:
    from tests.test_core_behaviour import build

    strategy, model, _ = build(env, cfg)
    out = {}
    for name, p in strategy.module.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else getattr(p, "ds_tensor", p)
        out[name] = (str(local.dtype), p.requires_grad)
    masters = strategy.zero.masters() if hasattr(strategy, "zero") else []  # DeepSpeed's fp32 partitions
    out["_masters"] = sum(m.numel() for m in masters)
    strategy.teardown()
    return out


@pytest.mark.slow  # make test stays under 8 minutes: the rest of what it covers is in the quick suite
@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_under_bf16_the_base_is_bf16_and_the_adapters_keep_fp32(phi3, strategy):
    cfg = lora_case(phi3, strategy, 2, train__precision="bf16")
    held = on_ranks(2, dtypes_after_setup, cfg)[0]
    masters = held.pop("_masters")
    frozen = {n: d for n, (d, trains) in held.items() if not trains}
    adapters = {n: d for n, (d, trains) in held.items() if trains}
    assert frozen and set(frozen.values()) == {"torch.bfloat16"}
    assert all(".lora_" in n for n in adapters)
    if strategy == "fsdp":  # FSDP2: one unit holds both dtypes; the adapters' shards are the masters
        assert set(adapters.values()) == {"torch.float32"}
    else:  # ZeRO-3: bf16 partitions of everything, fp32 masters of the adapters' alone
        from trainer.config import to_config
        from trainer.plan import make_plan

        trainable = make_plan(to_config(cfg), 2, 10 ** 12).trainable
        assert trainable // 2 <= masters <= trainable // 2 + 64, (masters, trainable)


@pytest.fixture(scope="module")
def exported(core, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_export")
    step = core / "ckpt_zero3" / "step_00000008"
    for name, extra in (("adapter", []), ("merged", ["--merge"])):
        done = subprocess.run([sys.executable, "-m", "trainer.export", str(step), str(out / name), *extra],
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
    return step, out


def trainer_logits(env, step: str, cfg: dict, ids):
    from tests.test_core_behaviour import build
    from trainer.checkpoint.manager import CheckpointManager
    from trainer.config import to_config

    strategy, model, _ = build(env, cfg)
    weights_fingerprint = read_manifest(Path(step))["base"]["fingerprint"]
    CheckpointManager(to_config(cfg).checkpoint, strategy, "ddp", base_fingerprint=weights_fingerprint).load(Path(step))
    with torch.no_grad():
        logits = model(ids).logits
    strategy.teardown()
    return logits


@pytest.mark.slow  # make test stays under 8 minutes: the rest of what it covers is in the quick suite
def test_export_gives_a_peft_folder_and_a_merged_model_with_the_trained_logits(exported, phi3):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    step, out = exported
    assert sorted(p.name for p in (out / "adapter").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert (out / "merged" / "generation_config.json").is_file()  # the source's sampling defaults and stop tokens
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    expected = on_ranks(1, trainer_logits, str(step), lora_case(phi3, "ddp", 1), ids)[0]
    with torch.no_grad():
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(phi3)), str(out / "adapter"))
        merged = AutoModelForCausalLM.from_pretrained(str(out / "merged"))
        plain = AutoModelForCausalLM.from_pretrained(str(phi3))
        assert torch.allclose(adapted(ids).logits, expected, atol=1e-5)
        assert torch.allclose(merged(ids).logits, expected, atol=1e-5)
        assert not torch.allclose(plain(ids).logits, expected, atol=1e-3)  # the adapters changed the model


@pytest.mark.slow  # make test stays under 8 minutes: the rest of what it covers is in the quick suite
def test_peft_init_continues_an_adapter_folder(exported, phi3, tmp_path):
    """A run from the exported adapters at lr 0 saves exactly those adapters again."""
    from safetensors.torch import load_file

    step, out = exported
    cfg = lora_case(phi3, "ddp", 1, steps=1, optim__lr=0.0, checkpoint__dir=str(tmp_path / "ckpt"))
    cfg["peft"]["init"] = str(out / "adapter")
    on_ranks(1, train_cases, {"init": cfg}, str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "trainer.export", str(tmp_path / "ckpt"), str(tmp_path / "again")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    first, again = load_file(out / "adapter" / "adapter_model.safetensors"), load_file(
        tmp_path / "again" / "adapter_model.safetensors")
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    assert any(v.abs().sum() > 0 for k, v in first.items() if ".lora_B." in k)  # trained, not a fresh start


@pytest.mark.slow  # make test stays under 8 minutes: the rest of what it covers is in the quick suite
def test_bad_lora_settings_are_refused_before_any_rank_starts(phi3, core, tmp_path):
    model = [f"model.path={phi3}", "model=hf", "peft=lora", "data=synthetic", f"model.seq_len={SEQ}"]
    message = refusal(tmp_path / "run", *model, "peft.target_modules=[q_proj]")
    assert message.startswith("peft.target_modules: q_proj matches no linear layer") and "qkv_proj" in message
    assert refusal(tmp_path / "run", *model, "peft.r=0").startswith("peft.r: the adapters' rank must be >= 1")
    toy = ["model=custom", "model._target_=examples.toy_model.build", "strategy.wrap=[ToyBlock]", "peft=lora"]
    assert refusal(tmp_path / "run", *toy, "peft.target_modules=[nope]").endswith(
        "nope matches no linear layer of ToyLM; its linear layers: head, mlp.0, mlp.2")
    # the same weights in bf16: the same names and shapes, other file sizes
    other = make_phi3(tmp_path / "phi3_bf16", dtype=torch.bfloat16)
    shutil.copy(phi3 / "config.json", other / "config.json")
    ckpt = core / "ckpt_zero3"
    message = refusal(tmp_path / "run", "model=hf", f"model.path={other}", "peft=lora", "peft.r=4", "peft.alpha=8",
                      "data=synthetic", f"model.seq_len={SEQ}", f"checkpoint.dir={ckpt}")
    assert "which it does not save" in message and str(phi3.resolve()) in message, message
    assert json.loads((ckpt / "step_00000008" / "manifest.json").read_text())["step"] == 8  # untouched


# -- issue 27, item 4: the frozen base is recognised by its values --------------------------------

def base_fingerprint(path: Path) -> str:
    """What a LoRA run on the weights in `path` records of its frozen base."""
    from trainer.config import to_config
    from trainer.models import initial_weights, meta_model

    cfg = to_config(lora_case(path, "ddp", 1))
    return initial_weights(cfg.model, meta_model(cfg.model, cfg.peft), 0, cfg.peft).fingerprint


def layout_fingerprint(path: Path) -> str:
    """A base's fingerprint as checkpoints recorded it before values were sampled: its tensors'
    names and shapes and its files' sizes."""
    import hashlib

    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    shapes = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            shapes.update({key: list(handle.get_slice(key).get_shape()) for key in handle.keys()})
    return hashlib.sha256(json.dumps({f.name: f.stat().st_size for f in files} | shapes,
                                     sort_keys=True).encode()).hexdigest()[:16]


@pytest.mark.slow  # make test stays under 8 minutes: the rest of what it covers is in the quick suite
def test_a_lora_checkpoint_on_a_base_with_other_values_is_refused_at_resume_and_merge(core, phi3, tmp_path):
    """A fine-tuned variant of the base: the same names, shapes, dtypes and file sizes, other values."""
    from tests.harness import assert_refused

    variant = make_phi3(tmp_path / "variant", seed=2)
    assert layout_fingerprint(variant) == layout_fingerprint(phi3)
    message = refusal(tmp_path / "run", "model=hf", f"model.path={variant}", "peft=lora", "peft.r=4", "peft.alpha=8",
                      "data=synthetic", f"model.seq_len={SEQ}", f"checkpoint.dir={core / 'ckpt_zero3'}")
    assert "which it does not save" in message and "values differ" in message, message
    step = tmp_path / "step"  # a checkpoint whose recorded base folder now holds the variant
    shutil.copytree(core / "ckpt_zero3" / "step_00000008", step)
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["source"]["path"] = manifest["base"]["path"] = str(variant)
    (step / "manifest.json").write_text(json.dumps(manifest))
    done = subprocess.run([sys.executable, "-m", "trainer.export", str(step), str(tmp_path / "merged"), "--merge"],
                          capture_output=True, text=True)
    assert_refused(done, "holds adapters trained on the frozen weights of", "values differ", prog="trainer.export")
    assert not (tmp_path / "merged").exists()


def test_a_base_fingerprint_recorded_before_values_passes_on_the_same_layout_with_a_warning(phi3, tmp_path,
                                                                                             monkeypatch):
    from trainer.checkpoint import format as checkpoint_format
    from trainer.errors import CheckpointError

    said = []
    monkeypatch.setattr(checkpoint_format.log, "warning", said.append)
    old = {"path": str(phi3), "fingerprint": layout_fingerprint(phi3)}
    checkpoint_format.check_base(old, base_fingerprint(phi3), tmp_path)
    assert len(said) == 1 and "cannot be checked" in said[0], said
    other = make_phi3(tmp_path / "phi3_bf16", dtype=torch.bfloat16)  # other file sizes
    shutil.copy(phi3 / "config.json", other / "config.json")
    with pytest.raises(CheckpointError, match="which it does not save"):
        checkpoint_format.check_base(old, base_fingerprint(other), tmp_path)


@pytest.mark.parametrize("kind", ["reference", "custom", "hf"])
def test_all_linear_leaves_the_output_layer_out_on_every_model_kind(phi3, kind):
    """Issue 27: peft's rule (a Hugging Face model's get_output_embeddings) found no output layer on the
    reference and custom models, whose logits were adapted. The tiny model's MLP is as wide as its
    vocabulary (256): that layer is adapted, the head after it is not."""
    from torch import nn

    from trainer.config import to_config
    from trainer.models import meta_model

    node = {"reference": {"name": "tiny"},
            "custom": {"name": "custom", "kind": "custom", "_target_": "examples.toy_model.build", "vocab": 128,
                       "vocab_size": 128},
            "hf": {"name": "hf", "kind": "hf", "path": str(phi3), "seq_len": SEQ, "vocab_size": VOCAB}}[kind]
    cfg = to_config({"model": node, "peft": {"name": "lora"}})
    model = meta_model(cfg.model, cfg.peft)
    adapted = {name for name, m in model.named_modules() if hasattr(m, "lora_A")}
    linear = {name.removesuffix(".base_layer") for name, m in model.named_modules()
              if isinstance(m, nn.Linear) and ".lora_" not in name}
    output = {"reference": "lm_head", "custom": "head", "hf": "lm_head"}[kind]
    assert adapted == linear - {output} and output in linear, sorted(linear - adapted)
    if kind == "reference":
        assert model.blocks[0].mlp.up.out_features == cfg.model.vocab_size and "blocks.0.mlp.up" in adapted
