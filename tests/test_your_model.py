"""Hugging Face causal LMs and any nn.Module, through every strategy.

Two HF families with different block classes (Qwen2: tied embeddings, rotary, GQA; GPT-NeoX:
untied, parallel residual) and a custom `_target_` model, built from configs in the test.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.harness import (
    LOSS_RTOL,
    assert_close,
    assert_refused,
    assert_resumes,
    case,
    crossings,
    losses,
    on_ranks,
    records,
    refusal,
    resuming,
    run_cli,
    saving,
    train_cases,
    with_overrides,
)
from trainer.checkpoint.format import read_manifest
from trainer.config import to_config
from trainer.demo import FAMILIES, VOCAB
from trainer.strategies.base import optimizer_step

STRATEGIES = ["ddp", "fsdp", "zero1", "zero2", "zero3"]
SEQ = 32


def hf_model(path: Path) -> dict:
    """The model node as the CLI resolves it (vocabulary from config.json, seq_len given)."""
    return {"name": "hf", "kind": "hf", "path": str(path), "seq_len": SEQ, "vocab_size": VOCAB}


def custom_model() -> dict:
    return {"name": "custom", "kind": "custom", "_target_": "examples.toy_model.build", "vocab": 128, "dim": 32,
            "layers": 2, "seq_len": SEQ, "vocab_size": 128}


def with_model(cfg: dict, model: dict, **overrides) -> dict:
    out = with_overrides(cfg, **{"data__name": "synthetic", "data__num_samples": 512, "optim__lr": 1e-2, **overrides})
    out["model"] = dict(model)
    return out


# Each model on two or three strategies, each strategy on one or more models (crossings(), tests/harness.py).
PARITY = crossings(([*FAMILIES, "custom"], STRATEGIES), [
    ("qwen2", "ddp"), ("qwen2", "zero1"), ("qwen2", "zero3"), ("gpt_neox", "fsdp"), ("gpt_neox", "zero2"),
    ("gpt_neox", "zero3"), ("custom", "ddp"), ("custom", "fsdp"), ("custom", "zero2")])
CHECKPOINTED = crossings((list(FAMILIES), ["ddp", "fsdp", "zero3"]),
                         [("qwen2", "fsdp"), ("qwen2", "zero3"), ("gpt_neox", "ddp")])


@pytest.fixture(scope="module")
def parity(hf_assets, tmp_path_factory):
    """Global batch 16, fp32, 8 steps, from config.json (no weights): 1 rank, then 2 ranks under
    every strategy, and with activation checkpointing."""
    out = tmp_path_factory.mktemp("hf_parity")
    models = {f: hf_model(hf_assets.config_only[f]) for f in FAMILIES}
    models["custom"] = custom_model()
    wrap = {"custom": ["ToyBlock"]}

    def run_case(name, strategy, model, mbs, **extra):
        cfg = with_model(case(strategy), models[model], train__micro_batch_size=mbs, **extra)
        if model in wrap:
            cfg["strategy"]["wrap"] = wrap[model]
        return cfg
    one = {f"{m}@1": run_case(f"{m}@1", "ddp", m, 16) for m in models}
    two = {f"{m}:{s}": run_case(m, s, m, 8) for m, s in dict.fromkeys([*PARITY, *CHECKPOINTED])}
    two.update({f"{m}:{s}:ac": run_case(m, s, m, 8, train__activation_checkpointing=True) for m, s in CHECKPOINTED})
    on_ranks(1, train_cases, one, str(out))
    on_ranks(2, train_cases, two, str(out))
    return {d.name: records(d) for d in out.iterdir()}


@pytest.mark.slow
@pytest.mark.parametrize("model, strategy", PARITY)
def test_two_ranks_match_one_rank(parity, model, strategy):
    base = losses(parity[f"{model}@1"])
    assert base[-1] < base[0] - 0.2, f"{model} must learn: {base}"
    assert_close(losses(parity[f"{model}:{strategy}"]), base, f"{model} {strategy}")


@pytest.mark.slow
@pytest.mark.parametrize("family, strategy", CHECKPOINTED)
def test_activation_checkpointing_keeps_losses(parity, family, strategy):
    assert_close(losses(parity[f"{family}:{strategy}:ac"]), losses(parity[f"{family}:{strategy}"]),
                 f"{family} {strategy} AC")


def tied_after_setup(env, model_dict: dict) -> dict:
    """Per strategy: is the output matrix still the input embedding, after sharding and two
    steps? And the model's rotary inv_freq (a non-persistent buffer) after the meta build."""
    from tests.test_core_behaviour import build, loss_of

    out = {}
    for strategy in STRATEGIES:
        strategy_obj, model, _ = build(env, with_model(case(strategy), model_dict))
        inner = getattr(model, "module", model)  # DDP / DeepSpeed engine
        for _ in range(2):
            x = torch.randint(0, VOCAB, (2, SEQ + 1))
            strategy_obj.backward(loss_of(model, x))
            optimizer_step(strategy_obj, 1.0)
        tied = inner.get_output_embeddings().weight is inner.get_input_embeddings().weight
        out[strategy] = tied, inner.model.rotary_emb.inv_freq.cpu().clone()
        strategy_obj.teardown()
    return out


