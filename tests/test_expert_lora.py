"""LoRA on the routed experts at strategy.ep=N (models/experts.py: an expert's adapter lives
with its expert). peft's adapter of a module of experts, on the experts and on attention, at ep=2 on 2
ranks gives one rank's losses and gradient norms within 1e-6 (fp32, the router's loss on, clipping
active) on fsdp and on zero2 (with accumulation); its checkpoints, whose lora_B pieces are blocks of
columns, resume exactly on one rank (from fsdp and from zero2) and a one-rank checkpoint resumes at
ep=2 on zero2; the adapter folder exported from an ep=2 checkpoint is one rank's, and merges."""
from __future__ import annotations

import pytest
import torch

from tests.harness import assert_close, losses, on_ranks, records, resuming, saving, train_cases, with_overrides
from tests.test_expert_parallel import RTOL, STEPS, assert_same_run, moe_case
from tests.test_router_loss import COEF
from trainer.demo import make_model_dir

CLIP = 0.3  # below the gradient norms of the adapters (0.48-0.76): clipping is active at every step


def lora_case(path, strategy: str, micro: int, accum: int = 1, **overrides) -> dict:
    """moe_case with LoRA of rank 4 on every linear layer but the router (attention) and on the experts'
    stacked matrices (peft's target_parameters)."""
    return with_overrides(moe_case(path, strategy, micro, accum, peft__name="lora", peft__r=4, **overrides),
                          train__grad_clip=CLIP)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("expert_lora")
    qwen = make_model_dir(out / "qwen3_moe", "qwen3_moe", weights=False, output_router_logits=True,
                          router_aux_loss_coef=COEF)
    ckpt = {name: out / f"ckpt_{name}" for name in ("one", "ep2", "zero2_ep2")}
    on_ranks(1, train_cases, {"one": saving(lora_case(qwen, "fsdp", 4), ckpt["one"], 2)}, str(out))
    on_ranks(2, train_cases, {
        "ep2": saving(lora_case(qwen, "fsdp", 2, strategy__ep=2), ckpt["ep2"], 2),
        "zero2_ep2": saving(lora_case(qwen, "zero2", 1, 2, strategy__ep=2), ckpt["zero2_ep2"], 2),
        "zero2_ep2_from_one": resuming(lora_case(qwen, "zero2", 2, strategy__ep=2), ckpt["one"], 2)},
        str(out))
    on_ranks(1, train_cases, {"one_from_ep2": resuming(lora_case(qwen, "fsdp", 4), ckpt["ep2"], 2),
                              "one_from_zero2_ep2": resuming(lora_case(qwen, "ddp", 4), ckpt["zero2_ep2"], 2)},
             str(out))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ep2", "zero2_ep2"])
def test_lora_on_split_experts_gives_one_ranks_losses_and_norms(runs, name):
    assert_same_run(runs, name, "one")
    assert records(runs / "one")[0]["grad_norm"] > CLIP  # clipped: a wrong norm would change the losses
    assert len(set(losses(records(runs / "one")))) == STEPS  # the adapters train


@pytest.mark.slow
@pytest.mark.parametrize("name, checkpoint", [("one_from_ep2", "fsdp ep=2, 2 ranks"),
                                              ("one_from_zero2_ep2", "zero2 ep=2, 2 ranks"),
                                              ("zero2_ep2_from_one", "fsdp, 1 rank")])
def test_checkpoints_of_split_adapters_move_between_expert_degrees(runs, name, checkpoint):
    base, resumed = records(runs / "one"), records(runs / name)
    assert [r["step"] for r in resumed] == [3, 4], (name, checkpoint)
    assert_close(losses(resumed), losses(base)[2:], f"{name} from {checkpoint}", RTOL)


