"""Every weight right: what a pretrained folder may hold, fresh initialisation with
transformers' own spread, frozen parameters and persistent buffers under every strategy, uneven
shards, signals at the edges of a step, resumes that are exact (dropout, new ranks), and a
tokenised-data cache that outlasts the collective timeout, a killed writer and shared nodes."""
from __future__ import annotations

import json
import math

import pytest
import torch

from tests.harness import (
    case,
    on_ranks,
    records,
    run_cli,
    train_cases,
    with_overrides,
)
from trainer.config import to_config
from trainer.strategies.base import optimizer_step

TOY_CLI = ("model=custom", "model._target_=tests.toys.build", "strategy.wrap=[ToyBlock]", "data=synthetic",
           "data.num_samples=256", "model.seq_len=32", "data.num_workers=0", "train.log_every=1")


def event_lines(run_dir) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "event" in r]


def test_ctrl_c_saves_and_exits_130_like_sigterm(tmp_path):
    result = run_cli(*TOY_CLI, "+model.signal=SIGINT", "+model.signal_at_step=3", "train.max_steps=8",
                     f"checkpoint.dir={tmp_path / 'ckpt'}", f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 130, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "KeyboardInterrupt" not in result.stderr, result.stderr[-3000:]
    assert event_lines(tmp_path / "run")[-1] == {"event": "preempted", "step": 3, "signal": "SIGINT",
                                                 "checkpoint": str(tmp_path / "ckpt" / "step_00000003")}


@pytest.mark.slow
def test_a_signal_at_the_last_step_ends_the_run_as_planned(tmp_path):
    result = run_cli(*TOY_CLI, "+model.signal_at_step=4", "train.max_steps=4", f"checkpoint.dir={tmp_path / 'ckpt'}",
                     f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert [e["event"] for e in event_lines(tmp_path / "run")] == ["end"]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step_00000004"


@pytest.mark.slow
def test_a_signal_during_an_evaluation_and_save_stops_right_after_them(tmp_path):
    result = run_cli(*TOY_CLI, "+model.signal_in_eval=true", "data.val_fraction=0.25", "eval.every_steps=2",
                     "eval.max_batches=1", "train.max_steps=8", "checkpoint.every_steps=2",
                     f"checkpoint.dir={tmp_path / 'ckpt'}", f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 143, result.stderr[-3000:]
    assert event_lines(tmp_path / "run")[-1]["step"] == 2  # no extra step ...
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [".writer.lock", "latest", "step_00000002"]  # ... nor save


STRATEGIES = ["ddp", "fsdp", "zero1", "zero2", "zero3"]


def skip_case(strategy: str, **overrides) -> dict:
    """The toy model with a fault on rank 1 at step 3, 5 steps, synthetic data."""
    cfg = with_overrides(case(strategy, steps=5), data__name="synthetic", data__num_samples=256,
                         strategy__wrap=["ToyBlock"], **overrides)
    cfg["model"] = {"name": "faulty", "kind": "custom", "_target_": "tests.faulty.build", "vocab": 64, "dim": 16,
                    "layers": 2, "rank": 1, "vocab_size": 64, "seq_len": 32}
    return cfg


@pytest.fixture(scope="module")
def skipped_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("skips")
    no_check = root / "ds_no_overflow_check.json"
    no_check.write_text(json.dumps({"bf16": {"check_grad_overflow": False}}))
    configs = {f"inf:{s}": skip_case(s) for s in ("ddp", "fsdp", "zero2", "zero3")}
    for name in configs:  # an infinite loss with finite gradients
        configs[name]["model"]["inf_steps"] = [3]
    configs.update({f"nan-bf16:{s}": skip_case(s, train__precision="bf16", **(
        {"strategy__deepspeed_config": str(no_check)} if s.startswith("zero") else {}))
        for s in ("ddp", "fsdp", "zero2", "zero3")})
    for name in configs:
        if name.startswith("nan"):  # NaN gradients, and a ds_config whose own check is off
            configs[name]["model"]["nan_steps"] = [3]
    on_ranks(2, train_cases, configs, str(root))
    return {name: records(root / name) for name in configs}


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["inf", "nan-bf16"])
def test_a_skipped_step_is_skipped_on_every_backend(skipped_runs, fault):
    runs = {name.split(":")[1]: rows for name, rows in skipped_runs.items() if name.startswith(fault)}
    for strategy, rows in runs.items():
        assert [r["skipped"] for r in rows] == [0, 0, 1, 1, 1], strategy
        assert all(math.isfinite(r["loss"]) for r in rows[3:]), strategy
    # Skipped alike: the steps after it agree across backends (bf16: as closely as bf16 runs agree).
    rel = 2e-6 if fault == "inf" else 2e-2
    for strategy, rows in runs.items():
        assert [r["loss"] for r in rows[3:]] == pytest.approx([r["loss"] for r in runs["ddp"][3:]], rel=rel), strategy


def reduced_bytes(env) -> dict:
    """Bytes the gradient collectives carry in one bf16 step, per strategy and strategy.reduce_dtype."""
    from tests.harness import CollectiveBytes
    from tests.test_core_behaviour import build, loss_of

    out = {}
    for strategy_name in ("ddp", "fsdp", "zero2", "zero3"):
        for dtype in ("fp32", "bf16"):
            strategy, model, _ = build(env, case(strategy_name, train__precision="bf16",
                                                 strategy__reduce_dtype=dtype))
            x = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(0))
            counter = CollectiveBytes()
            with counter:
                with strategy.autocast():
                    loss = loss_of(model, x)
                strategy.backward(loss)
                optimizer_step(strategy, 1.0)
            strategy.teardown()
            out[(strategy_name, dtype)] = counter.bytes
    return out


@pytest.mark.slow
def test_gradients_are_reduced_in_the_reduce_dtype_on_every_backend():
    from trainer.config import GradReduce, Precision, ReduceDtype, StrategyName
    from trainer.models import model_facts
    from trainer.plan import step_traffic
    from trainer.strategies.ds_config import ZERO3_PERSISTENCE_THRESHOLD

    measured = on_ranks(2, reduced_bytes)[0]
    facts = model_facts(to_config(case("ddp")).model, None)
    for (strategy, dtype), carried in measured.items():
        planned = step_traffic(StrategyName(strategy), facts.params, facts.elements_below(ZERO3_PERSISTENCE_THRESHOLD), 2, Precision.bf16, 1,
                               GradReduce.step, offload=False, reduce_dtype=ReduceDtype(dtype))
        kind = "all_reduce" if strategy in ("ddp", "zero2") else "reduce_scatter"
        assert carried[kind] == pytest.approx(planned[kind], rel=0.02, abs=64), (strategy, dtype, carried, planned)
    for strategy in ("ddp", "fsdp", "zero2", "zero3"):
        fp32, bf16 = measured[(strategy, "fp32")], measured[(strategy, "bf16")]
        kind = "all_reduce" if strategy in ("ddp", "zero2") else "reduce_scatter"
        assert fp32[kind] == pytest.approx(2 * bf16[kind], rel=0.02), (strategy, fp32, bf16)


@pytest.mark.parametrize("precision,reduce_dtype", [("fp32", "bf16"), ("bf16", "fp16"), ("fp16", "bf16")])
def test_gradients_reduce_in_fp32_or_the_training_dtype(precision, reduce_dtype):
    from trainer.checks import validate
    from trainer.errors import ConfigError

    with pytest.raises(ConfigError, match=f"strategy.reduce_dtype: fp32, or the training dtype "
                                          f"\\(train.precision={precision}\\); got {reduce_dtype}"):
        validate(to_config({"train": {"precision": precision}, "strategy": {"reduce_dtype": reduce_dtype}}))
    validate(to_config({"train": {"precision": precision}, "strategy": {"reduce_dtype": precision}}))
