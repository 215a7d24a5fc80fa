"""train.on_oom (oom.py): what a rank out of memory records and says, the plan a restart
adapts to, and the proof that an adapted run has the losses of the run started at micro-batch 1."""
from __future__ import annotations

import json
import shutil
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from tests.harness import FULL_MATRIX, records, run_cli
from trainer.config import to_config
from trainer.errors import RunError
from trainer.metrics import read_metrics
from trainer.models.checks import fusable
from trainer.oom import (
    TEST_SWITCH,
    Adaptation,
    OomRecorder,
    OutOfMemory,
    append,
    asked_bytes,
    next_plan,
    read_oom_records,
)
from trainer.training.adapt import adapt


def failure(plan: Adaptation, where: str = "forward", rank: int = 1, step: int = 3) -> dict:
    return {"event": "out_of_memory", "step": step, "where": where, "rank": rank, "rows": plan.micro_batch_size,
            "asked": 2 ** 20, "free": 0, "plan": asdict(plan), "error": "CUDA out of memory."}


def test_the_ladder_keeps_the_global_batch_then_turns_on_activation_checkpointing():
    plan, ladder = Adaptation(8, 1, False, 8), []
    while plan := next_plan(plan, failure(plan), can_fuse=False):
        ladder.append((plan.micro_batch_size, plan.grad_accum_steps, plan.activation_checkpointing, plan.adaptations))
    assert ladder == [(4, 2, False, 1), (2, 4, False, 2), (1, 8, False, 3), (1, 8, True, 4)]
    assert plan is None and next_plan(Adaptation(1, 8, True, 8), failure(Adaptation(1, 8, True, 8)), can_fuse=True) == \
        Adaptation(1, 8, True, 8, adaptations=1, fused_loss=True)  # then the fused loss, where the model takes it
    fused = Adaptation(1, 8, True, 8, fused_loss=True)
    assert next_plan(fused, failure(fused), can_fuse=True) is None
    assert fused.applied(to_config({})).train.fused_loss and fused.past(Adaptation(1, 8, True, 8), 1)
    odd = next_plan(Adaptation(6, 1, False, 6), failure(Adaptation(6, 1, False, 6)))  # a divisor: the global batch stays whole
    assert (odd.micro_batch_size, odd.grad_accum_steps) == (3, 2)
    assert (next_plan(odd, failure(odd)).micro_batch_size, next_plan(odd, failure(odd)).grad_accum_steps) == (1, 6)
    evaluation = next_plan(Adaptation(8, 1, False, 8), failure(Adaptation(8, 1, False, 8), "evaluation"))
    assert evaluation == Adaptation(8, 1, False, 4, adaptations=1)  # the evaluation's micro-batch only


def test_the_fused_loss_fallback_is_taken_only_where_the_model_takes_it():
    assert fusable(to_config({}))  # the built-in model, objective=lm
    assert fusable(to_config({"objective": {"name": "dpo"}}))  # DPO's log-probs come from the fused layer too
    scaled = {"name": "custom", "kind": "custom", "_target_": "tests.test_fused_loss.scaled_logits", "seq_len": 64}
    assert not fusable(to_config({"model": scaled, "strategy": {"wrap": ["ToyBlock"]}}))  # logits x 2 after the layer


