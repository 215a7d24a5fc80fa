"""What a checkpoint carries and a resume restores, under another strategy and at another world
size: frozen parameters are saved without optimizer moments and never change, persistent buffers
are saved, restored and exported, a model with dropout resumes bit-exact, ranks beyond the saved
world size get RNG states of their own, and shards that divide by no world size train as one rank
does and resume at another."""
from __future__ import annotations

import pytest
import torch

from tests.harness import (
    LOSS_RTOL,
    assert_resumes,
    case,
    on_ranks,
    records,
    resuming,
    saving,
    train_and_resume,
    train_cases,
    with_overrides,
)

FROZEN_STRATEGIES = ["ddp", "fsdp", "zero2", "zero3"]


# (source, source world size) -> (target, target world size)
FROZEN_CROSS = [("ddp", 2, "zero3", 2), ("zero3", 2, "fsdp", 1), ("fsdp", 2, "zero2", 2), ("zero2", 2, "ddp", 1)]


TOY = {"vocab": 64, "dim": 16, "layers": 2}


def toy_case(strategy: str, world: int, **overrides) -> dict:
    """The toy model with its embedding frozen and running statistics in buffers, 6 steps,
    global batch 8 at any world size."""
    cfg = with_overrides(case(strategy, steps=6), data__name="synthetic", data__num_samples=256,
                         strategy__wrap=["ToyBlock"], train__micro_batch_size=8 // world, **overrides)
    cfg["model"] = {"name": "toy", "kind": "custom", "_target_": "tests.toys.build", **TOY, "frozen": ["embed"],
                    "stats": True, "vocab_size": 64, "seq_len": 32}
    return cfg


@pytest.fixture(scope="module")
def toy_runs(tmp_path_factory):
    """Each strategy at 2 ranks, saving at steps 3 and 6; resumed from step 3 under another."""
    root = tmp_path_factory.mktemp("toys")
    straight = {f"{s}@2": saving(toy_case(s, 2), root / f"{s}@2", 3) for s in FROZEN_STRATEGIES}
    on_ranks(2, train_cases, straight, str(root / "runs"))
    for world in (1, 2):
        on_ranks(world, train_cases, {
            f"{a}->{b}@{m}": saving(resuming(toy_case(b, m), root / f"{a}@2", 3), root / f"{a}->{b}@{m}", 3)
            for a, _, b, m in FROZEN_CROSS if m == world}, str(root / "runs"))
    return root


def start_values():
    from tests.toys import build
    from trainer.config import TrainConfig
    from trainer.models.weights import InitWeights, allocate_params, fill, params_on_meta

    with params_on_meta():
        model = build(**TOY, stats=True)
    allocate_params(model, torch.device("cpu"))
    fill(model, InitWeights(model, seed=TrainConfig().seed))
    return model


@pytest.mark.slow  # make test stays under 8 minutes: the rest of what it covers is in the quick suite
def test_frozen_parameters_save_resume_anywhere_and_never_change(toy_runs):
    from trainer.checkpoint.format import PieceReader, read_manifest

    model = start_values()
    for strategy in FROZEN_STRATEGIES:
        for step in ("step_00000003", "step_00000006"):
            path = toy_runs / f"{strategy}@2" / step
            manifest = read_manifest(path)
            reader = PieceReader(path, manifest)
            assert torch.equal(reader.read_full("model.embed.weight"), model.embed.weight), (strategy, step)
            assert not any(k.startswith("optim.embed.") for k in manifest["tensors"]), strategy  # no moments
            assert "optim.head.weight.exp_avg" in manifest["tensors"]
            assert not torch.equal(reader.read_full("model.head.weight"), model.head.weight)  # that one trains
    for source, _, target, world in FROZEN_CROSS:
        assert_resumes(records(toy_runs / "runs" / f"{source}->{target}@{world}"),
                       records(toy_runs / "runs" / f"{target}@2"), at=3, what=f"{source}->{target}@{world}",
                       rtol=LOSS_RTOL)


def buffers_at(path) -> dict[str, torch.Tensor]:
    from trainer.checkpoint.format import PieceReader, read_manifest

    manifest = read_manifest(path)
    return {name: PieceReader(path, manifest).read_full(f"buffer.{name}") for name in manifest["buffers"]}


@pytest.mark.slow  # make test stays under 8 minutes: the rest of what it covers is in the quick suite
def test_persistent_buffers_are_saved_restored_under_another_strategy_and_exported(toy_runs, tmp_path):
    from safetensors.torch import load_file

    from trainer.checkpoint.export import export

    names = {"stats.mean", "stats.count"}
    for strategy in FROZEN_STRATEGIES:
        saved = buffers_at(toy_runs / f"{strategy}@2" / "step_00000006")
        assert set(saved) == names and saved["stats.count"].item() == 6, strategy
        assert saved["stats.mean"].abs().min() > 0, strategy  # moved from its start (zeros)
    # Same world size, so rank 0 (whose buffers are saved) sees the same batches: the statistics
    # after step 6 of a run resumed at 3 are those of the run that never stopped only if step 3's
    # were restored (else 3 steps of momentum 0.1 from zeros, and a count of 3).
    for source, _, target, world in FROZEN_CROSS:
        if world == 2:
            resumed = buffers_at(toy_runs / f"{source}->{target}@2" / "step_00000006")
            straight = buffers_at(toy_runs / f"{target}@2" / "step_00000006")
            for name in names:
                assert torch.allclose(resumed[name], straight[name], rtol=1e-5, atol=1e-7), (source, target, name)
    export(toy_runs / "zero3@2" / "step_00000006", tmp_path / "toy.safetensors")
    exported = load_file(tmp_path / "toy.safetensors")
    assert exported["stats.count"].dtype == torch.int64 and exported["stats.count"] == 6
    assert torch.equal(exported["stats.mean"], buffers_at(toy_runs / "zero3@2" / "step_00000006")["stats.mean"])


def dropout_case(**overrides) -> dict:
    cfg = toy_case("ddp", 1, **overrides)
    cfg["model"].update(frozen=[], stats=False, dropout=0.2)
    return cfg


@pytest.mark.slow  # make test stays under 8 minutes: the rest of what it covers is in the quick suite
def test_a_model_with_dropout_resumes_bit_exact(tmp_path):
    # A resume makes a new loader iterator, which must not draw from the RNG dropout draws from.
    straight, resumed = train_and_resume(1, dropout_case(), tmp_path, at=3)
    assert_resumes(resumed, straight, at=3)  # bitwise


def test_ranks_beyond_the_saved_world_size_get_rng_states_of_their_own():
    from trainer.checkpoint.manager import rng_state_of_new_rank

    rank0 = torch.get_rng_state()
    states = [rng_state_of_new_rank(rank0, rank) for rank in (2, 3)]
    draws = []
    for state in [rank0, *states]:
        torch.set_rng_state(state)
        draws.append(torch.rand(4))
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[1], draws[2])
    assert torch.equal(rng_state_of_new_rank(rank0, 2), states[0])  # the same on every resume


