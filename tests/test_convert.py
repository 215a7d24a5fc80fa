"""Checkpoints in and out of other libraries' formats. The other side is always a program
written against that library's API alone (tests/foreign.py), run as a subprocess: a plain FSDP2
loop saving torch DCP, a plain DeepSpeed ZeRO-2 loop, accelerate's save_state under DeepSpeed; and
programs that load what the trainer converts for them."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.harness import (
    CPU_ONLY,
    REPO,
    assert_refused,
    assert_resumes,
    case,
    crossings,
    full_state,
    on_ranks,
    records,
    resuming,
    run_cli,
    saving,
    train_cases,
    with_overrides,
)
from trainer.checkpoint.convert import detect, read
from trainer.checkpoint.format import read_manifest

SEQ = 32
STEPS = 3  # the foreign programs' steps


def foreign(command: str, **options) -> None:
    args = [f"--{k}={v}" for k, v in options.items()]
    done = subprocess.run([sys.executable, "-m", "tests.foreign", command, *args], cwd=REPO, capture_output=True,
                          text=True, env={**__import__("os").environ, **CPU_ONLY})
    assert done.returncode == 0, done.stderr[-3000:]


def convert(src: Path, dst: Path, to: str) -> str:
    done = subprocess.run([sys.executable, "-m", "trainer.convert", str(src), str(dst), "--to", to], cwd=REPO,
                          capture_output=True, text=True, env={**__import__("os").environ, **CPU_ONLY})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def model_node(path: Path) -> dict:
    return {"name": "hf", "kind": "hf", "path": str(path), "seq_len": SEQ, "vocab_size": 512}


@pytest.fixture(scope="module")
def neox(tmp_path_factory) -> Path:
    from trainer.demo import make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("neox") / "model", "gpt_neox", weights=True)


@pytest.fixture(scope="module")
def saved(neox, tmp_path_factory):
    """A plain FSDP2 loop's DCP checkpoint and a plain DeepSpeed ZeRO-2 loop's, each at 2 ranks."""
    root = tmp_path_factory.mktemp("foreign")
    foreign("fsdp2_save_dcp", model=neox, out=root / "dcp", steps=STEPS)
    foreign("ds_zero2_save", model=neox, out=root / "deepspeed", steps=STEPS)
    foreign("accelerate_ds_save", model=neox, out=root / "accelerate", steps=STEPS)
    return root


def full_state_after_loading(env, cfg: dict, step_dir: str) -> dict | None:
    """What a strategy holds after loading `step_dir`: every parameter and Adam moment, whole, on rank 0."""
    from tests.test_core_behaviour import build
    from trainer.checkpoint.manager import CheckpointManager
    from trainer.config import to_config

    strategy, _, _ = build(env, cfg)
    CheckpointManager(to_config(cfg).checkpoint, strategy, cfg["strategy"]["name"]).load(Path(step_dir))
    full = full_state(strategy, model_only=False)
    strategy.teardown()
    return full


def assert_state_equals(full: dict, truth: dict, what: str) -> None:
    for name, value in truth["params"].items():
        if f"model.{name}" not in full:  # a tied matrix's second name
            continue
        assert torch.equal(full[f"model.{name}"].view_as(value), value), (what, name)
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(full[f"optim.{name}.{moment}"].view_as(value), truth[moment][name]), (what, name, moment)
    assert full["optim.step"].item() == truth["step"], what


# Each source converts and resumes; the strategies that load the converted step dir (our own format,
# loaded by every strategy in test_checkpoint.py) each at least once, the product under FULL_MATRIX.
LOADED = crossings((["dcp", "deepspeed", "accelerate"], [("fsdp", 1), ("zero3", 2)]),
                   [("dcp", ("zero3", 2)), ("deepspeed", ("fsdp", 1)), ("accelerate", ("fsdp", 1))])


@pytest.mark.slow
@pytest.mark.parametrize("source", ["dcp", "deepspeed", "accelerate"])
def test_a_foreign_checkpoint_resumes_exactly_and_trains_on(saved, neox, tmp_path, source):
    """From a plain FSDP2 loop (DCP), a plain DeepSpeed ZeRO-2 loop, accelerate's save_state under
    DeepSpeed (a DeepSpeed dir whose tag is `pytorch_model`), each at 2 ranks: the converted step
    dir holds their weights and Adam moments exactly, and a strategy that loads it holds them too."""
    src = saved / source
    kind = detect(src)
    assert kind == {"accelerate": "deepspeed"}.get(source, source)
    truth = torch.load(src / "expected.pt", weights_only=False)
    said = convert(src, tmp_path / "ours", "trainer")
    assert f"step {truth['step']}" in said and "lacks" in said and "data position" in said, said
    step_dir = tmp_path / "ours" / f"step_{truth['step']:08d}"
    assert_state_equals(as_keys(read(step_dir)), truth, f"{kind} -> trainer")
    for loaded_by, (strategy, world) in LOADED:
        if loaded_by == source:
            cfg = with_overrides(case(strategy), train__micro_batch_size=8 // world, data__name="synthetic")
            cfg["model"] = model_node(neox)
            full = on_ranks(world, full_state_after_loading, cfg, str(step_dir))[0]
            assert_state_equals(full, truth, f"{kind} -> {strategy}@{world}")
    # checkpoint.resume takes the foreign dir itself, converts it once and trains on
    run = tmp_path / "run"
    result = run_cli("model=hf", f"model.path={neox}", f"model.seq_len={SEQ}", "data=synthetic", "strategy=fsdp",
                     "nproc=1", f"checkpoint.resume={src}", f"train.max_steps={truth['step'] + 2}", "train.log_every=1",
                     f"hydra.run.dir={run}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"checkpoint.resume: the {kind} checkpoint {src} converted to" in result.stdout, result.stdout
    assert [r["step"] for r in records(run)] == [truth["step"] + 1, truth["step"] + 2]


@pytest.fixture(scope="module")
def ours(neox, tmp_path_factory):
    """A trainer run on the same model, zero2 at 2 ranks, saved at its last step."""
    root = tmp_path_factory.mktemp("ours")
    cfg = with_overrides(case("zero2", steps=STEPS), data__name="synthetic", checkpoint__dir=str(root / "ckpt"))
    cfg["model"] = model_node(neox)
    on_ranks(2, train_cases, {"zero2": cfg}, str(root))
    return root / "ckpt"


def as_keys(p) -> dict:
    """A Portable in the trainer's keys (model.NAME, optim.NAME.exp_avg, optim.step)."""
    full = {f"model.{n}": w for n, w in p.weights.items()}
    full.update({f"optim.{n}.{k}": v for n, m in p.moments.items() for k, v in m.items()})
    full["optim.step"] = torch.tensor(float(p.step))
    return full


