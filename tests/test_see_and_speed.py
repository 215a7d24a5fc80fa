"""Loggers read back with each tool's reader, a quiet console, mfu and profiles,
torch.compile and grad_reduce on every strategy, the planner's traffic against what the runs
move, the device choice, and the wheel installed elsewhere."""
from __future__ import annotations

import json
import math
import os
import struct
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
    mlflow_runs,
    on_ranks,
    records,
    run_cli,
    train_cases,
)
from trainer.config import to_config
from trainer.errors import ConfigError

STRATEGIES = ["ddp", "fsdp", "zero1", "zero2", "zero3"]


# -- loggers ------------------------------------------------------------------------------------

def wandb_records(run_file: Path) -> list:
    """The records of a W&B offline run file (LevelDB-style log of W&B's protobuf records)."""
    from wandb.proto import wandb_internal_pb2

    data, out, pending, pos, block = run_file.read_bytes(), [], b"", 7, 32768
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    run = tmp_path_factory.mktemp("loggers")
    result = run_cli("nproc=2", "strategy=fsdp", "logger=[jsonl,tensorboard,wandb,mlflow]", "train.max_steps=6",
                     "train.log_every=2", "data.val_fraction=0.1", "eval.every_steps=3", f"hydra.run.dir={run}",
                     env={"WANDB_API_KEY": "", "HOME": str(run)})  # no key, no ~/.netrc: offline
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in rows if "epoch" in r}
    vals = {r["step"]: r for r in rows if r.get("split") == "val"}
    return run, steps, vals, rows[-1]


@pytest.mark.slow  # make test stays under 8 minutes: the rest of what it covers is in the quick suite
def test_tensorboard_has_the_records_the_config_and_the_summary(logged):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, steps, vals, end = logged
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert {e.step: e.value for e in events.Scalars("train/loss")} == pytest.approx(
        {s: r["loss"] for s, r in steps.items()}, rel=1e-6)  # float32 in the event file
    assert [e.step for e in events.Scalars("val/loss")] == sorted(vals) == [3, 6]
    assert [e.step for e in events.Scalars("mem/params")] == sorted(steps)
    assert "strategy.name: fsdp" in events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    hparams = EventAccumulator(str(run / "tensorboard"))  # add_hparams writes a file of its own there
    hparams.Reload()
    assert hparams.PluginTagToContent("hparams")


@pytest.mark.slow  # make test stays under 8 minutes: the rest of what it covers is in the quick suite
def test_mlflow_has_the_records_the_params_and_the_summary(logged):
    run, steps, vals, end = logged
    client, [found] = mlflow_runs(run)
    assert found.data.params["strategy.name"] == "fsdp" and found.data.params["train.max_steps"] == "6"
    history = {m.step: m.value for m in client.get_metric_history(found.info.run_id, "train/loss")}
    assert history == pytest.approx({s: r["loss"] for s, r in steps.items()})
    assert [m.step for m in client.get_metric_history(found.info.run_id, "val/ppl")] == [3, 6]
    assert found.data.metrics["final/val_loss"] == pytest.approx(end["val_loss"])
    assert found.info.status == "FINISHED"


@pytest.mark.slow  # make test stays under 8 minutes: the rest of what it covers is in the quick suite
def test_wandb_offline_files_have_the_records_the_config_and_the_summary(logged):
    run, steps, vals, end = logged
    [run_file] = run.glob("wandb/offline-run-*/run-*.wandb")
    assert f"W&B ran offline: its files are in {run_file.parent}; upload them with: wandb sync {run_file.parent}" \
        in (run / "trainer.log").read_text()
    records_ = wandb_records(run_file)
    history = {}
    for r in records_:
        if r.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            history[items["_step"]] = items
    assert {s: h["train/loss"] for s, h in history.items() if "train/loss" in h} == pytest.approx(
        {s: r["loss"] for s, r in steps.items()})
    assert {s for s, h in history.items() if "val/loss" in h} == {3, 6}
    [header] = [r.run for r in records_ if r.WhichOneof("record_type") == "run"]
    config = {i.key: json.loads(i.value_json) for i in header.config.update}
    assert config["strategy.name"] == "fsdp" and config["train.max_steps"] == 6
    summaries = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.summary.update}
                 for r in records_ if r.WhichOneof("record_type") == "summary"]
    assert any(s.get("final/val_loss") == pytest.approx(end["val_loss"]) for s in summaries)
    assert wandb_exit_code(run_file) == 0


def wandb_exit_code(run_file: Path) -> int:
    """The exit code a W&B offline run file ends with (`run.finish(exit_code=...)`)."""
    [exit_record] = [r.exit for r in wandb_records(run_file) if r.WhichOneof("record_type") == "exit"]
    return exit_record.exit_code


