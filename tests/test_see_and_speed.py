"""Loggers read back with each tool's reader, a quiet console, mfu and profiles,
torch.compile and grad_reduce on every strategy, the planner's traffic against what the runs
move, the device choice, and the wheel installed elsewhere."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.harness import (
    REPO,
    assert_refused,
    case,
    full_state,
    on_ranks,
    records,
    run_cli,
    train_cases,
)
from trainer.errors import ConfigError

STRATEGIES = ["ddp", "fsdp", "zero1", "zero2", "zero3"]


# -- loggers ------------------------------------------------------------------------------------

# -- console, mfu, profiles -----------------------------------------------------------------------

# -- compile, grad_reduce ---------------------------------------------------------------------------

# -- the planner's traffic against what the collectives carry ---------------------------------------

# -- devices, versions ------------------------------------------------------------------------------

def first_weights(env, strategy: str) -> dict:
    from tests.test_core_behaviour import build

    strategy_obj, _, _ = build(env, case(strategy))
    weights = full_state(strategy_obj)
    strategy_obj.teardown()
    return weights


def first_weights_each(env, strategies: list[str]) -> dict:
    return {strategy: first_weights(env, strategy) for strategy in strategies}


@pytest.mark.slow
def test_every_strategy_starts_from_the_same_cpu_seeded_weights():
    expected = on_ranks(1, first_weights, "ddp")[0]
    for strategy, got in on_ranks(2, first_weights_each, ["fsdp", "zero3"])[0].items():
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[k], expected[k]) for k in expected), strategy


def test_each_rank_takes_the_gpu_it_sees(monkeypatch):
    from trainer import distributed

    chosen = []
    monkeypatch.setenv(distributed.DEVICE_VARIABLE, "cuda")
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # srun --gpus-per-task=1
    assert distributed.pick_device(local_rank=3, local_world_size=4) == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)  # all of a node's GPUs visible
    assert distributed.pick_device(local_rank=3, local_world_size=4) == torch.device("cuda", 3)
    assert chosen == [0, 3]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(RuntimeError, match="local rank 3 of 4 sees 2 GPUs"):
        distributed.pick_device(local_rank=3, local_world_size=4)
    monkeypatch.setenv(distributed.DEVICE_VARIABLE, "cpu")  # train.device=cpu on a GPU box
    assert distributed.pick_device(local_rank=3, local_world_size=4) == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for CUDA where there is none")
def test_asking_for_cuda_without_a_gpu_is_a_clear_error(tmp_path):
    result = run_cli("train.device=cuda", f"hydra.run.dir={tmp_path}")
    assert_refused(result, "train.device: cuda was asked for")


def test_an_old_deepspeed_is_refused_with_the_version_it_needs():
    from trainer.strategies import MIN_DEEPSPEED, check_deepspeed_version

    with pytest.raises(ConfigError, match=f"DeepSpeed 0.17.0 is installed.*>= {MIN_DEEPSPEED}"):
        check_deepspeed_version("0.17.0")
    check_deepspeed_version(MIN_DEEPSPEED)
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'"deepspeed>={MIN_DEEPSPEED},' in pyproject


# -- the wheel --------------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_wheel_trains_plans_and_exports_from_another_directory(tmp_path):
    """`pip wheel .`, installed into a fresh venv (its dependencies lent by this one through a
    .pth file, so nothing is downloaded), then run from a directory with no conf/ in sight."""
    import sysconfig

    wheels = tmp_path / "wheels"
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(REPO)],
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-2000:]
    [wheel] = wheels.glob("strategy_trainer-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "lent.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    installed = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q",
                                str(wheel)], capture_output=True, text=True)
    assert installed.returncode == 0, installed.stderr[-2000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": ""}
    where = subprocess.run([str(python), "-c", "import trainer, trainer.conf; print(trainer.__file__)"],
                           capture_output=True, text=True, cwd=elsewhere, env=env)
    assert where.stdout.startswith(purelib), where.stdout + where.stderr  # the wheel, not this checkout
    trained = subprocess.run([str(venv / "bin" / "trainer"), "train.max_steps=2", "checkpoint.dir=ckpt",
                              "checkpoint.every_steps=2", "hydra.run.dir=run"], capture_output=True, text=True,
                             cwd=elsewhere, env=env)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert len(records(elsewhere / "run")) == 1
    planned = subprocess.run([str(python), "-m", "trainer.plan", "model=gpt_1b"], capture_output=True, text=True,
                             cwd=elsewhere, env=env)
    assert planned.returncode == 0 and "<- chosen" in planned.stdout, planned.stderr[-2000:]
    exported = subprocess.run([str(python), "-m", "trainer.export", "ckpt", "w.safetensors"], capture_output=True,
                              text=True, cwd=elsewhere, env=env)
    assert exported.returncode == 0 and (elsewhere / "w.safetensors").is_file(), exported.stderr[-2000:]


@pytest.mark.slow
def test_an_optuna_sweep_minimises_the_final_val_loss(tmp_path):
    result = run_cli("-m", "hydra/sweeper=optuna_lr", "hydra.sweeper.n_trials=2", "data.val_fraction=0.1",
                     "train.max_steps=6", "train.log_every=1", f"hydra.sweep.dir={tmp_path}", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    import yaml

    best = yaml.safe_load((tmp_path / "optimization_results.yaml").read_text())
    finals = [json.loads((tmp_path / job / "metrics.jsonl").read_text().splitlines()[-1])["val_loss"]
              for job in ("0", "1")]
    assert best["best_value"] == pytest.approx(min(finals))
    # each trial trained with the learning rate the sweeper chose for it: its config says so, and
    # the learning rates its steps used (metrics.jsonl) are that one's warmup, step / warmup_steps of it
    configs = [yaml.safe_load((tmp_path / job / ".hydra" / "config.yaml").read_text())["optim"] for job in ("0", "1")]
    lrs = [c["lr"] for c in configs]
    assert lrs[0] != lrs[1] and best["best_params"]["optim.lr"] == lrs[finals.index(min(finals))], (lrs, best)
    for job, optim in zip(("0", "1"), configs):
        assert optim["warmup_steps"] >= 6  # the 6 steps all warm up
        used = {r["step"]: r["lr"] for r in records(tmp_path / job) if "split" not in r}
        assert used == pytest.approx({s: optim["lr"] * s / optim["warmup_steps"] for s in range(1, 7)}, rel=1e-12), job
    assert finals[0] != finals[1]  # ... and the optimizer stepped with it


# -- where CUDA exists (skipped on the CPU machines) ------------------------------------------------

needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")


@needs_two_gpus
def test_fsdp_cpu_offload_on_cuda_reduces_its_cpu_gradient_norm(tmp_path):
    """FSDP2's CPUOffloadPolicy keeps gradients on the CPU: the norm needs gloo beside NCCL."""
    on_ranks(2, train_cases, {"offload": case("fsdp", steps=2, strategy__offload_params=True,
                                              strategy__offload_optimizer=True)}, str(tmp_path))
    assert all(math.isfinite(r["grad_norm"]) for r in records(tmp_path / "offload"))


@needs_two_gpus
def test_zero3_on_cuda_starts_from_the_weights_of_ddp():
    expected = on_ranks(1, first_weights, "ddp")[0]
    got = on_ranks(2, first_weights, "zero3")[0]
    assert all(torch.equal(got[k].cpu(), expected[k].cpu()) for k in expected)


