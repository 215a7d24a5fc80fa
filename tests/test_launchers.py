"""The same program under torchrun (1 and 2 nodes), accelerate, the deepspeed launcher,
SLURM's variables and Hydra multirun; every test reads metrics.jsonl."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import CPU_ONLY, REPO, assert_close, records, run_cli
from trainer import distributed
from trainer.launchers import accelerate_choice, take_local_rank

BIN = Path(sys.executable).parent  # the venv running the tests
SHORT = ["train.max_steps=4", "train.log_every=2"]


def assert_trained(run_dir, strategy: str, stdout: str) -> None:
    assert f"strategy={strategy} world_size=2" in stdout
    assert [r["step"] for r in records(run_dir)] == [2, 4]


def assert_no_compiler_probes(run_dir, *outputs: str) -> None:
    """DeepSpeed's probe for libaio (`deepspeed.init_distributed` compiles and links a test
    program) is logged by setuptools' compiler at INFO: kept off the console and trainer.log under
    every launcher, as under nproc."""
    for text in (*outputs, (Path(run_dir) / "trainer.log").read_text()):
        assert "compilers.C" not in text and "a.out" not in text, text[-3000:]


@pytest.fixture(scope="module")
def one_rank_losses(tmp_path_factory) -> list[float]:
    """SHORT's losses on one rank: those of every launcher's run at sp=2 (dp=1, the same batch)."""
    run_dir = tmp_path_factory.mktemp("one_rank")
    result = run_cli("nproc=1", *SHORT, f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    return [r["loss"] for r in records(run_dir)]


@pytest.mark.slow
def test_torchrun_two_nodes_on_one_machine(tmp_path, one_rank_losses):
    """A sequence-parallel group across the two nodes (strategy.sp=2): one rank's losses."""
    port = str(distributed.free_port())
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
         "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", port,
         "-m", "trainer", "strategy=zero3", "strategy.sp=2", *SHORT, f"hydra.run.dir={tmp_path}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, **CPU_ONLY}) for node in (0, 1)]
    outputs = [node.communicate(timeout=600) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    assert_trained(tmp_path, "zero3", outputs[0][0])
    assert "sp=2 (dp=1)" in outputs[0][0]
    assert_close([r["loss"] for r in records(tmp_path)], one_rank_losses, "torchrun sp=2", rtol=1e-6)
    assert_no_compiler_probes(tmp_path, *outputs[0], *outputs[1])


@pytest.mark.slow
def test_accelerate_launch_with_the_cpu_preset(tmp_path):
    launcher = [str(BIN / "accelerate"), "launch", "--config_file", str(REPO / "launch/accelerate/cpu.yaml"),
                "-m", "trainer"]
    result = run_cli("strategy=fsdp", *SHORT, f"hydra.run.dir={tmp_path}", launcher=launcher)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_trained(tmp_path, "fsdp", result.stdout)


@pytest.mark.slow
def test_accelerate_deepspeed_config_chooses_the_strategy_unless_told_otherwise(tmp_path):
    launcher = [str(BIN / "accelerate"), "launch", "--config_file",
                str(REPO / "launch/accelerate/deepspeed_zero3.yaml"), "--num_processes", "2",
                "--mixed_precision", "no", "-m", "trainer"]
    result = run_cli(*SHORT, f"hydra.run.dir={tmp_path / 'follows'}", launcher=launcher)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_trained(tmp_path / "follows", "zero3", result.stdout)
    assert_no_compiler_probes(tmp_path / "follows", result.stdout, result.stderr)
    conflict = run_cli("strategy=fsdp", *SHORT, f"hydra.run.dir={tmp_path / 'conflict'}", launcher=launcher)
    assert conflict.returncode != 0  # each rank exits 2; accelerate launch itself exits 1
    assert "strategy=fsdp" in conflict.stderr and "accelerate config says zero3" in conflict.stderr
    assert not (tmp_path / "conflict" / "metrics.jsonl").exists()


def test_accelerate_variables_map_to_overrides():
    assert accelerate_choice({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2",
                              "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu",
                              "ACCELERATE_MIXED_PRECISION": "bf16"}) == {
        "strategy": "zero2", "strategy.offload_optimizer": "true", "train.precision": "bf16"}
    assert accelerate_choice({"ACCELERATE_USE_FSDP": "true", "FSDP_SHARDING_STRATEGY": "SHARD_GRAD_OP",
                              "ACCELERATE_MIXED_PRECISION": "no"}) == {
        "strategy": "fsdp", "strategy.sharding": "SHARD_GRAD_OP"}
    assert accelerate_choice({"ACCELERATE_MIXED_PRECISION": "no"}) == {}


@pytest.mark.slow
def test_deepspeed_launcher_local_rank_argument(tmp_path, one_rank_losses):
    """At strategy.sp=2 too: one rank's losses."""
    env = {}
    assert take_local_rank(["--local_rank=1", "strategy=zero3"], env) == ["strategy=zero3"]
    assert env == {"LOCAL_RANK": "1"}
    launcher = [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(distributed.free_port()),
                "--module", "trainer"]
    result = run_cli("strategy=zero2", "strategy.sp=2", *SHORT, f"hydra.run.dir={tmp_path}", launcher=launcher)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--local_rank=0" in result.stdout + result.stderr  # the launcher did append it
    assert_trained(tmp_path, "zero2", result.stdout)
    assert "sp=2 (dp=1)" in result.stdout
    assert_close([r["loss"] for r in records(tmp_path)], one_rank_losses, "deepspeed launcher sp=2", rtol=1e-6)
    assert_no_compiler_probes(tmp_path, result.stdout, result.stderr)


@pytest.mark.slow
def test_multirun_runs_each_job_with_its_own_ranks_and_prints_a_summary(tmp_path):
    result = run_cli("-m", "strategy=ddp,zero2", "nproc=2", *SHORT, f"hydra.sweep.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    for job, strategy in (("0", "ddp"), ("1", "zero2")):
        assert [r["step"] for r in records(tmp_path / job)] == [2, 4]
        assert f"strategy={strategy} world_size=2" in result.stdout
    summary = result.stdout[result.stdout.index("sweep summary"):]
    assert "strategy=ddp" in summary and "strategy=zero2" in summary and "tokens/s" in summary
    assert "nproc=2" not in summary  # jobs are named by what the sweep varies


def test_slurm_variables_map_to_ranks():
    env = distributed.launcher_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                                    "SLURM_NTASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "gpu[07-08]",
                                    "SLURM_JOB_ID": "4242"})
    assert env == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                   "MASTER_ADDR": "gpu07", "MASTER_PORT": str(29500 + 4242 % 1000)}
    assert distributed.launcher_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) == {}  # one task: no launcher
    # torchrun inside srun: torchrun's variables win
    assert distributed.launcher_env({"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
                                    )["RANK"] == "1"


@pytest.mark.slow
def test_two_srun_tasks_train_from_slurm_variables_alone(tmp_path):
    port = str(distributed.free_port())
    tasks = [subprocess.Popen(
        [sys.executable, "-m", "trainer", "strategy=fsdp", *SHORT, f"hydra.run.dir={tmp_path}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")},
             **CPU_ONLY, "SLURM_PROCID": str(task), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(task),
             "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "localhost", "MASTER_PORT": port})
        for task in (0, 1)]
    outputs = [task.communicate(timeout=600) for task in tasks]
    assert [task.returncode for task in tasks] == [0, 0], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    assert_trained(tmp_path, "fsdp", outputs[0][0])


def test_slurm_hydra_launcher_preset_composes():
    result = run_cli("hydra/launcher=slurm", "--cfg", "hydra", "-p", "hydra.launcher")
    assert result.returncode == 0, result.stderr
    assert "SlurmLauncher" in result.stdout and "tasks_per_node" in result.stdout
