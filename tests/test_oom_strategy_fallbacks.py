"""train.on_oom's strategy fallbacks (training/adapt.py): past micro-batch 1, activation checkpointing and
the fused loss, the restart takes the next option of the planner's decision order that it says fits
with the failure's bytes and that passes the checks a user's command gets, and resumes there from
the portable checkpoint with the losses of a run started at that strategy."""
from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch

from tests.harness import records, run_cli
from trainer.config import to_config
from trainer.oom import TEST_SWITCH, Adaptation, OomRecorder, OutOfMemory, append, read_oom_records
from trainer.training.adapt import adapt

AT_THE_BOTTOM = {"micro_batch_size": 1, "grad_accum_steps": 8, "activation_checkpointing": True, "fused_loss": True}


def failure(plan: Adaptation, asked: int) -> dict:
    return {"event": "out_of_memory", "step": 3, "where": "forward", "rank": 1, "rows": 1, "asked": asked,
            "free": 0, "plan": asdict(plan), "error": "CUDA out of memory."}


def test_the_fallback_is_the_first_option_that_holds_the_missing_bytes_less_and_passes_the_checks(tmp_path):
    """The built-in tiny model at 2 ranks (python -m trainer.plan: ddp with AC holds 2.3 MiB a
    device in fp16, zero1 and zero2 0.27 MiB less, fsdp 0.8 MiB less). fp16: DeepSpeed on CPU
    refuses it, so zero1 and zero2 are skipped, each with the check's reason."""
    cfg = to_config({"train": {**AT_THE_BOTTOM, "precision": "fp16"}})
    append(tmp_path, failure(Adaptation.of(cfg), asked=100_000))
    plan, [event] = adapt(cfg, tmp_path, kept=None, world_size=2)
    assert plan.strategy == {"name": "fsdp", "sp": 1, "offload_optimizer": False, "offload_params": False}
    assert plan.applied(cfg).strategy.name.value == "fsdp" and plan.adaptations == 1
    assert event["what"] == "strategy ddp -> fsdp" and event["skipped"] == [
        f"strategy={name} refused: train.precision: DeepSpeed on CPU supports bf16 and fp32, not fp16"
        for name in ("zero1", "zero2")]
    assert "the planner counts 1.5 MiB per device there against 2.3 MiB at ddp" in event["why"]
    # the next failure, more bytes short than fsdp saves: on to offload, the next option that holds that much less
    append(tmp_path, failure(plan, asked=1_000_000))
    offloaded, [event] = adapt(cfg, tmp_path, kept=None, world_size=2)
    assert offloaded.strategy == {"name": "fsdp", "sp": 1, "offload_optimizer": True, "offload_params": True}
    assert event["what"] == "strategy.offload_optimizer false -> true, strategy.offload_params false -> true"
    assert offloaded.past(plan, 1) and not plan.past(offloaded, 1)
    append(tmp_path, failure(offloaded, asked=10 ** 9))  # nothing holds a GB less
    with pytest.raises(Exception, match="nothing is left to adapt"):
        adapt(cfg, tmp_path, kept=None, world_size=2)


def test_a_sequence_parallel_fallback_keeps_the_global_batch_with_more_accumulation(tmp_path):
    """A few bytes short: sp=2 (half the activations a rank) comes first; its sp group of the 2 ranks
    reads the same rows, so the accumulation doubles, and the next start keeps that plan."""
    cfg = to_config({"train": AT_THE_BOTTOM})
    append(tmp_path, failure(Adaptation.of(cfg), asked=100_000))
    plan, [event] = adapt(cfg, tmp_path, kept=None, world_size=2)
    assert plan.strategy == {"name": "ddp", "sp": 2, "offload_optimizer": False, "offload_params": False}
    assert event["what"] == "train.grad_accum_steps 8 -> 16, strategy.sp 1 -> 2"
    assert adapt(cfg, tmp_path, kept=None, world_size=2) == (plan, [])  # past the settings' plan: kept


def test_a_sequence_parallel_fallback_whose_accumulation_would_not_be_whole_is_skipped(tmp_path):
    """From sp=2 at accumulation 1 on 6 ranks, sp=3 would need 1.5 micro-steps (the global batch would
    change): skipped, saying so; sp=6 (3 micro-steps) is the fallback."""
    model = {"name": "tiny", "n_heads": 6, "d_model": 96, "seq_len": 96}
    cfg = to_config({"model": model, "strategy": {"sp": 2}, "train": {**AT_THE_BOTTOM, "grad_accum_steps": 1}})
    append(tmp_path, failure(Adaptation.of(cfg), asked=1_000))
    plan, [event] = adapt(cfg, tmp_path, kept=None, world_size=6)
    assert (plan.strategy["sp"], plan.grad_accum_steps) == (6, 3), (plan, event)
    assert event["skipped"][0] == ("strategy.sp=3 refused: train.grad_accum_steps=1 x 3 / 2 is not whole "
                                   "(the global batch would change)"), event