@pytest.fixture(scope="module")
def tied(hf_assets):
    return on_ranks(2, tied_after_setup, hf_model(hf_assets.pretrained["qwen2"]))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_tied_embeddings_stay_tied_and_buffers_are_right(hf_assets, tied, strategy):
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(str(hf_assets.pretrained["qwen2"]))
    for rank, per_strategy in tied.items():
        is_tied, inv_freq = per_strategy[strategy]
        assert is_tied, f"rank {rank}: lm_head.weight is no longer model.embed_tokens.weight"
        assert torch.equal(inv_freq, plain.model.rotary_emb.inv_freq), f"rank {rank}: inv_freq {inv_freq}"


@pytest.fixture(scope="module")
def resumed(hf_assets, tmp_path_factory):
    """Qwen2 (tied) from its pretrained weights: straight runs that checkpoint at step 6, and
    resumes of them under another strategy and world size."""
    root = tmp_path_factory.mktemp("hf_resume")
    out = root / "runs"
    model = hf_model(hf_assets.pretrained["qwen2"])

    def straight(strategy):
        return saving(with_model(case(strategy, steps=12), model, train__micro_batch_size=4), root / strategy, 6)

    def resume(source, strategy, world):
        return resuming(with_model(case(strategy, steps=12), model, train__micro_batch_size=8 // world),
                        root / source, 6)
    on_ranks(2, train_cases, {"fsdp": straight("fsdp"), "zero3": straight("zero3")}, str(out))
    on_ranks(2, train_cases, {"fsdp->zero3@2": resume("fsdp", "zero3", 2)}, str(out))
    on_ranks(1, train_cases, {"zero3->ddp@1": resume("zero3", "ddp", 1)}, str(out))
    return root, {d.name: records(d) for d in out.iterdir()}


@pytest.mark.slow
def test_hf_checkpoints_resume_across_strategies_and_world_sizes(resumed):
    _, r = resumed
    assert_resumes(r["fsdp->zero3@2"], r["fsdp"], at=6, what="fsdp@2 -> zero3@2", rtol=LOSS_RTOL)
    assert_resumes(r["zero3->ddp@1"], r["zero3"], at=6, what="zero3@2 -> ddp@1", rtol=LOSS_RTOL)


@pytest.mark.slow
def test_a_tied_matrix_is_stored_once(resumed):
    root, _ = resumed
    manifest = read_manifest(root / "fsdp" / "step_00000006")
    assert "model.embed_tokens.weight" in manifest["model"] and "lm_head.weight" not in manifest["model"]
    assert manifest["source"]["kind"] == "hf" and manifest["source"]["config"]["tie_word_embeddings"]


def logits_in_trainer(env, step: str, model_dict: dict, ids):
    from tests.test_core_behaviour import build
    from trainer.checkpoint.manager import CheckpointManager

    cfg = with_model(case("ddp"), model_dict)
    strategy, model, _ = build(env, cfg)
    CheckpointManager(to_config(cfg).checkpoint, strategy, "ddp").load(Path(step))
    with torch.no_grad():
        logits = model(ids).logits
    strategy.teardown()
    return logits


def export_and_load(step: Path, out: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    done = subprocess.run([sys.executable, "-m", "trainer.export", str(step), str(out)], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"step {read_manifest(step)['step']}" in done.stdout
    return AutoModelForCausalLM.from_pretrained(str(out)), AutoTokenizer.from_pretrained(str(out))


@pytest.mark.slow
def test_export_is_a_hugging_face_folder_with_the_trained_logits(resumed, hf_assets, tmp_path):
    root, _ = resumed
    step = root / "zero3" / "step_00000012"
    model, tokenizer = export_and_load(step, tmp_path / "export")
    assert {p.name for p in (tmp_path / "export").iterdir()} >= {"config.json", "generation_config.json",
                                                                  "model.safetensors", "tokenizer.json"}
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    ids = torch.tensor([tokenizer("Permission is hereby granted, free of charge")["input_ids"]])
    expected = on_ranks(1, logits_in_trainer, str(step), hf_model(hf_assets.pretrained["qwen2"]), ids)[0]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, expected)


@pytest.fixture(scope="module")
def from_weights_at_lr_0(hf_assets, tmp_path_factory):
    """fsdp and zero3 from saved GPT-NeoX / Qwen2 weights with optim.lr=0, on the jsonl text."""
    root = tmp_path_factory.mktemp("hf_lr0")
    cfgs = {}
    for family in FAMILIES:
        for strategy in ("fsdp", "zero3"):
            cfg = with_model(case(strategy, steps=2), hf_model(hf_assets.pretrained[family]),
                             optim__lr=0.0, checkpoint__dir=str(root / f"{family}-{strategy}"),
                             checkpoint__every_steps=2)
            cfg["data"] = {"name": "hf", "path": str(hf_assets.jsonl), "cache_dir": str(hf_assets.cache)}
            cfgs[f"{family}-{strategy}"] = cfg
    on_ranks(2, train_cases, cfgs, str(root / "runs"))
    return root, cfgs


def first_batch_loss_of_the_hf_model(cfg: dict, model_dir: Path) -> float:
    """The loss `from_pretrained` itself gives on the trainer's first global batch."""
    from transformers import AutoModelForCausalLM

    from trainer.data import BatchStream, load_data
    from trainer.losses.objectives import token_loss_sum

    typed = to_config(cfg)
    train_set, _ = load_data(typed, local_rank=0)
    global_batch = typed.train.micro_batch_size * 2
    [(x, y)] = BatchStream(train_set, global_batch, 1, 0, 1, typed.train.seed).next_step()
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    with torch.no_grad():
        return (token_loss_sum(model(x).logits, y) / y.numel()).item()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_pretrained_weights_give_the_models_own_first_loss_and_survive_lr_0(from_weights_at_lr_0, hf_assets,
                                                                            family, strategy, tmp_path):
    root, cfgs = from_weights_at_lr_0
    name = f"{family}-{strategy}"
    first = records(root / "runs" / name)[0]["loss"]
    expected = first_batch_loss_of_the_hf_model(cfgs[name], hf_assets.pretrained[family])
    assert abs(first - expected) <= 1e-6 * expected, (first, expected)
    export_and_load(root / name / "step_00000002", tmp_path / "export")
    source = load_file(str(hf_assets.pretrained[family] / "model.safetensors"))
    exported = load_file(str(tmp_path / "export" / "model.safetensors"))
    if FAMILIES[family]["tie_word_embeddings"]:
        source.pop("lm_head.weight", None)
    assert exported.keys() == source.keys()
    for key, value in source.items():
        assert torch.equal(exported[key], value), key


@pytest.mark.slow  # make test stays under 8 minutes: the rest of what it covers is in the quick suite
def test_the_planner_counts_hf_and_custom_models_on_meta(hf_assets):
    from transformers import AutoModelForCausalLM

    plan = [sys.executable, "-m", "trainer.plan", "plan.json=true"]
    hf = run_cli("model=hf", f"model.path={hf_assets.pretrained['gpt_neox']}", launcher=plan)
    assert hf.returncode == 0, hf.stderr[-2000:]
    expected = AutoModelForCausalLM.from_pretrained(str(hf_assets.pretrained["gpt_neox"])).num_parameters()
    assert json.loads(hf.stdout)["params"] == expected
    custom = run_cli("model=custom", "model._target_=examples.toy_model.build", "+model.vocab=100", "+model.dim=16",
                     "strategy.wrap=[ToyBlock]", launcher=plan)
    assert custom.returncode == 0, custom.stderr[-2000:]
    assert json.loads(custom.stdout)["params"] == 100 * 16 * 2 + 2 * (2 * 16 + 16 * 64 + 64 + 64 * 16 + 16)


def test_custom_model_needs_its_blocks_named(tmp_path):
    result = run_cli("model=custom", "model._target_=examples.toy_model.build", "strategy=fsdp", "nproc=2",
                     f"hydra.run.dir={tmp_path}")
    assert_refused(result, "strategy.wrap", "ToyBlock")


@pytest.fixture(scope="module")
def bad_model_dirs(hf_assets, tmp_path_factory):
    from transformers import T5Config

    from trainer.demo import make_model_dir

    root = tmp_path_factory.mktemp("bad_models")
    T5Config(d_model=16, num_layers=1, num_heads=2, d_kv=8, d_ff=32, vocab_size=64).save_pretrained(str(root / "t5"))
    (root / "empty").mkdir()
    small_vocab = make_model_dir(root / "small_vocab", "qwen2", weights=False)
    config = json.loads((small_vocab / "config.json").read_text())
    (small_vocab / "config.json").write_text(json.dumps({**config, "vocab_size": 256}))
    return root


BAD_MODELS = {
    "no path": (["model=hf"], ["model.path", "needs a Hugging Face model folder"]),
    "missing": (["model=hf", "model.path={root}/nowhere"], ["model.path", "nowhere is not a directory"]),
    "no config": (["model=hf", "model.path={root}/empty"], ["model.path", "has no config.json"]),
    "not causal": (["model=hf", "model.path={root}/t5"], ["model.path", "'t5' model is not a causal LM"]),
    "vocab": (["model=hf", "model.path={root}/small_vocab", "data=hf", "data.path={jsonl}", "data.tokenizer={tok}"],
              ["data.tokenizer", f"{VOCAB} tokens, more than the model's 256 embeddings"]),
    "target": (["model=custom", "model._target_=tests.nowhere.build"], ["model._target_", "cannot import"]),
    "reference key": (["+model.path=x"], ["model.path", "not a setting of a reference model"]),
}


@pytest.mark.parametrize("name", list(BAD_MODELS))
def test_bad_model_input_is_refused_before_any_rank_starts(bad_model_dirs, hf_assets, tmp_path, name):
    overrides, fragments = BAD_MODELS[name]
    args = [o.format(root=bad_model_dirs, jsonl=hf_assets.jsonl, tok=hf_assets.tokenizer) for o in overrides]
    message = refusal(tmp_path, *args, "nproc=2", f"data.cache_dir={hf_assets.cache}")
    for fragment in fragments:
        assert fragment in message, message


def test_the_command_line_says_it_in_one_line(bad_model_dirs, tmp_path):
    result = run_cli("model=hf", f"model.path={bad_model_dirs}/t5", "nproc=2", f"hydra.run.dir={tmp_path}")
    assert_refused(result)
    assert result.stderr.strip() == "trainer: error: model.path: a 't5' model is not a causal LM (AutoModelForCausalLM " \
                                    "has no class for it)"
    assert "world_size=" not in result.stdout
