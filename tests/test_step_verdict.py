"""The step in explicit parts (docs/design.md: The Strategy, Faults): the norm, every rank's verdict, then the update or the
skip, on every backend; an fp16 loss scaler's overflows are its own skips, counted apart. A step skipped for an infinite
loss, or for NaN gradients under bf16 (DeepSpeed's own overflow check off), is skipped alike on every backend: the
steps after it agree."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.harness import case, on_ranks, records, train_cases, with_overrides

STRATEGIES = ["ddp", "fsdp", "zero1", "zero2", "zero3"]


def faulty(strategy: str, steps: int, nan_steps=(), inf_steps=(), overflow_steps=(), **overrides) -> dict:
    """The toy model of examples/ on synthetic data; rank 1 makes NaN logits (NaN gradients) at
    `nan_steps`, an infinite loss with finite gradients at `inf_steps` and overflowing fp16
    gradients of a finite loss at `overflow_steps` (tests/faulty.py)."""
    cfg = with_overrides(case(strategy, steps=steps), data__name="synthetic", data__num_samples=256,
                         strategy__wrap=["ToyBlock"], **overrides)
    cfg["model"] = {"name": "faulty", "kind": "custom", "_target_": "tests.faulty.build", "vocab": 64, "dim": 16,
                    "layers": 2, "nan_steps": list(nan_steps), "inf_steps": list(inf_steps),
                    "overflow_steps": list(overflow_steps), "rank": 1,
                    "vocab_size": 64, "seq_len": 32}
    return cfg


def saved_step(ckpt: Path, step: int) -> float:
    """Adam's step count in the checkpoint of `step` (rank 0 saves it)."""
    return load_file(ckpt / f"step_{step:08d}" / "rank_00000.safetensors")["optim.step@0"].item()


def test_every_backend_skips_what_the_verdict_skips_and_saves_before_its_first_update(tmp_path):
    # Step 1 is skipped (NaN gradients) and saved before any update; step 3 has an infinite loss with
    # finite gradients, which no backend's own overflow check would skip.
    # Also DeepSpeed's unmanaged accumulation (grad_reduce=micro_step), whose boundary work the norm
    # does before engine.step().
    runs = [(name, "step") for name in STRATEGIES] + [(name, "micro_step") for name in ("zero1", "zero2", "zero3")]
    configs = {f"{name}_{mode}": faulty(name, 4, nan_steps=[1], inf_steps=[3], strategy__grad_reduce=mode,
                                        checkpoint__dir=str(tmp_path / f"{name}_{mode}" / "ckpt"),
                                        checkpoint__every_steps=1, checkpoint__keep_last=0, train__max_bad_steps=3)
               for name, mode in runs}
    on_ranks(2, train_cases, configs, str(tmp_path))
    for name in configs:
        steps = records(tmp_path / name)
        assert [r["skipped"] for r in steps] == [1, 1, 2, 2], name
        # Adam's saved step count is the steps minus the skipped ones
        assert [saved_step(tmp_path / name / "ckpt", s) for s in (1, 2, 3, 4)] == [0, 1, 1, 2], name
        assert "scale_skips" not in steps[0], name  # fp32: no loss scaler


def fp16_on_cpu(env, configs: dict, out: str) -> None:
    """train_cases with DeepSpeed's fp16 on this CPU: its CPU accelerator says fp16 is unsupported
    (no fp16 in mkldnn here), and the trainer refuses it for that; the math itself runs."""
    from deepspeed.accelerator import get_accelerator

    import trainer.strategies.ds_config as ds_config

    get_accelerator().is_fp16_supported = lambda: True
    ds_config.device_type = lambda: "cuda"
    train_cases(env, configs, out)


@pytest.mark.slow  # the quick suite resumes DeepSpeed's fp16 scale (test_faults)
@pytest.mark.parametrize("strategies", [["ddp", "zero3"], ["fsdp", "zero1", "zero2"]])
def test_fp16_scale_overflows_are_skipped_apart_and_never_count_as_bad_steps(tmp_path, strategies):
    # Three overflows in a row with train.max_bad_steps=2: the scaler's own work, not a fault. A NaN
    # loss after them is a bad step, and the scale is saved as the scaler left it. Before the step
    # was explicit, ZeRO-3 died at its first overflow (KeyError) and the others stopped at step 3.
    configs = {name: faulty(name, 6, overflow_steps=[2, 3, 4], nan_steps=[5], train__precision="fp16",
                            train__max_bad_steps=2, checkpoint__dir=str(tmp_path / name / "ckpt"))
               for name in strategies}
    on_ranks(2, fp16_on_cpu, configs, str(tmp_path))
    for name in strategies:
        steps = records(tmp_path / name)
        assert [r["scale_skips"] for r in steps] == [0, 1, 2, 3, 3, 3], name
        assert [r["skipped"] for r in steps] == [0, 0, 0, 0, 1, 1], name
        scales = [r["loss_scale"] for r in steps]
        # backed off by the overflows and by the NaN gradients of step 5 (DeepSpeed after its hysteresis), then held
        assert scales[0] > scales[3] > scales[4] == scales[5], (name, scales)
        assert all(r["loss"] == r["loss"] for r in steps if r["step"] != 5), name
        manifest = json.loads((tmp_path / name / "ckpt" / "step_00000006" / "manifest.json").read_text())
        assert manifest["trainer"]["loss_scale"]["scale"] == scales[5] and manifest["trainer"]["scale_skips"] == 3
        assert saved_step(tmp_path / name / "ckpt", 6) == 2, name  # steps 1 and 6 updated


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