def test_without_deepspeed_the_zero_fallbacks_are_skipped_as_a_users_command_would_be_refused(tmp_path, monkeypatch):
    """A machine without DeepSpeed (the GPU image): zero1 and zero2 would fit, the checks refuse them."""
    import importlib.metadata

    installed = importlib.metadata.version

    def version(name: str) -> str:
        if name == "deepspeed":
            raise importlib.metadata.PackageNotFoundError(name)
        return installed(name)
    monkeypatch.setattr(importlib.metadata, "version", version)
    cfg = to_config({"train": AT_THE_BOTTOM})
    append(tmp_path, failure(Adaptation.of(cfg), asked=200_000))
    plan, [event] = adapt(cfg, tmp_path, kept=None, world_size=2)
    assert plan.strategy["name"] == "fsdp" and event["skipped"] == [
        f"strategy={name} refused: strategy: strategy={name} needs DeepSpeed, which is not installed: "
        "pip install 'deepspeed>=0.19.8'" for name in ("zero1", "zero2")]


def test_the_switchs_bytes_make_a_full_device_that_asks_for_what_the_rank_keeps_above_them(monkeypatch):
    held = {"params": 600, "grads": 10 ** 6, "optim": 1200, "peak": None}  # gradients come and go: not counted
    oom_recorder = OomRecorder(Adaptation(1, 8, True, 8), rank=1, device=torch.device("cpu"), step=3, held=lambda: held)
    monkeypatch.setenv(TEST_SWITCH, "rank=1,bytes=1500,from_step=3")
    with pytest.raises(OutOfMemory) as caught:
        with oom_recorder.record_oom_in("forward", 1):
            pass
    assert (caught.value.failure["asked"], caught.value.failure["free"]) == (300, 0)  # CUDA's words, read back
    held["optim"] = 900  # a strategy that keeps less: no failure
    with oom_recorder.record_oom_in("forward", 1):
        pass


STEPS = 5
COMMON = ["train.micro_batch_size=1", "train.grad_accum_steps=8", "train.activation_checkpointing=true",
          "train.fused_loss=true", f"train.max_steps={STEPS}", "train.log_every=1", "data.num_workers=0",
          "optim.warmup_steps=2", "nproc=2"]
# Parameters and Adam state a rank keeps at 2 ranks (the switch's bytes): ddp 1.64 MB, fsdp 1.10 MB. A
# device of 1.25 MB: ddp is 0.39 MB short, which sp=2 (0.17 MB fewer activations, as the planner counts
# them), zero1 and zero2 (0.27 MB) do not save, and fsdp (0.82 MB) does.
DEVICE_BYTES = 1_250_000


@pytest.mark.slow  # two launches of 2 ranks, one restarted: ~60 s here
def test_a_run_at_the_bottom_of_the_ladder_moves_to_the_strategy_the_planner_says_fits_with_its_losses(tmp_path):
    run_dir, ckpt, planned = tmp_path / "run", tmp_path / "ckpt", tmp_path / "planned"
    result = run_cli(*COMMON, "strategy=ddp", "max_restarts=1", f"checkpoint.dir={ckpt}", "checkpoint.every_steps=2",
                     f"hydra.run.dir={run_dir}", env={TEST_SWITCH: f"rank=1,bytes={DEVICE_BYTES},from_step=3"})
    assert result.returncode == 0, result.stderr[-3000:]
    [failed] = [r for r in read_oom_records(run_dir) if r["event"] == "out_of_memory"]
    adapted = [e for e in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
               if e.get("event") == "adapted"]
    assert [(e["step"], e["what"]) for e in adapted] == [(3, "strategy ddp -> fsdp")], adapted
    assert adapted[0]["asked"] == failed["asked"] > 0 and adapted[0]["free"] == 0
    assert "the restart adapts (the next strategy that the planner says fits)" in result.stderr
    assert "[trainer] adapted after out of memory: strategy ddp -> fsdp (rank 1 ran out of memory in the forward " \
           "of step 3; the planner counts" in result.stdout
    manifest = json.loads((ckpt / f"step_{STEPS:08d}" / "manifest.json").read_text())
    assert manifest["trainer"]["plan"]["strategy"]["name"] == "fsdp"  # kept: a later resume stays at fsdp
    reference = run_cli(*COMMON, "strategy=fsdp", f"hydra.run.dir={planned}")
    assert reference.returncode == 0, reference.stderr[-3000:]
    losses, expected = [r["loss"] for r in records(run_dir)], [r["loss"] for r in records(planned)]
    assert len(losses) == len(expected) == STEPS
    assert all(abs(a - e) <= 1e-6 * abs(e) for a, e in zip(losses, expected)), (losses, expected)