@pytest.mark.slow  # make test stays under 8 minutes: the rest of what it covers is in the quick suite
def test_a_run_stopped_by_too_many_bad_steps_closes_every_logger_as_failed(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = run_cli("model=custom", "model._target_=tests.faulty.build", "+model.nan_steps=[4,5]", "+model.rank=0",
                     "strategy.wrap=[ToyBlock]", "train.max_bad_steps=2", "train.max_steps=8", "train.log_every=1",
                     "data.num_workers=0", "logger=[jsonl,tensorboard,wandb,mlflow]", f"hydra.run.dir={tmp_path}",
                     env={"WANDB_API_KEY": "", "HOME": str(tmp_path)})  # no key, no ~/.netrc: offline
    assert_refused(result, "step 5: 2 steps in a row with a non-finite loss")
    logged = [r["step"] for r in records(tmp_path)]
    assert logged == [1, 2, 3, 4]  # step 5 stopped the run before its record
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    for tag in ("train/loss", "train/grad_norm", "mem/params"):  # every event, none left in a buffer
        assert [e.step for e in events.Scalars(tag)] == logged, tag
    _, [found] = mlflow_runs(tmp_path)
    assert found.info.status == "FAILED" and found.info.end_time
    [run_file] = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    assert wandb_exit_code(run_file) == 2  # the run's own exit code


@pytest.mark.slow  # make test stays under 8 minutes: the rest of what it covers is in the quick suite
def test_jsonl_ends_with_the_summary(logged):
    _, steps, vals, end = logged
    assert end == {"event": "end", "step": 6, "loss": steps[6]["loss"], "tokens": steps[6]["tokens"],
                   "val_loss": vals[6]["loss"]}
    assert all(r["ppl"] == pytest.approx(math.exp(r["loss"])) for r in vals.values())


# -- console, mfu, profiles -----------------------------------------------------------------------

@pytest.mark.slow
def test_a_zero3_run_prints_a_handful_of_lines(tmp_path):
    """Before: 75 copies of torch's FutureWarning (DeepSpeed calls deprecated collectives every
    step), DeepSpeed's 'built successfully' from each rank, all interleaved with the bar."""
    result = run_cli("strategy=zero3", "nproc=2", "train.max_steps=20", "train.log_every=5",
                     f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout.splitlines()
    assert len(out) == 3 and all(line.startswith("[trainer] ") for line in out), out
    assert "strategy=zero3 world_size=2" in out[0] and [r["step"] for r in records(tmp_path)] == [5, 10, 15, 20]
    lines = [line for line in result.stderr.replace("\r", "\n").split("\n") if line.strip()]
    bar = [line for line in lines if line.startswith("train:")]
    assert len(bar) <= 2 * 20 + 2, bar  # rank 0's bar only (tqdm writes an update per step to a pipe)
    others = [line for line in lines if not line.startswith("train:")]
    assert len(others) <= 4, others  # two warnings of two lines each, once each
    for warning in {line for line in others if "Warning" in line}:
        assert result.stderr.count(warning) == 1, warning


def test_log_level_lets_third_parties_speak(capsys):
    import logging

    from trainer.log import chatter, setup_logging

    for level, shown in (("warning", False), ("info", True)):
        setup_logging(None, is_main=True, level=level)
        with chatter():
            print("DeepSpeed op built")  # DeepSpeed announces its ops with print()
        assert ("DeepSpeed op built" in capsys.readouterr().out) is shown
        assert logging.getLogger("DeepSpeed").level == logging.getLevelName(level.upper())
    setup_logging(None, is_main=True)


@pytest.mark.slow
def test_a_profile_of_the_chosen_steps_under_every_strategy(tmp_path):
    cases = {s: case(s, steps=4, train__profile="2:3") for s in STRATEGIES}
    on_ranks(2, train_cases, cases, str(tmp_path))
    for strategy in STRATEGIES:
        for rank in (0, 1):
            trace = json.loads((tmp_path / strategy / "profile" / f"trace_rank{rank}.json").read_text())
            names = {e.get("name", "") for e in trace["traceEvents"]}
            assert {"ProfilerStep#2", "ProfilerStep#3"} <= names, (strategy, sorted(n for n in names if "Step" in n))
            assert any("aten::" in n for n in names), strategy


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


def test_metrics_jsonl_is_written_whatever_the_loggers_listed(tmp_path, monkeypatch):
    """logger=tensorboard replaces the default list: the run's record is written all the same."""
    from hydra import compose, initialize_config_module

    from trainer import distributed
    from trainer.config import CONFIG_MODULE, register_configs
    from trainer.training.loggers import RunLog

    register_configs()
    monkeypatch.setattr(distributed, "broadcast_object", lambda obj, src=0: obj)  # one process, no group
    with initialize_config_module(config_module=CONFIG_MODULE, version_base=None):
        cfg = to_config(compose(config_name="config", overrides=["logger=tensorboard"]))
    assert cfg.logger.jsonl is None and cfg.logger.tensorboard is not None
    with RunLog(cfg, tmp_path, is_main=True) as run_log:
        run_log.log({"step": 1, "loss": 2.5})
        run_log.finish({"step": 1, "loss": 2.5})
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        {"step": 1, "loss": 2.5}, {"event": "end", "step": 1, "loss": 2.5}]
    assert any((tmp_path / "tensorboard").iterdir())
