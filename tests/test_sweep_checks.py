"""`trainer -m ...`: every job of a sweep passes the settings checks before the first job starts
(trainer.sweep.check_sweep, called by trainer/__main__.py)."""
from __future__ import annotations

import pytest

from tests.harness import assert_refused, run_cli
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