def uneven_case(strategy: str, world: int, **overrides) -> dict:
    """Dimensions that divide by neither 2 nor 3: a prime vocabulary (251), width 35 (5 heads of
    7), feed-forward 91; global batch 6 at any world size."""
    return with_overrides(case(strategy, steps=6), model__vocab_size=251, model__d_model=35, model__n_heads=5,
                          model__d_ff=91, model__seq_len=32, data__name="synthetic", data__num_samples=256,
                          train__micro_batch_size=6 // world, **overrides)


@pytest.mark.slow
def test_uneven_shards_at_3_ranks_train_as_1_rank_and_resume_at_2(tmp_path):
    ckpt = tmp_path / "zero3@3"
    on_ranks(1, train_cases, {"ddp@1": uneven_case("ddp", 1)}, str(tmp_path))
    on_ranks(3, train_cases, {"fsdp@3": uneven_case("fsdp", 3),
                              "zero3@3": uneven_case("zero3", 3, checkpoint__dir=str(ckpt), checkpoint__every_steps=3,
                                                     checkpoint__keep_last=0)}, str(tmp_path))
    on_ranks(2, train_cases, {"zero3@3->fsdp@2": uneven_case("fsdp", 2, checkpoint__resume=str(ckpt / "step_00000003"))},
             str(tmp_path))
    one = [r["loss"] for r in records(tmp_path / "ddp@1")]
    for run, first in (("fsdp@3", 0), ("zero3@3", 0), ("zero3@3->fsdp@2", 3)):
        assert [r["loss"] for r in records(tmp_path / run)] == pytest.approx(one[first:], rel=2e-6), run
