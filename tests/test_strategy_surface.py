"""The Strategy interface's own refusals, without a process group."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer.config import to_config
from trainer.distributed import DistEnv
from trainer.errors import CheckpointError


def test_a_backend_without_a_checkpoint_format_of_its_own_refuses_save_native(tmp_path):
    from trainer.strategies.ddp import DDPStrategy

    alone = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
    strategy = DDPStrategy(to_config({"strategy": {"name": "ddp"}}), alone)  # one rank: no group is made
    with pytest.raises(CheckpointError, match="^ddp: has no checkpoint format of its own"):
        strategy.save_native(tmp_path / "native", "global_step1")
    assert not (tmp_path / "native").exists()


def test_convert_to_deepspeed_without_an_engine_refuses_in_one_line(tmp_path):
    """trainer.checkpoint.convert builds no strategy: --to deepspeed needs the job's (trainer.convert)."""
    from trainer.checkpoint.convert import write_deepspeed
    from trainer.checkpoint.format import Portable

    with pytest.raises(CheckpointError, match="python -m trainer.convert") as refused:
        write_deepspeed(Portable({}, {}, 0, source={"model": {}}), tmp_path / "out", holding=None)
    assert "\n" not in str(refused.value)
    assert not Path(tmp_path / "out").exists()
