"""What a user coming from transformers, peft and TRL meets first: fine-tuning's
optimizer defaults, exports that carry the tokenizer and chat template, `peft.init` that says what
it ignores, a resume line that says what was restored, a done line that names the checkpoint and
the export command, and models and data by their Hugging Face Hub names."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.harness import assert_refused, records, run_cli


def compose(*overrides: str):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    from trainer.config import CONFIG_MODULE, register_configs, to_config

    register_configs()
    with initialize_config_module(config_module=CONFIG_MODULE, version_base=None):
        return to_config(hydra_compose(config_name="config", overrides=list(overrides)))


def optimizer_groups(*overrides: str) -> list[dict]:
    """The AdamW param groups a run with these overrides builds over its trainable parameters
    (the loop's own factory, on the model the loop builds), as (lr, weight decay, parameter names)."""
    from contextlib import nullcontext

    from trainer.models import build_model
    from trainer.training.setup import adamw_factory

    cfg = compose(*overrides)
    model = build_model(cfg.model, nullcontext(), cfg.peft)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optimizer = adamw_factory(cfg.optim)([(p, tuple(p.shape)) for _, p in trainable])
    names = {id(p): n for n, p in trainable}
    return [{"lr": g["lr"], "weight_decay": g["weight_decay"], "betas": g["betas"],
             "names": [names[id(p)] for p in g["params"]]} for g in optimizer.param_groups]


def test_lora_trains_at_fine_tuning_defaults_unless_the_command_line_says_otherwise():
    groups = optimizer_groups("peft=lora")
    adapters = [n for g in groups for n in g["names"]]
    assert adapters and all(".lora_A." in n or ".lora_B." in n for n in adapters)
    assert all(g["lr"] == 1e-4 and g["weight_decay"] == 0.0 and g["betas"] == (0.9, 0.999) for g in groups)
    # an explicit optim.* wins, on either side of peft=lora
    for overrides in (("peft=lora", "optim.lr=5e-4", "optim.weight_decay=0.05"),
                      ("optim.lr=5e-4", "optim.weight_decay=0.05", "peft=lora")):
        groups = optimizer_groups(*overrides)
        decayed = [g for g in groups if g["weight_decay"] == 0.05]
        assert decayed and all(g["lr"] == 5e-4 for g in groups)
        assert all(".lora_" in n for g in decayed for n in g["names"])
    # full training keeps pre-training's defaults
    assert {(g["lr"], g["weight_decay"]) for g in optimizer_groups()} == {(3e-3, 0.1), (3e-3, 0.0)}


def tiny_lora_settings(targets) -> dict:
    return {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": targets}


def adapter_folder(tmp_path: Path, targets) -> Path:
    """A PEFT adapter folder for the reference `tiny` model, on the layers `targets` picks."""
    from trainer.config import PeftConfig
    from trainer.models import lora, meta_model

    cfg = compose()
    names = ["blocks.0.attn.qkv", "blocks.1.attn.qkv"]
    model = meta_model(cfg.model, PeftConfig(name="lora", r=4, alpha=8, target_modules=names))
    adapters = {n: torch.full(tuple(p.shape), 0.5) for n, p in model.named_parameters() if lora.is_adapter(n)}
    out = tmp_path / "adapter"
    lora.write_adapter_folder({lora.canonical_name(n): w for n, w in adapters.items()},
                              tiny_lora_settings(targets), None, out)
    return out


def test_peft_init_takes_a_regex_target_modules_and_refuses_settings_it_would_ignore(tmp_path):
    from trainer.config import PeftConfig
    from trainer.errors import ConfigError
    from trainer.models import lora, meta_model

    folder = adapter_folder(tmp_path, r".*\.attn\.qkv")  # peft's regex form: a string, not a list
    assert json.loads((folder / lora.ADAPTER_CONFIG).read_text())["target_modules"] == r".*\.attn\.qkv"
    model = meta_model(compose().model, PeftConfig(name="lora", init=str(folder)))
    adapted = sorted({n.split(".lora_")[0] for n, _ in model.named_parameters() if lora.is_adapter(n)})
    assert adapted == ["blocks.0.attn.qkv", "blocks.1.attn.qkv"]
    assert model.lora_settings["r"] == 4
    for key, value in (("r", 8), ("alpha", 64.0), ("target_modules", ["proj"])):
        with pytest.raises(ConfigError, match=rf"^peft\.{key}=.*peft\.init=.* holds adapters with {key} "):
            meta_model(compose().model, PeftConfig(name="lora", init=str(folder), **{key: value}))
    # the folder's own values, given again, are no conflict
    meta_model(compose().model, PeftConfig(name="lora", init=str(folder), r=4, alpha=8.0))


def hf_portable(hf_assets, tmp_path: Path, template: Path | None, lora_settings: dict | None):
    """A model=hf checkpoint as a run of data.chat_template=`template` records it (trainer.models.description)."""
    from trainer.checkpoint.format import Portable
    from trainer.config import PeftConfig, model_config
    from trainer.models import description, meta_model
    from trainer.models.weights import canonical_name

    model_cfg = model_config({"kind": "hf", "name": "hf", "path": str(hf_assets.pretrained["qwen2"]), "seq_len": 32})
    peft = PeftConfig(name="lora", r=4, alpha=8.0) if lora_settings else None
    model = meta_model(model_cfg, peft)
    source = description(model_cfg, None, model, str(template) if template else None)
    weights = {canonical_name(n): torch.zeros(tuple(p.shape)) for n, p in model.named_parameters()}
    if lora_settings:
        weights = {n: w for n, w in weights.items() if ".lora_" in n}
    return Portable(weights, {}, 3, source=source)


CHAT_TEMPLATE = "{% for m in messages %}<<{{ m['role'] }}>> {{ m['content'] }}\n{% endfor %}"


@pytest.mark.parametrize("adapters", [False, True], ids=["full", "lora"])
def test_exports_carry_the_tokenizer_with_the_chat_template_that_trained(hf_assets, tmp_path, adapters):
    from transformers import AutoTokenizer

    from trainer.checkpoint.export import write_weights

    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    portable = hf_portable(hf_assets, tmp_path, template, lora_settings=adapters)
    template.unlink()  # gone by export time: the checkpoint recorded its text
    out = tmp_path / "export"
    said = write_weights(portable, out, False, tmp_path, "step 3")
    assert "; the tokenizer with the run's data.chat_template)" in said
    assert AutoTokenizer.from_pretrained(str(out)).chat_template == CHAT_TEMPLATE
    assert (out / ("adapter_config.json" if adapters else "config.json")).is_file()


def test_export_refuses_a_destination_that_holds_something(hf_assets, tmp_path, capsys):
    from trainer.checkpoint.format import write_step_dir
    from trainer.errors import ERROR_EXIT_CODE
    from trainer.export import main

    ckpt = write_step_dir(hf_portable(hf_assets, tmp_path, None, None), tmp_path / "ckpt").parent
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("keep me")
    for out in (taken, taken / "notes.txt"):
        with pytest.raises(SystemExit) as stopped:
            main([str(ckpt), str(out)])
        assert stopped.value.code == ERROR_EXIT_CODE
        error = capsys.readouterr().err
        assert error.startswith(f"trainer.export: error: {out} exists") and error.count("\n") == 1, error
    assert (taken / "notes.txt").read_text() == "keep me" and [p.name for p in taken.iterdir()] == ["notes.txt"]
    main([str(ckpt), str(tmp_path / "empty")])  # a new folder (or an empty one) is written
    assert (tmp_path / "empty" / "config.json").is_file()


def universal_checkpoint(root: Path, step: int = 5) -> Path:
    """A DeepSpeed universal checkpoint of the reference `tiny` model, as ds_to_universal lays it out
    (zero/<param>/{fp32,exp_avg,exp_avg_sq,step}.pt, each tensor under "param")."""
    from trainer.models.builtin import Transformer, shape_of

    model = Transformer(shape_of(compose().model))
    for name, p in model.named_parameters():
        folder = root / "zero" / name
        folder.mkdir(parents=True)
        for kind, value in (("fp32", p.detach()), ("exp_avg", torch.full_like(p, 1e-3)),
                            ("exp_avg_sq", torch.full_like(p, 1e-6))):
            torch.save({"param": value.clone()}, folder / f"{kind}.pt")
        torch.save(torch.tensor(step), folder / "step.pt")
    return root


def test_the_resumed_line_says_what_the_checkpoint_restored(tmp_path):
    from trainer.checkpoint.convert import read
    from trainer.checkpoint.format import read_manifest, write_step_dir
    from trainer.checkpoint.resume import resumed_line

    converted = write_step_dir(read(universal_checkpoint(tmp_path / "universal")), tmp_path / "converted")
    line = resumed_line(converted, 5, read_manifest(converted), data_kept=True)
    said, fresh = line.split("; not in the converted checkpoint, so started fresh: ")
    assert said == f"resumed from {converted} at step 5: model and optimizer state"
    assert fresh == ("schedule (the learning rate follows this run's, from the step), data position (the data start "
                     "at their beginning), RNG state")
    ours = {"step": 5, "strategy": "fsdp"}  # a step dir a run saved: no `lacks`
    assert resumed_line(Path("ckpt/step_00000005"), 5, ours, data_kept=True) == (
        "resumed from ckpt/step_00000005 at step 5: model, optimizer state, schedule, data position and RNG state")
    assert resumed_line(Path("c"), 5, ours, data_kept=False).endswith("model, optimizer state, schedule and RNG state")


@pytest.mark.slow
def test_a_resume_from_a_deepspeed_checkpoint_claims_only_what_it_restored(tmp_path):
    source = universal_checkpoint(tmp_path / "universal")
    result = run_cli(f"checkpoint.resume={source}", "train.max_steps=7", f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 0, result.stderr[-3000:]
    lacks = next(line for line in result.stdout.splitlines() if "it lacks" in line)
    resumed = next(line for line in result.stdout.splitlines() if "] resumed from" in line)
    assert "the data position" in lacks
    assert resumed.endswith("at step 5: model and optimizer state; not in the converted checkpoint, so started "
                            "fresh: schedule (the learning rate follows this run's, from the step), data position "
                            "(the data start at their beginning), RNG state"), resumed


def hub_cache(home: Path, repo: str, kind: str, files: dict[str, Path | str]) -> Path:
    """`repo` in a Hugging Face cache under `home` (HF_HOME), in the Hub's layout: refs/main names a
    commit, snapshots/<commit>/ holds the files (blobs/ and symlinks are the Hub's way of sharing
    files between revisions; huggingface_hub finds a snapshot without them)."""
    import shutil

    commit = "0123456789abcdef0123456789abcdef01234567"
    folder = home / "hub" / f"{kind}s--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    snapshot = folder / "snapshots" / commit
    for name, content in files.items():
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, Path):
            shutil.copy(content, snapshot / name)
        else:
            (snapshot / name).write_text(content)
    return snapshot


def test_hub_names_resolve_to_the_cache_and_a_missing_one_is_one_line(hf_assets, tmp_path, monkeypatch, capsys):
    """In this process, with huggingface_hub's settings as HF_HOME and HF_HUB_OFFLINE=1 make them."""
    from huggingface_hub import constants
    from omegaconf import OmegaConf

    from trainer.errors import ConfigError
    from trainer.hub import resolve_names

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    model = hub_cache(tmp_path / "hf", "tiny-org/qwen2", "model",
                      {p.name: p for p in hf_assets.pretrained["qwen2"].iterdir()})
    data = hub_cache(tmp_path / "hf", "tiny-org/chat", "dataset", {"train.jsonl": "{}\n", "test.jsonl": "{}\n"})
    cfg = OmegaConf.create({"model": {"kind": "hf", "path": "tiny-org/qwen2", "revision": None},
                            "data": {"name": "chat", "path": "tiny-org/chat", "val_path": None, "tokenizer": None,
                                     "revision": None}})
    resolve_names(cfg)
    assert (cfg.model.path, cfg.data.path) == (str(model), str(data))
    from trainer.data.tokenized import data_files

    assert data_files(data, "data.path")[1] == [data / "train.jsonl"]  # the train split, as load_dataset reads it
    local = OmegaConf.create({"model": {"kind": "hf", "path": str(model)}, "data": {"name": "hf", "path": "x/y.jsonl"}})
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "y.jsonl").write_text("{}\n")
    monkeypatch.chdir(tmp_path)
    resolve_names(local)  # local paths stay as they are, even where they look like names
    assert (local.model.path, local.data.path) == (str(model), "x/y.jsonl")
    for node, error in ((cfg.model, "model.path: tiny-org/absent is not a local path"),
                        (cfg.data, "data.path: tiny-org/absent is not a local path")):
        node.path = "tiny-org/absent"
        with pytest.raises(ConfigError, match=f"^{error}, the Hugging Face cache .* has no copy of it, "
                                              "HF_HUB_OFFLINE=1 forbids a download$"):
            resolve_names(cfg)
        node.path = "tiny-org/qwen2" if node is cfg.model else "tiny-org/chat"
    cfg.model.path, cfg.model.revision = "tiny-org/qwen2", "v2"  # a revision the cache does not hold
    with pytest.raises(ConfigError, match="^model.path: tiny-org/qwen2@v2 is not a local path"):
        resolve_names(cfg)
    # the planner reads the model's config from the cache, and no data (a name the cache lacks is no matter)
    from trainer.plan import main as plan

    capsys.readouterr()
    plan(["model=hf", "model.path=tiny-org/qwen2", "data=chat", "data.path=tiny-org/absent", "plan.world_size=2"])
    assert capsys.readouterr().out.startswith(f"{sum(p.numel() for p in model_parameters(model)):,} parameters")


def model_parameters(folder: Path):
    from transformers import AutoModelForCausalLM

    return list(AutoModelForCausalLM.from_pretrained(str(folder)).parameters())


@pytest.mark.slow
def test_a_model_and_data_by_hub_names_train_from_the_cache_offline(hf_assets, tmp_path):
    """model.path=org/name and data.path=org/name with HF_HUB_OFFLINE=1, from a cache filled in the
    Hub's layout: the run trains LoRA on chat data from them (at LoRA's learning rate, said on the
    start line) with its own data.chat_template, ends naming its checkpoint and the export command,
    whose adapter folder holds the tokenizer with that template; a name the cache lacks is one line."""
    from transformers import AutoTokenizer

    from trainer.demo import CHAT_TEMPLATE as CHATML
    from trainer.demo import conversations, make_model_dir, train_chat_tokenizer, write_rows

    tokenizer = train_chat_tokenizer(tmp_path / "chat_tokenizer", hf_assets.docs)
    model = make_model_dir(tmp_path / "qwen2", "qwen2", weights=True, tokenizer=tokenizer)
    hub_cache(tmp_path / "hf", "tiny-org/qwen2-chat", "model", {p.name: p for p in model.iterdir()})
    rows = write_rows(tmp_path / "rows.jsonl", conversations(hf_assets.docs, n=120))
    snapshot = hub_cache(tmp_path / "hf", "tiny-org/chats", "dataset", {
        "data/train-00000-of-00001.jsonl": rows, "README.md": "---\nlicense: other\n---\n",
        "data/test-00000-of-00001.jsonl": json.dumps({"messages": [{"role": "user"}]}) + "\n"})  # unreadable
    template = tmp_path / "chatml.jinja"
    template.write_text("{#- the run's own copy of ChatML -#}" + CHATML)
    # HF_HUB_CACHE, where the caller's environment sets it, would win over HF_HOME: pointed at the same place
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": str(tmp_path / "hf" / "hub"), "HF_HUB_OFFLINE": "1"}
    ckpt = tmp_path / "ckpt"
    result = run_cli("model=hf", "model.path=tiny-org/qwen2-chat", "data=chat", "data.path=tiny-org/chats",
                     f"data.chat_template={template}", "peft=lora", "train.max_steps=3", "model.seq_len=64",
                     "train.micro_batch_size=4", f"data.cache_dir={tmp_path / 'tokens'}", f"checkpoint.dir={ckpt}",
                     f"hydra.run.dir={tmp_path / 'run'}", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "model.path: tiny-org/qwen2-chat is " in out and f"data.path: tiny-org/chats is {snapshot}" in out
    assert "lr=0.0001 weight_decay=0 " in out
    done = next(line for line in out.splitlines() if "] done: 3 steps" in line)
    assert (f"; saved {ckpt / 'step_00000003'} (python -m trainer.export {ckpt} OUT_DIR writes the LoRA adapters "
            "as a PEFT folder; with --merge, the merged model)") in done
    assert len([r for r in records(tmp_path / "run") if "loss" in r and "split" not in r]) == 1  # log_every=10: the last
    exported = run_cli(str(ckpt), str(tmp_path / "adapters"), launcher=[sys.executable, "-m", "trainer.export"])
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert AutoTokenizer.from_pretrained(str(tmp_path / "adapters")).chat_template == template.read_text()
    missing = run_cli("model=hf", "model.path=tiny-org/absent", f"hydra.run.dir={tmp_path / 'run2'}", env=env)
    assert_refused(missing, "model.path: tiny-org/absent is not a local path", "has no copy of it",
                   "HF_HUB_OFFLINE=1 forbids a download")
