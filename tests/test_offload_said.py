"""The start line's `offload=` says what the backend keeps in host memory: FSDP2's one
CPUOffloadPolicy moves params, gradients and the optimizer step together, so either
`strategy.offload_params` or `strategy.offload_optimizer` offloads all three (the line said only
the flag given); DeepSpeed's ZeRO-3 offloads each as its flag asks."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from trainer.config import to_config
from trainer.distributed import DistEnv
from trainer.strategies.base import Strategy
from trainer.strategies.fsdp import FSDPStrategy

ONE_RANK = DistEnv(0, 1, 0, 1, torch.device("cpu"))


def fsdp(**flags) -> FSDPStrategy:
    return FSDPStrategy(to_config({"strategy": {"name": "fsdp", **flags}}), ONE_RANK)


@pytest.mark.parametrize("flag", ["offload_params", "offload_optimizer"])
def test_either_fsdp_flag_offloads_params_grads_and_optimizer(flag):
    assert fsdp(**{flag: True}).start_settings()["offload"] == "params+grads+optimizer"
    assert fsdp().start_settings()["offload"] == "none"


def test_zero3_offloads_what_its_flags_ask():
    """The base class's rule, which the DeepSpeed strategies keep (asked of a stand-in: building one
    joins a process group)."""
    def offloaded(**flags) -> list[str]:
        stand_in = SimpleNamespace(cfg=to_config({"strategy": {"name": "zero3", **flags}}))
        stand_in._offloaded = lambda: Strategy._offloaded(stand_in)
        return Strategy.start_settings(stand_in)["offload"]

    assert offloaded(offload_optimizer=True) == "optimizer"
    assert offloaded(offload_params=True) == "params"
    assert offloaded(offload_params=True, offload_optimizer=True) == "optimizer+params"
    assert offloaded() == "none"
