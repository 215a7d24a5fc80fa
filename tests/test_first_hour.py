"""Issue 12: what a new user meets in the first hour — messages, files and launch scripts."""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import REPO, records, run_cli

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
    assert again.returncode == 2 and "already holds another run's metrics.jsonl" in again.stderr
    assert [r["event"] for r in lines(checkpointed / "run") if "event" in r] == ["end"]
    run = tmp_path / "run"
    shutil.copytree(checkpointed / "run", run)
    resumed = run_cli(f"checkpoint.dir={checkpointed / 'ckpt'}", "train.max_steps=7", f"hydra.run.dir={run}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["event"] for r in lines(run) if "event" in r] == ["end", "resumed", "end"]


def test_a_refused_run_leaves_no_run_dir(tmp_path):
    result = run_cli("train.micro_batch_size=0", cwd=tmp_path)
    assert result.returncode == 2 and "train.micro_batch_size" in result.stderr
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


def test_a_deepspeed_op_build_is_announced_when_ninja_has_work_to_do(tmp_path):
    """DeepSpeed JIT-builds its CPU ops through torch's ninja runner: a build with work to do is
    said (once per build), one with nothing to do is silent. A stand-in build of one file."""
    import logging

    import torch.utils.cpp_extension as extensions

    from trainer.strategies.deepspeed import announce_op_builds

    if not shutil.which("ninja"):
        pytest.skip("no ninja here")
    build = tmp_path / "stand_in_op"
    build.mkdir()
    (build / "build.ninja").write_text("rule touch\n  command = touch $out\nbuild stand_in_op.so: touch\n")
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("trainer").addHandler(handler)
    own = extensions._run_ninja_build
    try:
        announce_op_builds()
        announce_op_builds()  # once installed, not twice
        extensions._run_ninja_build(str(build), False, "stand-in")
        assert (build / "stand_in_op.so").exists()
        assert said == [f"building DeepSpeed's op stand_in_op for this environment (once: about a minute; cached in "
                        f"{build})"]
        extensions._run_ninja_build(str(build), False, "stand-in")  # built: nothing to say
        assert len(said) == 1
    finally:
        extensions._run_ninja_build = own
        logging.getLogger("trainer").removeHandler(handler)


def test_a_context_longer_than_learned_positions_is_refused_and_warned_for_computed_ones(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from examples.tiny_hf import make_model_dir

    gpt2 = AutoConfig.for_model("gpt2", vocab_size=512, n_embd=32, n_layer=2, n_head=4, n_positions=128,
                                bos_token_id=0, eos_token_id=0)
    AutoModelForCausalLM.from_config(gpt2).save_pretrained(str(tmp_path / "gpt2"))
    result = run_cli("model=hf", f"model.path={tmp_path / 'gpt2'}", "model.seq_len=256", "data=synthetic", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
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
    assert result.returncode == 2
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) <= 2, result.stderr


def test_a_resume_that_cannot_split_the_data_is_refused_before_any_rank_starts(checkpointed, tmp_path):
    result = run_cli(f"checkpoint.resume={checkpointed / 'ckpt' / 'step_00000006'}", "nproc=5",
                     "train.max_steps=8", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2
    assert "consumed 48 samples of its epoch, which do not split over world size 5" in result.stderr
    assert "Traceback" not in result.stderr and "world_size=" not in result.stdout


@pytest.mark.parametrize("args,fragment", [
    (["plan.gpu_memory=80"], "plan.gpu_memory: no such setting; did you mean plan.gpu_memory_gb?"),
    (["model=gpt2"], "model: allowed values: custom, gpt_125m, gpt_1b, hf, llama2_7b, small, tiny; got gpt2"),
])
def test_the_planner_gives_the_same_one_line_errors(args, fragment):
    result = run_cli(*args, launcher=[sys.executable, "-m", "trainer.plan"])
    assert result.returncode == 2
    assert fragment in result.stderr and "Traceback" not in result.stderr, result.stderr[-2000:]


def test_the_launch_script_uses_the_active_environments_torchrun(tmp_path):
    env = {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}  # as `source .venv/bin/activate`
    result = run_cli("2", *SHORT, f"hydra.run.dir={tmp_path}", launcher=[str(REPO / "launch/torchrun.sh")], env=env,
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["step"] for r in records(tmp_path)] == [2, 4]
