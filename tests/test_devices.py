"""The device each rank trains on: the GPU it sees (one per rank, or its local rank's of a node's),
a clear error where CUDA is asked for and there is none; the weights are seeded on the CPU, so
every strategy, on any device, starts from the same ones. Where two CUDA devices exist (skipped
elsewhere): FSDP2's CPU offload reduces its CPU gradient norm, and zero3 starts from DDP's weights."""
from __future__ import annotations

import math

import pytest
import torch

from tests.harness import assert_refused, case, full_state, on_ranks, records, run_cli, train_cases


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