@pytest.mark.slow
def test_ours_converted_to_dcp_loads_into_a_plain_fsdp2_program_at_3_ranks(ours, neox, tmp_path):
    convert(ours, tmp_path / "dcp", "dcp")
    foreign("fsdp2_load_dcp", model=neox, dcp=tmp_path / "dcp", out=tmp_path / "loaded.pt", nproc=3)
    assert_state_equals(as_keys(read(ours)), torch.load(tmp_path / "loaded.pt", weights_only=False),
                        "ours -> dcp -> fsdp2@3")


@pytest.mark.slow
def test_ours_converted_to_deepspeed_universal_loads_into_an_engine(ours, neox, tmp_path):
    convert(ours, tmp_path / "universal", "deepspeed")
    foreign("ds_load_universal", model=neox, ckpt=tmp_path / "universal", out=tmp_path / "loaded.pt", nproc=1)
    assert_state_equals(as_keys(read(ours)), torch.load(tmp_path / "loaded.pt", weights_only=False),
                        "ours -> universal -> deepspeed@1")


@pytest.mark.slow
def test_a_tp2_checkpoint_converted_to_deepspeed_universal_loads_into_an_engine_at_tp1(tmp_path):
    """--to deepspeed of a checkpoint saved at tp=2 (fsdp, a Qwen2: q, k, v, gate and up split by rows, o and
    down by columns, its tied embedding whole): the tensors are whole in the universal checkpoint, and a
    DeepSpeed engine of one rank, without tensor parallelism, loads the checkpoint's weights and moments exactly."""
    from trainer.demo import make_model_dir

    qwen2 = make_model_dir(tmp_path / "qwen2", "qwen2", weights=True)
    cfg = with_overrides(case("fsdp", steps=2), data__name="synthetic", checkpoint__dir=str(tmp_path / "ckpt"),
                         strategy__tp=2)
    cfg["model"] = model_node(qwen2)
    on_ranks(2, train_cases, {"tp2": cfg}, str(tmp_path))
    convert(tmp_path / "ckpt", tmp_path / "universal", "deepspeed")
    foreign("ds_load_universal", model=qwen2, ckpt=tmp_path / "universal", out=tmp_path / "loaded.pt", nproc=1)
    assert_state_equals(as_keys(read(tmp_path / "ckpt")), torch.load(tmp_path / "loaded.pt", weights_only=False),
                        "tp2 -> universal -> deepspeed@1")


