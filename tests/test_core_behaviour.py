"""Issue 2: no_sync, activation checkpointing, FSDP units, precision and offload options."""
from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor.debug import CommDebugMode

from tests.harness import case, on_ranks, records, train_cases
from trainer.config import to_config

GRADIENT_COLLECTIVES = ("allreduce", "reduce_scatter", "reduce_")


def build(env, overrides: dict):
    from trainer.distributed import seed_everything
    from trainer.loop import setup_model
    from trainer.strategies import build_strategy

    cfg = to_config(overrides)
    seed_everything(0)
    strategy = build_strategy(cfg, env)
    model, _, blocks, _ = setup_model(cfg, strategy)
    return strategy, model, blocks


def loss_of(model, x):
    """The trainer's loss of next-token targets x[1:] (the loop's normalisation, one micro-batch)."""
    from trainer.loop import token_loss_sum
    from trainer.models import logits_of

    return token_loss_sum(logits_of(model(x[:, :-1])), x[:, 1:]) / x[:, 1:].numel()


def gradient_collectives_per_micro_step(env, strategy_name: str) -> list[int]:
    strategy, model, _ = build(env, case(strategy_name))
    counts = []
    for i in range(4):
        x = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(i))
        with CommDebugMode() as comm:
            with strategy.no_sync(i < 3):
                strategy.backward(loss_of(model, x) / 4)
        counts.append(sum(n for op, n in comm.get_comm_counts().items()
                          if any(name in str(op) for name in GRADIENT_COLLECTIVES)))
    strategy.step(1.0)
    strategy.teardown()
    return counts


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero1", "zero2", "zero3"])
def test_no_sync_issues_no_gradient_collective_before_the_final_micro_step(strategy):
    counts = on_ranks(2, gradient_collectives_per_micro_step, strategy)
    for rank, per_step in counts.items():
        assert per_step[:3] == [0, 0, 0], f"rank {rank}: gradient collectives on non-final micro-steps {per_step}"
        assert per_step[3] > 0, f"rank {rank}: the final micro-step must reduce gradients {per_step}"


def block_forwards_per_step(env, strategy_name: str) -> dict[bool, int]:
    """Block forward calls in one training step, without and with activation checkpointing."""
    calls = {}
    for checkpointing in (False, True):
        strategy, model, blocks = build(env, case(strategy_name, train__activation_checkpointing=checkpointing))
        seen = []
        for block in blocks:
            # A pre-hook: recomputation stops early, once the saved tensors are rebuilt.
            block.register_forward_pre_hook(lambda *_, seen=seen: seen.append(1))
        x = torch.randint(0, 256, (2, 65))
        strategy.backward(loss_of(model, x))
        strategy.step(1.0)
        strategy.teardown()
        calls[checkpointing] = len(seen)
    return calls


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero3"])
def test_activation_checkpointing_recomputes_every_block(strategy):
    calls = on_ranks(2, block_forwards_per_step, strategy)[0]
    assert calls[False] == 2  # tiny: 2 blocks, one forward each
    assert calls[True] == 2 * calls[False]  # each block's forward runs again in backward


def fsdp_units(env) -> tuple[int, int]:
    from torch.distributed.fsdp import FSDPModule

    strategy, model, blocks = build(env, case("fsdp"))
    return sum(isinstance(b, FSDPModule) for b in blocks), len(blocks), isinstance(model, FSDPModule)


def test_every_block_is_its_own_fsdp_unit():
    sharded, total, root = on_ranks(2, fsdp_units)[0]
    assert (sharded, total, root) == (2, 2, True)


OPTION_CASES = {
    "fsdp_bf16": case("fsdp", train__precision="bf16"),
    "ddp_bf16": case("ddp", train__precision="bf16"),
    "zero3_bf16": case("zero3", train__precision="bf16"),
    "ddp_fp16": case("ddp", train__precision="fp16"),
    "fsdp_fp16": case("fsdp", train__precision="fp16"),
    "fsdp_offload": case("fsdp", strategy__offload_params=True, strategy__offload_optimizer=True),
    "zero3_offload": case("zero3", strategy__offload_params=True, strategy__offload_optimizer=True),
    "zero1_offload": case("zero1", strategy__offload_optimizer=True),
    "zero2_offload_accum": case("zero2", strategy__offload_optimizer=True, train__grad_accum_steps=2),
}


# fp32 offload moves where the optimizer steps, not what it computes: the same losses and
# gradient norms as the run without offload at the same global batch.
OFFLOAD_REFERENCE = {"fsdp_offload": "fp32", "zero3_offload": "fp32", "zero1_offload": "fp32",
                     "zero2_offload_accum": "fp32_accum"}


@pytest.fixture(scope="module")
def option_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("options")
    reference = {"fp32": case("ddp"), "fp32_accum": case("ddp", train__grad_accum_steps=2)}
    on_ranks(2, train_cases, {**reference, **OPTION_CASES}, str(out))
    return {name: records(out / name) for name in [*reference, *OPTION_CASES]}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OPTION_CASES))
def test_precision_and_offload_options_train(option_runs, name):
    losses = [r["loss"] for r in option_runs[name]]
    reference = [r["loss"] for r in option_runs["fp32"]]
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0] - 0.5, f"{name} does not learn: {losses}"
    # Lower precision moves the curve a little; fp32 offload must not move it (below).
    assert abs(losses[-1] - reference[-1]) < 0.15 * reference[-1], (losses, reference)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OFFLOAD_REFERENCE))
def test_fp32_offload_gives_the_losses_and_gradient_norms_of_the_run_without_it(option_runs, name):
    run, reference = option_runs[name], option_runs[OFFLOAD_REFERENCE[name]]
    assert [r["loss"] for r in run] == pytest.approx([r["loss"] for r in reference], rel=2e-6, abs=0)
    assert [r["grad_norm"] for r in run] == pytest.approx([r["grad_norm"] for r in reference], rel=1e-5, abs=0)
