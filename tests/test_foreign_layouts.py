"""Other libraries' checkpoint layouts that `python -m trainer.convert` and `checkpoint.resume=DIR`
read (docs/checkpoints.md, the interchange table), written in this process by the libraries' own
APIs: torchtitan's DCP layout (the model's keys flattened at the top level, the optimizer under
`optimizer` in `get_optimizer_state_dict`'s flattened form) and `accelerate save_state` of a
one-process run (model.safetensors + optimizer.bin) and of an FSDP2 run (pytorch_model_fsdp_0/ +
optimizer_0/, two DCP dirs)."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from trainer.checkpoint.convert import detect, read


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.w(x))


def trained(steps: int = 2) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        model(torch.randn(4, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def assert_weights_and_moments(portable, model, optimizer) -> None:
    """The portable state holds every parameter of `model` and its Adam moments in `optimizer`, exactly."""
    names = dict(model.named_parameters())
    assert set(portable.weights) == set(names)
    for name, p in names.items():
        assert torch.equal(portable.weights[name], p.detach())
        assert torch.equal(portable.moments[name]["exp_avg"], optimizer.state[p]["exp_avg"])
        assert torch.equal(portable.moments[name]["exp_avg_sq"], optimizer.state[p]["exp_avg_sq"])


def test_torchtitans_layout_gives_weights_moments_and_step(tmp_path: Path):
    model, optimizer = trained()
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    # torchtitan's CheckpointManager: the model's state dict flattened into the top level, beside
    # its other entries (components/checkpoint.py, _flattened_model_states_sd).
    dcp.save({**get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer, options=flat),
              "train_state": {"step": torch.tensor(2)}}, checkpoint_id=str(tmp_path / "step-2"))
    assert detect(tmp_path / "step-2") == "dcp"
    portable = read(tmp_path / "step-2")
    assert_weights_and_moments(portable, model, optimizer)
    assert portable.step == 2
    assert "the data position" in portable.lacks


def test_torchtitans_model_only_save_gives_the_weights(tmp_path: Path):
    model, _ = trained()
    dcp.save(get_model_state_dict(model), checkpoint_id=str(tmp_path / "final"))
    portable = read(tmp_path / "final")
    assert {n: torch.equal(portable.weights[n], p.detach()) for n, p in model.named_parameters()} == \
        {n: True for n, _ in model.named_parameters()}
    assert not portable.moments and any("Adam moments" in lack for lack in portable.lacks)


def test_an_accelerate_save_state_folder_gives_its_weights(tmp_path: Path):
    from accelerate import Accelerator

    model, optimizer = trained()
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.save_state(str(tmp_path / "state"))
    assert detect(tmp_path / "state") == "accelerate"
    portable = read(tmp_path / "state")
    for name, p in model.named_parameters():
        assert torch.equal(portable.weights[name], p.detach())
    assert not portable.moments and any("by position" in lack for lack in portable.lacks)


def test_an_accelerate_save_state_under_fsdp2_gives_weights_moments_and_step(tmp_path: Path):
    """The two DCP dirs accelerate 1.16 writes under FSDP2 (SHARDED_STATE_DICT), by its own calls
    (utils/fsdp_utils.py: save_fsdp_model, save_fsdp_optimizer); accelerate runs FSDP only on GPUs."""
    model, optimizer = trained()
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(tmp_path / "state" / "pytorch_model_fsdp_0"))
    dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)},
             checkpoint_id=str(tmp_path / "state" / "optimizer_0"))
    assert detect(tmp_path / "state") == "dcp"
    portable = read(tmp_path / "state")
    assert_weights_and_moments(portable, model, optimizer)
    assert portable.step == 2