@pytest.mark.slow
def test_ours_converted_to_hf_loads_with_from_pretrained_and_a_stranger_is_refused(ours, tmp_path):
    from transformers import AutoModelForCausalLM

    convert(ours, tmp_path / "hf", "hf")
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    mine = read(ours)
    for name, value in model.named_parameters():
        assert torch.equal(value.detach(), mine.weights[name]), name
    (tmp_path / "stranger").mkdir()
    done = subprocess.run([sys.executable, "-m", "trainer.convert", str(tmp_path / "stranger"), str(tmp_path / "x"),
                           "--to", "dcp"], cwd=REPO, capture_output=True, text=True)
    assert_refused(done, "not a checkpoint this trainer reads", prog="trainer.convert")
    assert done.stderr.startswith("trainer.convert: error: "), done.stderr


def round_trip(env, out_dir: str) -> dict:
    """The tiny reference model trained 3 steps with a checkpoint; that converted to DCP and back."""
    from trainer.checkpoint.convert import convert as convert_in_process
    from trainer.checkpoint.resume import latest_checkpoint

    cfg = case("ddp", steps=3)
    cfg["checkpoint"] = {"dir": f"{out_dir}/ckpt"}
    train_cases(env, {"run": cfg}, out_dir)
    said = convert_in_process(Path(out_dir) / "ckpt", Path(out_dir) / "dcp", "dcp")
    said += "\n" + convert_in_process(Path(out_dir) / "dcp", Path(out_dir) / "back", "trainer")
    return {"said": said, "ours": str(latest_checkpoint(Path(out_dir) / "ckpt"))}


def test_ours_to_dcp_and_back_is_exact_and_keeps_the_trainer_state(tmp_path):
    result = on_ranks(1, round_trip, str(tmp_path))[0]
    assert detect(tmp_path / "dcp") == "dcp" and detect(tmp_path / "back") == "trainer"
    first, back = read(Path(result["ours"])), read(tmp_path / "back")
    assert back.step == first.step == 3 and back.weights.keys() == first.weights.keys()
    assert all(torch.equal(back.weights[n], w) for n, w in first.weights.items())
    assert all(torch.equal(back.moments[n][k], m[k]) for n, m in first.moments.items() for k in m)
    assert back.train["data"] == first.train["data"]  # the data position rode along in DCP's "train"
    assert "lacks the RNG state" in result["said"] and "data position" not in result["said"]


# -- issue 27, item 10: convert writes what the checkpoints and export write -----------------------

