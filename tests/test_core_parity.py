"""Every backend gives the 1-rank losses; accumulation, clipping, AC, bytes per rank.

All 2-rank runs share one gloo process group (one launch), then the tests read metrics.jsonl.
"""
from __future__ import annotations

import pytest

from tests.harness import (
    LOSS_RTOL,
    assert_close,
    assert_resumes,
    case,
    losses,
    on_ranks,
    records,
    resuming,
    saving,
    train_cases,
    with_overrides,
)
from trainer.config import Sharding, StrategyName
from trainer.memory import fsdp_shard_count, per_rank_bytes

# LOSS_RTOL (tests/harness.py) was measured on these runs.
NORM_RTOL = 1e-5
TINY_PARAMS = 136_960

BACKENDS = {
    "ddp": case("ddp"),
    "fsdp": case("fsdp"),
    "fsdp_grad_op": case("fsdp", strategy__sharding="SHARD_GRAD_OP"),
    "fsdp_no_shard": case("fsdp", strategy__sharding="NO_SHARD"),
    "fsdp_hybrid": case("fsdp", strategy__sharding="HYBRID_SHARD"),
    "zero1": case("zero1"),
    "zero2": case("zero2"),
    "zero3": case("zero3"),
}
MICRO = {"train__micro_batch_size": 2, "train__grad_accum_steps": 4}


# Global batch 16 everywhere: 1 rank x 16, 2 ranks x 8, 2 ranks x 2 x accum 4.
CASES = {name: with_overrides(c, train__micro_batch_size=8) for name, c in BACKENDS.items()}
CASES.update({f"{name}_accum": with_overrides(c, **MICRO) for name, c in BACKENDS.items()})
CASES.update({f"{name}_ac": with_overrides(CASES[name], train__activation_checkpointing=True)
              for name in ("ddp", "fsdp", "zero1", "zero3")})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("parity")
    on_ranks(1, train_cases, {"baseline": with_overrides(case("ddp"), train__micro_batch_size=16)}, str(out))
    on_ranks(2, train_cases, CASES, str(out))
    return {name: records(out / name) for name in ["baseline", *CASES]}


def assert_close_seq(actual, expected, rtol, what):
    assert len(actual) == 8, what
    assert_close(actual, expected, what, rtol)


@pytest.mark.parametrize("name", list(BACKENDS))
def test_losses_match_one_rank_baseline(runs, name):
    base = [r["loss"] for r in runs["baseline"]]
    assert base[-1] < base[0] - 0.5, "the baseline must learn"
    assert_close_seq([r["loss"] for r in runs[name]], base, LOSS_RTOL, name)


@pytest.mark.parametrize("name", list(BACKENDS))
def test_accumulation_matches_one_big_micro_batch(runs, name):
    assert_close_seq([r["loss"] for r in runs[f"{name}_accum"]], [r["loss"] for r in runs[name]], LOSS_RTOL, name)


@pytest.mark.parametrize("name", list(BACKENDS))
def test_reported_grad_norm_agrees_across_backends(runs, name):
    base = [r["grad_norm"] for r in runs["baseline"]]
    assert max(base) > 1.0, "grad_clip=1.0 must actually clip in this run"
    assert_close_seq([r["grad_norm"] for r in runs[name]], base, NORM_RTOL, name)


@pytest.mark.parametrize("name", ["ddp", "fsdp", "zero1", "zero3"])
def test_activation_checkpointing_keeps_losses(runs, name):
    assert_close_seq([r["loss"] for r in runs[f"{name}_ac"]], [r["loss"] for r in runs[name]], LOSS_RTOL, name)


@pytest.mark.parametrize("name", list(BACKENDS))
def test_bytes_per_rank_follow_the_table(runs, name):
    cfg = BACKENDS[name]["strategy"]
    strategy = StrategyName(cfg["name"])
    shards = fsdp_shard_count(Sharding(cfg.get("sharding", "FULL_SHARD")), world_size=2, local_world_size=2)
    expected = per_rank_bytes(strategy, TINY_PARAMS, world_size=2, fsdp_shards=shards)
    mem = runs[name][-1]["mem"]
    for key in ("params", "grads", "optim"):
        assert mem[key] == pytest.approx(expected[key], rel=0.04), f"{name} {key}: {mem[key]} vs {expected[key]}"


def test_sharding_shrinks_memory_in_the_documented_order(runs):
    mem = {name: runs[name][-1]["mem"] for name in ("ddp", "zero1", "zero2", "zero3", "fsdp")}
    assert mem["zero1"]["optim"] < mem["ddp"]["optim"] and mem["zero1"]["grads"] == mem["ddp"]["grads"]
    assert mem["zero2"]["grads"] < 0.6 * mem["zero1"]["grads"] and mem["zero2"]["params"] == mem["ddp"]["params"]
    assert mem["zero3"]["params"] < 0.6 * mem["ddp"]["params"]
    assert mem["fsdp"]["params"] < 0.6 * mem["ddp"]["params"]


# -- persistent buffers (issue 27) ----------------------------------------------------------------

def centring_toy(strategy: str) -> dict:
    """The toy model whose output is centred by the running mean of the batches it saw (tests/toys.py):
    a rank that keeps statistics of its own batches computes other losses than DDP's, which takes
    rank 0's before each forward. Evaluated at steps 3 and 6, saved at 3."""
    cfg = with_overrides(case(strategy, steps=6), data__name="synthetic", data__num_samples=256,
                         data__val_fraction=0.25, eval__every_steps=3, strategy__wrap=["ToyBlock"])
    cfg["model"] = {"name": "toy", "kind": "custom", "_target_": "tests.toys.build", "vocab": 64, "dim": 16,
                    "layers": 2, "centre": True, "vocab_size": 64, "seq_len": 32}
    return cfg


@pytest.mark.slow
def test_running_statistics_are_rank_0s_on_every_backend_and_resume(tmp_path):
    ckpt, sharded = tmp_path / "ckpt", ("fsdp", "zero3")
    on_ranks(2, train_cases, {s: saving(centring_toy(s), ckpt / s, 3) for s in ("ddp", *sharded)}, str(tmp_path))
    on_ranks(2, train_cases, {f"{s}:resumed": resuming(centring_toy(s), ckpt / s, 3) for s in sharded}, str(tmp_path))
    ddp = records(tmp_path / "ddp")
    for s in sharded:
        straight = records(tmp_path / s)
        for split in (False, True):  # training losses, then validation losses
            assert_close(losses(r for r in straight if ("split" in r) is split),
                         losses(r for r in ddp if ("split" in r) is split), f"{s} val={split}")
        resumed = records(tmp_path / f"{s}:resumed")
        assert_resumes(resumed, straight, at=3, what=s)  # bitwise
        assert [r["loss"] for r in resumed if "split" in r] == [r["loss"] for r in straight if "split" in r][1:], s