def test_a_restart_adapts_once_per_failure_says_it_once_and_keeps_a_checkpoints_plan(tmp_path):
    cfg = to_config({"train": {"micro_batch_size": 8, "max_adaptations": 2}, "eval": {"max_batches": 2}})
    first = Adaptation.of(cfg)
    append(tmp_path, failure(first, rank=0))
    append(tmp_path, failure(first, rank=1))  # two ranks out of memory in the same step: one adaptation
    plan, events = adapt(cfg, tmp_path, kept=None, world_size=1)
    assert plan == Adaptation(4, 2, False, 8, adaptations=1)
    assert [(e["event"], e["step"], e["what"], e["asked"]) for e in events] == [
        ("adapted", 3, "train.micro_batch_size 8 -> 4, train.grad_accum_steps 1 -> 2", 2 ** 20)]
    assert adapt(cfg, tmp_path, kept=None, world_size=1) == (plan, [])  # a restart for another cause: the same plan, said once
    append(tmp_path, failure(plan, "evaluation"))
    plan, events = adapt(cfg, tmp_path, kept=None, world_size=1)
    assert plan == Adaptation(4, 2, False, 4, adaptations=2) and events[0]["what"] == "eval.micro_batch_size 8 -> 4"
    applied = plan.applied(cfg)
    assert (applied.train.micro_batch_size, applied.train.grad_accum_steps, applied.eval.micro_batch_size,
            applied.eval.max_batches) == (4, 2, 4, 4)  # the same validation rows: twice the batches of half the rows
    append(tmp_path, failure(plan))
    with pytest.raises(RunError, match=r"rank 1 ran out of memory in the forward of step 3 at "
                                       r"train.micro_batch_size=4: .*train.max_adaptations=2 are used up"):
        adapt(cfg, tmp_path, kept=None, world_size=1)
    # a resume in another run dir keeps the checkpoint's plan; one of another global batch is not this run's
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    assert adapt(cfg, fresh, kept=asdict(Adaptation(2, 4, False, 8, 2)), world_size=1)[0] == Adaptation(2, 4, False, 8, 2)
    assert adapt(cfg, fresh, kept=asdict(Adaptation(2, 2, False, 8, 2)), world_size=1)[0] == first


def test_an_out_of_memory_of_either_allocator_is_recorded_with_the_bytes_asked(monkeypatch):
    oom_recorder = OomRecorder(Adaptation(8, 1, False, 8), rank=1, device=torch.device("cpu"), step=5)
    with pytest.raises(OutOfMemory) as caught:  # the host allocator's, for real: a RuntimeError in torch
        with oom_recorder.record_oom_in("backward", 8):
            torch.empty(1 << 62, dtype=torch.uint8)
    record = caught.value.failure
    assert (record["step"], record["where"], record["rank"], record["rows"], record["asked"]) == (
        5, "backward", 1, 8, 1 << 62)
    assert record["free"] > 0 and "DefaultCPUAllocator" in record["error"]
    assert asked_bytes("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB "
                       "of which 1.50 GiB is free.") == 2 * 2 ** 30
    with pytest.raises(RuntimeError, match="not memory"):  # anything else passes through as it is
        with oom_recorder.record_oom_in("forward", 8):
            raise RuntimeError("not memory")
    monkeypatch.setenv(TEST_SWITCH, "rank=1,rows=4,from_step=5")
    with oom_recorder.record_oom_in("forward", 3):  # fewer rows than the switch's
        pass
    with pytest.raises(OutOfMemory, match="Tried to allocate"):
        with oom_recorder.record_oom_in("forward", 4):
            pass
    oom_recorder.step = 4  # before from_step
    with oom_recorder.record_oom_in("forward", 8):
        pass


def said(stderr: str) -> list[str]:
    """The trainer's lines on stderr, without the progress bar drawn before them."""
    return [line[line.index("trainer: "):] for line in stderr.splitlines() if "trainer: " in line]


