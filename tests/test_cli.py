"""The CLI trains under every strategy, spawned or under torchrun; bad input fails early."""
from __future__ import annotations

import json
import sys

import pytest

from tests.harness import assert_refused, records, refusal, run_cli
from trainer.config import to_config


def test_default_run_learns_and_says_where_metrics_went(tmp_path):
    result = run_cli(f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    assert f"run dir: {tmp_path}" in result.stdout
    rows = records(tmp_path)
    assert rows[-1]["step"] == 60 and rows[-1]["loss"] < rows[0]["loss"] - 1.0
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[-1]) == {"event": "end", "step": 60, "loss": rows[-1]["loss"], "tokens": 60 * 8 * 64}
    assert set(rows[0]) >= {"step", "epoch", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_time_s", "mem"}
    assert set(rows[0]["mem"]) == {"params", "grads", "optim", "peak", "activations"}
    assert rows[0]["mem"]["activations"] > 0  # measured on the CPU too


# DDP; fsdp, zero1 and zero3 run with nproc=2 from the CLI in test_faults.py, test_first_hour.py
# and test_console_lines.py (the console of a zero3 run).
def test_nproc_2_spawns_two_ranks(tmp_path):
    result = run_cli("strategy=ddp", "nproc=2", "train.max_steps=4", "train.log_every=2", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "strategy=ddp world_size=2" in result.stdout
    assert [r["step"] for r in records(tmp_path)] == [2, 4]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_torchrun_starts_the_same_program_with_one_run_dir(tmp_path, strategy):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                "-m", "trainer"]
    result = run_cli(f"strategy={strategy}", "train.max_steps=4", "train.log_every=2", launcher=torchrun,
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"strategy={strategy} world_size=2" in result.stdout
    run_dirs = list((tmp_path / "outputs").glob("*/*"))
    assert len(run_dirs) == 1, f"every rank must share rank 0's run dir: {run_dirs}"
    assert [r["step"] for r in records(run_dirs[0])] == [2, 4]


BAD_INPUT = {
    "strategy=zero4": ["zero4", "ddp", "fsdp", "zero1", "zero2", "zero3"],
    "train.precision=fp8": ["train.precision", "bf16", "fp16", "fp32"],
    "strategy.sharding=HALF": ["strategy.sharding", "FULL_SHARD", "SHARD_GRAD_OP"],
    "strategy=zero1 strategy.offload_params=true": ["strategy.offload_params", "zero1"],
    "strategy.offload_optimizer=true": ["strategy.offload_optimizer", "ddp"],
    "train.micro_batch_size=0": ["train.micro_batch_size", ">= 1"],
    "train.grad_accum_steps=0": ["train.grad_accum_steps"],
    "strategy=fsdp strategy.wrap=[Block]": ["strategy.wrap", "Block", "TransformerBlock"],
    "strategy.bogus=1": ["bogus"],
    "model=llama2_7b": ["shape-only", "trainer.plan"],
    "strategy=zero3 train.precision=fp16": ["train.precision", "fp16"],
    "strategy=zero2 strategy.deepspeed_config=/nonexistent.json": ["strategy.deepspeed_config", "/nonexistent.json"],
}


@pytest.mark.parametrize("overrides", list(BAD_INPUT))
def test_bad_input_fails_before_any_work_with_a_message(tmp_path, overrides):
    error = refusal(tmp_path, *overrides.split(), "nproc=2")
    assert all(fragment in error for fragment in BAD_INPUT[overrides]), error


# What the command line does with such an error, once for a setting Hydra refuses while composing
# and once for one refused by the checks before work (the same path every refusal above takes).
@pytest.mark.parametrize("overrides", ["strategy=zero4", "strategy=fsdp strategy.wrap=[Block]"])
def test_bad_input_on_the_command_line_is_one_line_and_no_rank_starts(tmp_path, overrides):
    result = run_cli(*overrides.split(), "nproc=2", f"hydra.run.dir={tmp_path}")
    assert_refused(result, *BAD_INPUT[overrides])
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1, result.stderr[-2000:]  # nothing else either
    assert not (tmp_path / "metrics.jsonl").exists()
    assert "world_size=" not in result.stdout  # no rank started


def test_epochs_mode_runs_whole_epochs_and_counts_them(tmp_path):
    # synthetic: 64 samples / (8 per step) = 8 steps per epoch
    result = run_cli("data=synthetic", "data.num_samples=64", "train.max_steps=0", "train.epochs=2",
                     "train.log_every=4", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-2000:]
    assert [(r["step"], r["epoch"]) for r in records(tmp_path)] == [(4, 0), (8, 0), (12, 1), (16, 1)]


@pytest.mark.slow
def test_a_users_deepspeed_config_is_merged_with_auto_values_filled(tmp_path):
    """From the command line, at 2 ranks; the merged values the engine holds are read back in
    tests/test_core_behaviour.py (test_a_users_deepspeed_config_reaches_the_engine_...)."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                              "zero_optimization": {"stage": "auto", "reduce_bucket_size": 100000},
                              "gradient_clipping": "auto"}))
    result = run_cli("strategy=zero2", f"strategy.deepspeed_config={ds}", "nproc=2", "train.max_steps=2",
                     "train.log_every=1", f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 0, result.stderr[-2000:]
    assert len(records(tmp_path / "run")) == 2
    ds.write_text(json.dumps({"gradient_accumulation_steps": 4}))
    clash = run_cli("strategy=zero2", f"strategy.deepspeed_config={ds}", f"hydra.run.dir={tmp_path / 'clash'}")
    assert_refused(clash, "gradient_accumulation_steps=4 disagrees")


def test_a_users_deepspeed_config_reads_back_merged(tmp_path):
    # Its "auto" values are ours, its own settings stay, and ours fill what it leaves out.
    from trainer.strategies.ds_config import build_ds_config

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto",
                              "zero_optimization": {"stage": "auto", "reduce_bucket_size": 100000},
                              "bf16": {"enabled": "auto", "check_grad_overflow": False}}))
    cfg = to_config({"strategy": {"name": "zero2", "deepspeed_config": str(ds)},
                     "train": {"micro_batch_size": 3, "grad_clip": 0.5, "precision": "bf16"}})
    merged = build_ds_config(cfg, world_size=2)
    assert merged["train_micro_batch_size_per_gpu"] == 3 and merged["train_batch_size"] == 6
    assert merged["gradient_clipping"] == 0.5 and merged["gradient_accumulation_steps"] == 1
    assert merged["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 100000}
    assert merged["bf16"] == {"enabled": True, "check_grad_overflow": False}
    assert merged["communication_data_type"] == "fp32" and merged["data_types"] == {"grad_accum_dtype": "fp32"}