@pytest.mark.slow
def test_the_checkpoint_stores_whole_adapters_in_pefts_layout(runs):
    """Every adapter of the ep=2 checkpoint, read whole, is one rank's at the same step (within 1e-5:
    2 Adam steps from losses equal within 1e-7), lora_B's columns of each expert in peft's places."""
    from trainer.checkpoint.format import read_step_dir

    split, whole = (read_step_dir(runs / f"ckpt_{run}" / "step_00000002") for run in ("ep2", "one"))
    experts_b = [n for n in whole.weights if ".experts." in n and ".lora_B." in n]
    assert experts_b and split.weights.keys() == whole.weights.keys()
    for name, value in whole.weights.items():
        assert split.weights[name].shape == value.shape, name
        assert torch.allclose(split.weights[name], value, rtol=0, atol=1e-5), name
    assert split.moments.keys() == whole.moments.keys() and set(experts_b) <= whole.moments.keys()
    for name, moments in whole.moments.items():  # the adapters' only: the base is frozen
        for k, moment in moments.items():
            assert torch.allclose(split.moments[name][k], moment, rtol=1e-4, atol=1e-9), (name, k)
    assert all(whole.weights[n].abs().max() > 1e-4 for n in experts_b)  # trained: a misplaced column shows


@pytest.mark.slow
def test_export_of_split_adapters_is_one_ranks_adapter_folder_and_merges(runs, tmp_path):
    from safetensors.torch import load_file

    from trainer.export import main

    for run in ("ep2", "one"):
        main([str(runs / f"ckpt_{run}" / "step_00000002"), str(tmp_path / run)])
        main([str(runs / f"ckpt_{run}" / "step_00000002"), str(tmp_path / f"{run}_merged"), "--merge"])
    for folder, weights in (("", "adapter_model.safetensors"), ("_merged", "model.safetensors")):
        split, whole = (load_file(str(tmp_path / f"{run}{folder}" / weights)) for run in ("ep2", "one"))
        assert split.keys() == whole.keys(), folder
        for key, value in whole.items():
            assert torch.allclose(split[key], value, rtol=0, atol=1e-5), (folder, key)
    assert any("experts" in key and "lora_B" in key for key in load_file(str(tmp_path / "ep2" /
                                                                          "adapter_model.safetensors")))


def test_a_block_of_columns_is_read_back_in_place_and_in_its_own_order(tmp_path):
    """The format's block pieces: two ranks' columns of a [6, 8] tensor (peft's lora_B of 4 experts at
    r=2: expert e's columns e and 4 + e; rank 1 holds experts 2 and 3), each part cut into two pieces
    anywhere (FSDP's rows, a DeepSpeed fragment). Read whole, read as a run that cuts the pieces, and
    read as a block in its own order: the tensor's values, each in its place."""
    from trainer.checkpoint.format import Piece, PieceReader, write_tensors
    from trainer.models.weights import Block

    full = torch.arange(48.0).view(6, 8)
    pieces, checksums, parts = [], {}, {}
    for rank, block in enumerate([Block(0, 2, 4), Block(2, 2, 4)]):
        parts[block] = part = full.view(-1, 4)[:, block.column:block.column + block.width].reshape(-1)
        for piece in (Piece(0, part[:5 + rank], block), Piece(5 + rank, part[5 + rank:], block)):
            name = f"rank_{rank}_{piece.start}.safetensors"
            checksums[name] = write_tensors({f"w@{piece.start}": piece.tensor}, tmp_path / name)
            pieces.append([name, *piece.entry()])
    reader = PieceReader(tmp_path, {"tensors": {"w": {"pieces": pieces, "shape": [6, 8]}}, "checksums": checksums})
    assert torch.equal(reader.read_full("w"), full)
    assert torch.equal(reader.read("w", 13, 20), full.view(-1)[13:33])
    for block, part in parts.items():
        assert torch.equal(reader.read("w", 3, 7, block), part[3:10])


def test_zero3_with_lora_on_the_experts_is_refused_naming_what_works(tmp_path):
    """zero3 partitions the experts again over the ranks that hold them, but not their adapters: refused
    before any work, in one line; the same adapters on zero2 pass."""
    from trainer.checks import check_settings
    from trainer.config import to_config
    from trainer.errors import ConfigError

    qwen = make_model_dir(tmp_path / "qwen3_moe", "qwen3_moe", weights=False)
    with pytest.raises(ConfigError, match=r"^strategy\.ep: zero3 does not yet split LoRA adapters") as refused:
        check_settings(to_config(lora_case(qwen, "zero3", 2, strategy__ep=2)), 2)
    assert "\n" not in str(refused.value) and "fsdp, zero1 or zero2" in str(refused.value)
    check_settings(to_config(lora_case(qwen, "zero2", 2, strategy__ep=2)), 2)