def test_on_oom_fail_stops_two_ranks_with_one_line_naming_the_step_the_bytes_and_the_change(tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli("nproc=2", "train.on_oom=fail", "train.max_steps=3", "data.num_workers=0",
                     f"hydra.run.dir={run_dir}", env={TEST_SWITCH: "rank=1,rows=2"}, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and said(result.stderr) == [
        "trainer: error: rank 1 ran out of memory in the forward of step 1 at train.micro_batch_size=8: it asked "
        f"for 8.0 MiB with {read_oom_records(run_dir)[0]['free'] / 2 ** 30:.2f} GiB free; try train.micro_batch_size=4 "
        "train.grad_accum_steps=2 (the same global batch and losses), or train.on_oom=adapt"], result.stderr[-3000:]
    assert [(r["event"], r["step"], r["rank"], r["asked"]) for r in read_oom_records(run_dir)] == [
        ("out_of_memory", 1, 1, 8 * 2 ** 20)]


STEPS = 5


def launch(run_dir: Path, launcher: str, strategy: str, *overrides: str, fault: str | None = None):
    args = [f"strategy={strategy}", f"train.max_steps={STEPS}", "train.log_every=1", "data.num_workers=0",
            "optim.warmup_steps=2", *overrides, f"hydra.run.dir={run_dir}"]
    env = {TEST_SWITCH: fault} if fault else {}
    if launcher == "torchrun":
        torchrun = str(Path(sys.executable).parent / "torchrun")
        return run_cli(*args, launcher=[torchrun, "--standalone", "--nproc_per_node", "2", "--max-restarts", "3",
                                        "-m", "trainer"], env=env)
    return run_cli("nproc=2", "max_restarts=3", *args, env=env)


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """Per strategy: the losses of 2 ranks started at micro-batch 1 with 8x accumulation."""
    done = {}

    def losses(strategy: str) -> list[float]:
        if strategy not in done:
            run_dir = tmp_path_factory.mktemp(f"planned-{strategy}")
            result = launch(run_dir, "nproc", strategy, "train.micro_batch_size=1", "train.grad_accum_steps=8")
            assert result.returncode == 0, result.stderr[-3000:]
            done[strategy] = [r["loss"] for r in records(run_dir)]
        return done[strategy]
    return losses


# Each strategy, launcher and checkpointing at least once; the other crossings with
# TRAINER_TEST_FULL_MATRIX=1 (tests/harness.py: crossings).
PROOFS = [("ddp", "nproc", 2), ("fsdp", "nproc", 0), ("zero3", "torchrun", 0),
          *([("fsdp", "torchrun", 2), ("zero3", "nproc", 2)] if FULL_MATRIX else [])]


@pytest.mark.slow  # 5 launches of 2 ranks each; the quick suite checks the ladder and the restart's plan in this process
@pytest.mark.parametrize("strategy, launcher, every", PROOFS)
def test_a_run_out_of_memory_adapts_8_4_2_1_and_has_the_losses_of_the_run_planned_at_micro_batch_1(
        tmp_path, planned, strategy, launcher, every):
    """Rank 1 runs out of memory from step 3 on at 2 rows or more: three restarts, each resuming from
    the checkpoint of step 2 (or from the start, without checkpoints) at half the micro-batch."""
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    saving = [f"checkpoint.dir={ckpt}", f"checkpoint.every_steps={every}"] if every else []
    result = launch(run_dir, launcher, strategy, "train.micro_batch_size=8", *saving,
                    fault="rank=1,rows=2,from_step=3")
    assert result.returncode == 0, result.stderr[-3000:]
    adapted = [e for e in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
               if e.get("event") == "adapted"]
    assert [(e["step"], e["what"]) for e in adapted] == [
        (3, "train.micro_batch_size 8 -> 4, train.grad_accum_steps 1 -> 2"),
        (3, "train.micro_batch_size 4 -> 2, train.grad_accum_steps 2 -> 4"),
        (3, "train.micro_batch_size 2 -> 1, train.grad_accum_steps 4 -> 8")]
    assert adapted[-1]["asked"] == 2 * 2 ** 20 and "rank 1 ran out of memory in the forward of step 3" in adapted[-1]["why"]
    assert "[trainer] adapted after out of memory: train.micro_batch_size 2 -> 1" in result.stdout
    losses = [r["loss"] for r in read_metrics(run_dir)]  # the steps trained again after a restart, once each
    expected = planned(strategy)
    assert len(losses) == len(expected) == STEPS
    assert all(abs(a - e) <= 1e-6 * abs(e) for a, e in zip(losses, expected)), (losses, expected)
    if every:  # the adapted plan is kept in the checkpoint: a resume from it starts at micro-batch 1
        manifest = json.loads((ckpt / f"step_{STEPS:08d}" / "manifest.json").read_text())
        assert manifest["trainer"]["plan"] == asdict(Adaptation(1, 8, False, 8, adaptations=3))


@pytest.mark.slow
def test_an_evaluation_out_of_memory_halves_the_evaluations_micro_batch_only(tmp_path):
    """One rank, restarted by the trainer's own launcher: the validation loss is that of the
    planned evaluation (the same rows), the training keeps its micro-batch."""
    run_dir = tmp_path / "run"
    common = ["train.max_steps=2", "train.log_every=1", "data.num_workers=0", "data.val_fraction=0.05",
              "eval.max_batches=2", "train.micro_batch_size=4"]
    result = run_cli("max_restarts=1", *common, f"hydra.run.dir={run_dir}",
                     env={TEST_SWITCH: "rank=0,rows=4,where=evaluation"})
    assert result.returncode == 0, result.stderr[-3000:]
    events = [e for e in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "event" in e]
    assert [e["what"] for e in events if e["event"] == "adapted"] == ["eval.micro_batch_size 4 -> 2"]
    assert "global_batch=4 (4 x 1 accumulation x 1 rank)" in result.stdout.split("adapted after out of memory")[-1]
    planned = tmp_path / "planned"
    reference = run_cli(*common, f"hydra.run.dir={planned}")
    assert reference.returncode == 0, reference.stderr[-3000:]
    val = [[r["loss"] for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines()) if r.get("split")]
           for d in (run_dir, planned)]
    assert len(val[0]) == 1 and abs(val[0][0] - val[1][0]) <= 1e-6 * val[1][0], val


# Address space: micro-batch 8 of this model fails under it, 2 fits; 4 failed with two threads per
# process and fits with the test suite's one (measured on this 2-core machine).
HOST_LIMIT = 1792 << 20
BIG_LOGITS = ["model.seq_len=512", "model.vocab_size=32768", "data=synthetic", "train.max_steps=2",
              "train.log_every=1", "data.num_workers=0"]  # 512 MiB of logits at micro-batch 8


@pytest.mark.slow
@pytest.mark.skipif(not shutil.which("prlimit"), reason="needs util-linux's prlimit")
def test_a_real_host_out_of_memory_under_an_address_space_limit_adapts_down_from_8_with_the_planned_losses(tmp_path):
    run_dir, planned = tmp_path / "run", tmp_path / "planned"
    limited = run_cli(*BIG_LOGITS, "max_restarts=3", "train.micro_batch_size=8", f"hydra.run.dir={run_dir}",
                      launcher=["prlimit", f"--as={HOST_LIMIT}", sys.executable, "-m", "trainer"])
    assert limited.returncode == 0, limited.stderr[-3000:]
    adapted = [r for r in read_oom_records(run_dir) if r["event"] == "adapted"]
    halvings = [r["plan"]["micro_batch_size"] for r in adapted]
    assert halvings and halvings == [4, 2, 1][:len(halvings)], read_oom_records(run_dir)  # where it fits depends on the host
    failures = [r for r in read_oom_records(run_dir) if r["event"] == "out_of_memory"]
    assert all("DefaultCPUAllocator" in r["error"] and r["asked"] for r in failures), failures
    reference = run_cli(*BIG_LOGITS, "train.micro_batch_size=8", f"hydra.run.dir={planned}")
    assert reference.returncode == 0, reference.stderr[-3000:]
    expected = [r["loss"] for r in records(planned)]
    # a step an attempt logged before a later step ran out of memory is logged again by the restart
    # (seen: step 1 fit at micro-batch 4, step 2 did not): the last attempt's losses
    last = {r["step"]: r["loss"] for r in records(run_dir)}
    assert all(abs(a - e) <= 1e-6 * e for a, e in zip([last[s] for s in sorted(last)], expected, strict=True))


def test_the_planner_reads_a_runs_records_and_plans_at_the_plan_it_adapted_to(tmp_path, capsys):
    from trainer import plan

    cfg = to_config({"train": {"micro_batch_size": 8}})
    append(tmp_path, failure(Adaptation.of(cfg)))
    adapt(cfg, tmp_path, kept=None, world_size=1)
    plan.main(["train.micro_batch_size=8", "plan.gpu_memory_gb=1", "plan.json=true", f"plan.run_dir={tmp_path}"])
    adapted = json.loads(capsys.readouterr().out)
    plan.main(["train.micro_batch_size=4", "train.grad_accum_steps=2", "plan.gpu_memory_gb=1", "plan.json=true"])
    planned_at_4 = json.loads(capsys.readouterr().out)
    assert adapted.pop("out_of_memory") == [
        f"{tmp_path}: rank 1 ran out of memory in the forward of step 3 at train.micro_batch_size=8: it asked for "
        "1.0 MiB with 0.0 MiB free",
        "it adapted to train.micro_batch_size=4 train.grad_accum_steps=2 train.activation_checkpointing=false "
        "eval.micro_batch_size=8: planned below at that plan"]
    assert planned_at_4.pop("out_of_memory") == [] and adapted == planned_at_4  # the activations of 4 rows, not 8
    with pytest.raises(SystemExit):
        plan.main([f"plan.run_dir={tmp_path / 'none'}"])
    assert "trainer.plan: error: plan.run_dir:" in capsys.readouterr().err
