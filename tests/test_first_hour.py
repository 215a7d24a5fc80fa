"""What a new user meets in the first hour — messages, files and launch scripts."""
from __future__ import annotations

import json
import math
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import REPO, assert_refused, records, refusal, run_cli

SHORT = ["train.max_steps=4", "train.log_every=2"]


def lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory):
    """One 1-rank run of 6 steps (global batch 8) that checkpoints at its end."""
    root = tmp_path_factory.mktemp("first_hour")
    result = run_cli(f"checkpoint.dir={root / 'ckpt'}", "checkpoint.every_steps=3", "train.max_steps=6",
                     "train.log_every=1", f"hydra.run.dir={root / 'run'}")
    assert result.returncode == 0, result.stderr[-3000:]
    shutil.copytree(root / "ckpt" / "step_00000003", root / "kept" / "step_00000003")  # others' saves prune it
    return root


def test_a_run_with_nothing_left_to_do_says_so(checkpointed, tmp_path):
    result = run_cli(f"checkpoint.dir={checkpointed / 'ckpt'}", "train.max_steps=6", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "nothing to do" in result.stdout and "step 6" in result.stdout and "train.max_steps" in result.stdout
    assert "nan" not in result.stdout and not (tmp_path / "metrics.jsonl").exists()


def test_tokens_count_what_was_trained_across_a_resume_at_another_world_size(checkpointed, tmp_path):
    # 6 steps x 8 sequences x 64 tokens at 1 rank, then 2 ranks x 8 sequences per step
    result = run_cli(f"checkpoint.resume={checkpointed / 'ckpt' / 'step_00000006'}", "train.max_steps=8",
                     "train.log_every=1", "nproc=2", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert [(r["step"], r["tokens"]) for r in records(tmp_path)] == [(7, 6 * 512 + 1024), (8, 6 * 512 + 2 * 1024)]
    assert lines(tmp_path)[0] == {"event": "resumed", "step": 6,
                                  "from": str(checkpointed / "ckpt" / "step_00000006")}


def test_a_run_dir_holds_one_run_unless_it_resumes(checkpointed, tmp_path):
    again = run_cli(*SHORT, f"hydra.run.dir={checkpointed / 'run'}")
    assert_refused(again, "already holds another run's metrics.jsonl")
    assert [r["event"] for r in lines(checkpointed / "run") if "event" in r] == ["end"]
    run = tmp_path / "run"
    shutil.copytree(checkpointed / "run", run)
    resumed = run_cli(f"checkpoint.dir={checkpointed / 'ckpt'}", "train.max_steps=7", f"hydra.run.dir={run}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["event"] for r in lines(run) if "event" in r] == ["end", "resumed", "end"]


def test_a_refused_run_leaves_no_run_dir(tmp_path):
    result = run_cli("train.micro_batch_size=0", cwd=tmp_path)
    assert_refused(result, "train.micro_batch_size")
    assert not (tmp_path / "outputs").exists() or not any((tmp_path / "outputs").iterdir())


def test_the_log_is_the_programs_and_the_start_line_says_what_runs(tmp_path):
    result = run_cli("strategy=fsdp", "nproc=2", "train.precision=bf16", *SHORT, f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    start = next(line for line in result.stdout.splitlines() if "world_size=" in line)
    for fact in ("strategy=fsdp world_size=2", "precision=bf16", "sharding=FULL_SHARD", "offload=none",
                 "activation_checkpointing=off", "global_batch=16"):
        assert fact in start, start
    assert not (tmp_path / "__main__.log").exists()
    log = (tmp_path / "trainer.log").read_text()
    assert "strategy=fsdp world_size=2" in log and "done: 4 steps" in log
    assert all(line.startswith("[trainer]") for line in result.stdout.splitlines() if line.strip())


@pytest.mark.slow  # make test stays under 8 minutes: the rest of what it covers is in the quick suite
def test_a_context_longer_than_learned_positions_is_refused_and_warned_for_computed_ones(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.demo import make_model_dir

    gpt2 = AutoConfig.for_model("gpt2", vocab_size=512, n_embd=32, n_layer=2, n_head=4, n_positions=128,
                                bos_token_id=0, eos_token_id=0)
    AutoModelForCausalLM.from_config(gpt2).save_pretrained(str(tmp_path / "gpt2"))
    result = run_cli("model=hf", f"model.path={tmp_path / 'gpt2'}", "model.seq_len=256", "data=synthetic", cwd=tmp_path)
    assert assert_refused(result) == (
        "trainer: error: model.seq_len: 256 is longer than this gpt2 model's 128 positions, which are learned "
        "(transformer.wpe: one row per position); use model.seq_len <= 128")
    qwen2 = make_model_dir(tmp_path / "qwen2", "qwen2", weights=False)  # rotary: it runs, with a warning
    result = run_cli("model=hf", f"model.path={qwen2}", "model.seq_len=256", "data=synthetic", "train.max_steps=1",
                     f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "model.seq_len=256 is longer than the 128 positions (max_position_embeddings) this qwen2 model was " \
           "made for" in result.stdout


def test_export_names_its_step_and_files_follow_the_umask(checkpointed, tmp_path):
    ckpt = checkpointed / "ckpt" / "step_00000006"
    umask = os.umask(0o022)
    try:
        done = subprocess.run([sys.executable, "-m", "trainer.export", str(checkpointed / "ckpt"),
                               str(tmp_path / "w.safetensors")], capture_output=True, text=True)
    finally:
        os.umask(umask)
    assert done.returncode == 0, done.stderr
    newest = int((checkpointed / "ckpt" / "latest").read_text().strip().removeprefix("step_"))  # other tests resume it
    assert f"of step {newest} (ddp, world size " in done.stdout
    for f in [tmp_path / "w.safetensors", ckpt / "rank_00000.safetensors"]:
        assert stat.S_IMODE(f.stat().st_mode) == 0o644, f  # the suite's runs inherit umask 022


@pytest.mark.parametrize("args,fragments", [
    (["train.max_step=10"], ["train.max_step: no such setting; did you mean train.max_steps?"]),
    (["+train.max_step=10"], ["train.max_step: no such setting; did you mean train.max_steps?"]),
    (["data.path=/nonexistent/missing.txt", "nproc=2"], ["data.path: no file /nonexistent/missing.txt"]),
])
def test_mistakes_are_one_line_errors(tmp_path, args, fragments):
    result = run_cli(*args, f"hydra.run.dir={tmp_path}")
    assert_refused(result, *fragments)
    assert len(result.stderr.strip().splitlines()) <= 2, result.stderr


@pytest.mark.parametrize("args,fragment", [
    (["plan.gpu_memory=80"], "plan.gpu_memory: no such setting; did you mean plan.gpu_memory_gb?"),
    (["model=gpt2"], "model: allowed values: custom, gpt_125m, gpt_1b, hf, llama2_7b, small, tiny; got gpt2"),
])
def test_the_planner_gives_the_same_one_line_errors(args, fragment):
    result = run_cli(*args, launcher=[sys.executable, "-m", "trainer.plan"])
    assert_refused(result, fragment, prog="trainer.plan")


@pytest.mark.slow  # a launcher (tests/test_launchers.py: the others)
def test_the_launch_script_uses_the_active_environments_torchrun(tmp_path):
    env = {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}  # as `source .venv/bin/activate`
    result = run_cli("2", *SHORT, f"hydra.run.dir={tmp_path}", launcher=[str(REPO / "launch/torchrun.sh")], env=env,
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["step"] for r in records(tmp_path)] == [2, 4]


def test_a_resume_says_what_it_changes(checkpointed, tmp_path):
    """From step 3 of a 6-step, batch-8 run saved with checkpoint.dir: batch 16, 8 steps, no
    checkpoint.dir, a new run dir."""
    ckpt = checkpointed / "kept" / "step_00000003"
    result = run_cli(f"checkpoint.resume={ckpt}", "train.max_steps=8", "train.micro_batch_size=16",
                     f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    said = [line.removeprefix("[trainer] resume: ") for line in result.stdout.splitlines() if "resume:" in line]
    assert len(said) == 4, result.stdout
    assert said[0].startswith("the checkpoint was trained at global batch 8 and this run's is 16")
    # step 4 is inside the warmup, where the schedule's end changes nothing: no rates are named
    assert said[1] == "the learning-rate schedule now ends at step 8, not 6: optim.schedule_steps=6 keeps the old end"
    assert said[2] == f"the steps before 4 are in {checkpointed / 'run'}/metrics.jsonl"
    assert said[3] == "no checkpoint.dir: nothing of this run is saved (checkpoint.resume only reads)"


def test_early_stopping_saves_the_step_it_stops_at_and_names_the_best(tmp_path):
    """At lr 0 the val loss never falls: evaluations at steps 3 (the best), 6 and 9 (two without a
    lower loss) stop the run at step 9 of 20, which is no checkpoint.every_steps step but is saved."""
    ckpt = tmp_path / "ckpt"
    result = run_cli("optim.lr=0", "train.max_steps=20", "train.log_every=3", "data.val_fraction=0.1",
                     "eval.every_steps=3", "eval.early_stop_patience=2", f"checkpoint.dir={ckpt}",
                     "checkpoint.every_steps=4", "checkpoint.keep_last=0", f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "early stop after step 9: no lower val loss in 2 evaluations (eval.early_stop_patience=2); the best" \
        in result.stdout
    rows = lines(tmp_path / "run")
    vals = {r["step"]: r["loss"] for r in rows if r.get("split") == "val"}
    assert sorted(vals) == [3, 6, 9]
    events = [r for r in rows if "event" in r]
    assert events[-2] == {"event": "early_stop", "step": 9, "best_step": 3, "best_val_loss": vals[3]}
    assert events[-1]["event"] == "end" and events[-1]["step"] == 9
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_00000004", "step_00000008", "step_00000009"]


@pytest.mark.slow
def test_early_stopping_counts_on_across_a_resume(tmp_path):
    """Evaluations at 2 (the best) and 4 before the save at step 4; after the resume 6 and 8 make
    three without a lower loss: the run stops at 8 (counting afresh, it would stop at 12)."""
    common = ["optim.lr=0", "data.val_fraction=0.1", "eval.every_steps=2", "eval.early_stop_patience=3",
              f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.every_steps=4"]
    first = run_cli(*common, "train.max_steps=4", f"hydra.run.dir={tmp_path / 'first'}")
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = run_cli(*common, "train.max_steps=20", f"hydra.run.dir={tmp_path / 'resumed'}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    events = [r for r in lines(tmp_path / "resumed") if "event" in r]
    assert events[-2]["event"] == "early_stop" and (events[-2]["step"], events[-2]["best_step"]) == (8, 2), events


def test_keep_best_keeps_the_lowest_val_losses_besides_the_newest(tmp_path):
    """Step dirs 1-5 saved with val losses NaN, 3.0, 1.0, 2.0 and none (no evaluation at step 5)."""
    from trainer.checkpoint.format import FORMAT_VERSION
    from trainer.checkpoint.manager import CheckpointManager
    from trainer.config import CheckpointConfig

    def kept(keep_best: int) -> list[int]:
        root = tmp_path / str(keep_best)
        for step, val_loss in enumerate([float("nan"), 3.0, 1.0, 2.0, None], start=1):
            (root / f"step_{step:08d}").mkdir(parents=True)
            (root / f"step_{step:08d}" / "manifest.json").write_text(
                json.dumps({"format": FORMAT_VERSION, "step": step, "trainer": {"val_loss": val_loss}, "tensors": {}}))
        manager = CheckpointManager(CheckpointConfig(dir=str(root), keep_last=1, keep_best=keep_best), None, "ddp")
        manager._prune(keep=root / "step_00000005")
        return sorted(int(p.name.removeprefix("step_")) for p in root.glob("step_*"))

    assert kept(0) == [5]
    assert kept(1) == [3, 5]
    assert kept(2) == [3, 4, 5]
    assert kept(3) == [2, 3, 4, 5]  # a NaN val loss is never among the best


def test_a_nan_val_loss_counts_neither_as_better_nor_as_worse():
    from trainer.training.steps import EarlyStop

    stop = EarlyStop(patience=2)
    assert [stop.update(step, loss) for step, loss in [(1, 2.0), (2, math.nan), (3, 3.0), (4, math.nan)]] == [False] * 4
    assert (stop.best, stop.best_step, stop.worse) == (2.0, 1, 1)
    assert stop.update(5, 2.5)


@pytest.mark.parametrize("setting", ["eval.early_stop_patience=2", "checkpoint.keep_best=1"])
def test_what_compares_val_losses_is_refused_without_validation_data(tmp_path, setting):
    key = setting.split("=")[0]
    assert refusal(tmp_path, setting) == (f"{key}: compares validation losses, and there is no validation data: set "
                                          "data.val_fraction or data.val_path")
    refusal_free = [setting, "data.val_fraction=0.1"]
    with pytest.raises(AssertionError, match="not refused"):
        refusal(tmp_path, *refusal_free)


def test_an_empty_validation_split_is_refused_before_training(tmp_path):
    result = run_cli("data.val_fraction=0.0001", "train.max_steps=2", f"hydra.run.dir={tmp_path}")
    assert_refused(result, "data.val_fraction: the validation split holds no row of model.seq_len=64 tokens with a "
                           "target; give more validation data, or none")
    assert not (tmp_path / "metrics.jsonl").exists() or "loss" not in (tmp_path / "metrics.jsonl").read_text()