def test_a_converted_step_dir_appears_only_complete_and_flushed(tmp_path, monkeypatch):
    """--to trainer publishes its step dir as a save does: files flushed under a temporary name,
    renamed last; a conversion that dies (here: writing the manifest) leaves no step dir, no `latest`."""
    import json
    import os

    from trainer.checkpoint.convert import WRITERS, Portable

    portable = Portable({"w": torch.arange(6.0).view(2, 3)}, {}, 5)
    flushed, fsync = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (flushed.append(os.readlink(f"/proc/self/fd/{fd}")), fsync(fd))[1])
    root = tmp_path / "ok"
    final = WRITERS["trainer"](portable, root)
    tmp = root / ".tmp-step_00000005"
    assert final == root / "step_00000005" and (root / "latest").read_text().strip() == final.name
    assert {str(tmp / "rank_00000.safetensors"), str(tmp / "manifest.json"), str(tmp), str(root)} <= set(flushed)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000005"]

    def disk_full(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(json, "dumps", disk_full)
    with pytest.raises(OSError):
        WRITERS["trainer"](portable, tmp_path / "died")
    assert not list((tmp_path / "died").glob("step_*")) and not (tmp_path / "died" / "latest").exists()


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A LoRA run on Phi-3 at 1 rank, 4 steps, saving at 2 and 4."""
    from tests.test_lora import lora_case, make_phi3

    root = tmp_path_factory.mktemp("lora_convert")
    cfg = lora_case(make_phi3(root / "phi3"), "ddp", 1, steps=4)
    on_ranks(1, train_cases, {"straight": saving(cfg, root / "ckpt", 2)}, str(root))
    return root, cfg


@pytest.mark.slow
def test_a_lora_step_dir_converted_to_trainer_resumes(lora_run):
    from trainer.checkpoint.convert import convert as convert_in_process

    root, cfg = lora_run
    said = convert_in_process(root / "ckpt" / "step_00000002", root / "converted", "trainer")
    assert "lacks the frozen base weights" in said, said
    assert read_manifest(root / "converted" / "step_00000002")["base"] == read_manifest(
        root / "ckpt" / "step_00000002")["base"]
    on_ranks(1, train_cases, {"resumed": resuming(cfg, root / "converted", 2)}, str(root))
    assert_resumes(records(root / "resumed"), records(root / "straight"), at=2, what="converted LoRA")


def safetensors_equal(a: Path, b: Path) -> None:
    from safetensors.torch import load_file

    first, second = load_file(str(a)), load_file(str(b))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first), (a, b)


def test_a_lora_step_dir_converted_to_hf_is_what_export_writes(lora_run, tmp_path):
    """--to hf: the PEFT adapter folder export writes; --to hf --merge: export --merge's model folder."""
    from trainer.checkpoint.convert import convert as convert_in_process
    from trainer.checkpoint.export import export

    root, _ = lora_run
    step = root / "ckpt" / "step_00000004"
    for merge, weights in ((False, "adapter_model.safetensors"), (True, "model.safetensors")):
        exported, converted = tmp_path / f"export_{merge}", tmp_path / f"convert_{merge}"
        export(step, exported, merge)
        convert_in_process(step, converted, "hf", merge)
        assert sorted(p.name for p in converted.iterdir()) == sorted(p.name for p in exported.iterdir())
        safetensors_equal(converted / weights, exported / weights)
        config = "config.json" if merge else "adapter_config.json"
        assert (converted / config).read_text() == (exported / config).read_text()


@pytest.mark.slow
def test_buffers_come_through_conversion_to_trainer(tmp_path):
    """The toy model's running statistics (a float mean, an int64 count) are in the converted step
    dir with their values and dtypes."""
    from tests.test_resume_state import buffers_at, toy_case
    from trainer.checkpoint.convert import convert as convert_in_process

    on_ranks(1, train_cases, {"toy": saving(toy_case("ddp", 1), tmp_path / "ckpt", 6)}, str(tmp_path))
    convert_in_process(tmp_path / "ckpt", tmp_path / "converted", "trainer")
    saved, converted = buffers_at(tmp_path / "ckpt" / "step_00000006"), buffers_at(
        tmp_path / "converted" / "step_00000006")
    assert set(saved) == {"stats.mean", "stats.count"} and saved["stats.count"].item() == 6
    assert converted.keys() == saved.keys() and all(torch.equal(converted[n], saved[n]) for n in saved)
    assert read_manifest(tmp_path / "converted" / "step_00000006")["buffers"]["stats.count"]["dtype"] == "int64"


@pytest.mark.slow
def test_buffers_come_through_conversion_to_hf(tmp_path):
    """Gemma4's `layer_scalar` (persistent buffers, here not at their start value) in the folder
    `from_pretrained` loads."""
    from transformers import AutoModelForCausalLM

    from tests.toys import save_gemma4_with_scaled_buffers
    from trainer.checkpoint.convert import convert as convert_in_process

    save_gemma4_with_scaled_buffers(tmp_path / "gemma4")
    cfg = with_overrides(case("ddp", steps=1), data__name="synthetic", checkpoint__dir=str(tmp_path / "ckpt"),
                         strategy__wrap=["Gemma4TextDecoderLayer"])  # its _no_split_modules name vision/audio blocks
    cfg["model"] = {"name": "hf", "kind": "hf", "path": str(tmp_path / "gemma4"), "seq_len": 16, "vocab_size": 128}
    on_ranks(1, train_cases, {"gemma4": cfg}, str(tmp_path))
    convert_in_process(tmp_path / "ckpt", tmp_path / "hf", "hf")
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert [layer.layer_scalar.item() for layer in loaded.model.layers] == [0.5, 0.25]


def test_convert_to_deepspeed_without_an_engine_refuses_in_one_line(tmp_path):
    """trainer.checkpoint.convert builds no strategy: --to deepspeed needs the job's (trainer.convert)."""
    from trainer.checkpoint.convert import write_deepspeed
    from trainer.checkpoint.format import Portable
    from trainer.errors import CheckpointError

    with pytest.raises(CheckpointError, match="python -m trainer.convert") as refused:
        write_deepspeed(Portable({}, {}, 0, source={"model": {}}), tmp_path / "out", holding=None)
    assert "\n" not in str(refused.value)
    assert not Path(tmp_path / "out").exists()
