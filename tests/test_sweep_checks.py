"""`trainer -m ...`: every job of a sweep passes the settings checks before the first job starts
(trainer.sweep.check_sweep, called by trainer/__main__.py); an Optuna sweep trains each trial with
the learning rate it chose and minimises the final val loss."""
from __future__ import annotations

import json

import pytest

from tests.harness import assert_refused, records, run_cli
from trainer.config import register_configs
from trainer.errors import ConfigError
from trainer.sweep import check_sweep, sweep_jobs


@pytest.fixture(scope="module", autouse=True)
def schema():
    register_configs()


@pytest.mark.slow  # make test stays under 8 minutes: the jobs' combinations are checked in the quick suite
def test_a_sweep_whose_second_job_is_invalid_starts_no_job(tmp_path):
    """fsdp offloads its optimizer, ddp cannot: refused before the fsdp job trains."""
    result = run_cli("-m", "strategy=fsdp,ddp", "strategy.offload_optimizer=true", f"hydra.sweep.dir={tmp_path / 'sweep'}",
                     cwd=tmp_path)
    assert_refused(result, "strategy.offload_optimizer: ddp keeps the optimizer on the device",
                   "in job 1 of the sweep, strategy=ddp; no job was started")
    assert not (tmp_path / "sweep").exists()  # the first job never started: no job dir, no metrics.jsonl


def test_the_jobs_are_the_basic_sweepers_combinations():
    assert sweep_jobs(["-m", "strategy=ddp,fsdp", "train.micro_batch_size=4,8", "nproc=2"]) == [
        ["strategy=ddp", "train.micro_batch_size=4", "nproc=2"], ["strategy=ddp", "train.micro_batch_size=8", "nproc=2"],
        ["strategy=fsdp", "train.micro_batch_size=4", "nproc=2"], ["strategy=fsdp", "train.micro_batch_size=8", "nproc=2"]]
    assert sweep_jobs(["strategy=ddp,fsdp"]) == []  # not a multirun
    assert sweep_jobs(["-m", "hydra/sweeper=optuna_lr", "data.val_fraction=0.1"]) == []  # Optuna picks the values


def test_a_value_valid_alone_but_not_with_another_swept_value_is_refused():
    check_sweep(["-m", "strategy=ddp,fsdp,zero2,zero3", "nproc=2"])  # the README's sweep passes
    with pytest.raises(ConfigError, match=r"^strategy.reduce_dtype: .* \(in job 1 of the sweep, train.precision=fp32;"):
        check_sweep(["-m", "train.precision=bf16,fp32", "strategy.reduce_dtype=bf16"])


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
