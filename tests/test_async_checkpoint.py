"""checkpoint.async=true: the save's state is copied to host memory at its step and written, hashed
and published on a thread while training goes on. What these tests guarantee, on 2 real ranks:

- the same step dirs as a save in the step (each rank file byte for byte, the manifests but for the
  run dir) and the same losses, on ddp, fsdp and zero2; a resume from a checkpoint written so
  continues exactly (bitwise);
- the write really runs beside training: the step after the save runs a forward while the save's
  file is being written, on the writer's thread (with the save in the step it cannot: the test
  fails if the setting were ignored);
- a kill -9 during the background write leaves the previous checkpoint the newest (nothing of the
  step being written is published), and the resume from it is the run that never stopped;
- a failed background write is reported as a failed save (training goes on, the next save
  publishes), and one that stops the run says so in one line;
- the host copy's bytes (a rank's share of the state, fp32) are in the planner's host column and
  on the start line, with checkpoint.dir set.

The slow and failing writes come from tests/slow_save.py, a toy model whose factory wraps the
rank file's write in the rank that builds it.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.harness import (
    assert_close,
    assert_refused,
    assert_resumes,
    case,
    losses,
    on_ranks,
    records,
    resuming,
    run_cli,
    saving,
    train_cases,
    with_overrides,
)
from tests.test_faults import rank_processes, start, wait_for_step

STRATEGIES = ["ddp", "fsdp", "zero2"]
STEPS, EVERY = 6, 2


def toy(strategy: str, steps: int, **model) -> dict:
    """The toy model of tests/slow_save.py (its writes seen, slow or failing as `model` asks)."""
    cfg = with_overrides(case(strategy, steps=steps), data__name="synthetic", data__num_samples=256,
                         strategy__wrap=["ToyBlock"])
    cfg["model"] = {"name": "toy", "kind": "custom", "_target_": "tests.slow_save.build", "vocab": 64, "dim": 16,
                    "layers": 2, "vocab_size": 64, "seq_len": 32, **model}
    return cfg


def asynchronous(cfg: dict) -> dict:
    return with_overrides(cfg, checkpoint__async=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each strategy saved every 2 steps in the step (off) and in the background (on), then resumed
    from the background's step 4; and the toy model saved in the background and in the step, its
    writes recorded (last: the wrapped write stays in the ranks' processes)."""
    root = tmp_path_factory.mktemp("async")
    out = root / "runs"
    configs = {}
    for s in STRATEGIES:
        configs[f"{s}-off"] = saving(case(s, steps=STEPS), root / f"{s}-off", EVERY)
        configs[f"{s}-on"] = asynchronous(saving(case(s, steps=STEPS), root / f"{s}-on", EVERY))
        configs[f"{s}-resumed"] = asynchronous(saving(resuming(case(s, steps=STEPS), root / f"{s}-on", 4),
                                                      root / f"{s}-resumed", EVERY))
    configs["toy-on"] = asynchronous(saving(toy("fsdp", 4, record=str(root / "toy-on.jsonl"), overlap_steps=[2]),
                                            root / "toy-on", EVERY))
    configs["toy-off"] = saving(toy("fsdp", 4, record=str(root / "toy-off.jsonl")), root / "toy-off", EVERY)
    on_ranks(2, train_cases, configs, str(out))
    return root, out


def step_dirs(ckpt: Path) -> dict[str, dict]:
    """Each step dir's manifest (without the run dir, which differs between runs) and its rank files' bytes."""
    out = {}
    for step_dir in sorted(ckpt.glob("step_*")):
        manifest = json.loads((step_dir / "manifest.json").read_text())
        manifest["trainer"].pop("run_dir")
        out[step_dir.name] = {"manifest": manifest, **{f.name: f.read_bytes() for f in step_dir.glob("rank_*")}}
    return out


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_async_saves_write_the_same_step_dirs_and_losses_and_resume_exactly(runs, strategy):
    root, out = runs
    off, on = step_dirs(root / f"{strategy}-off"), step_dirs(root / f"{strategy}-on")
    assert list(on) == [f"step_{s:08d}" for s in range(EVERY, STEPS + 1, EVERY)]
    assert on == off, "the same files, byte for byte"
    assert (root / f"{strategy}-on" / "latest").read_text().strip() == f"step_{STEPS:08d}"
    assert not list((root / f"{strategy}-on").glob(".tmp-*")), "nothing left half-written"
    assert_close(losses(records(out / f"{strategy}-on")), losses(records(out / f"{strategy}-off")), strategy, rtol=0)
    assert_resumes(records(out / f"{strategy}-resumed"), records(out / f"{strategy}-on"), at=4, what=strategy)


def test_the_step_after_an_async_save_runs_while_its_file_is_written(runs):
    root, _ = runs
    writes = [json.loads(line) for line in (root / "toy-on.jsonl").read_text().splitlines()]
    assert sorted((w["step"], w["rank"]) for w in writes) == [(2, 0), (2, 1), (4, 0), (4, 1)]
    for w in writes:
        assert w["thread"] == "checkpoint-writer", w
        if w["step"] == 2:  # step 3's forward ran while step 2's file was being written
            assert w["forwards_after"] > w["forwards_before"], w
    in_the_step = [json.loads(line) for line in (root / "toy-off.jsonl").read_text().splitlines()]
    assert {w["thread"] for w in in_the_step} == {"MainThread"}
    assert all(w["forwards_after"] == w["forwards_before"] for w in in_the_step)
    assert step_dirs(root / "toy-on").keys() == step_dirs(root / "toy-off").keys() == {"step_00000002",
                                                                                        "step_00000004"}


def toy_args(tmp_path: Path, *model: str) -> list[str]:
    return ["nproc=2", "strategy=fsdp", "model=custom", "model._target_=tests.slow_save.build", "+model.vocab=64",
            "+model.dim=16", "model.vocab_size=64", "model.seq_len=32", "strategy.wrap=[ToyBlock]",
            "data=synthetic", "data.num_samples=256", "data.num_workers=0", "train.micro_batch_size=4",
            "train.max_steps=8", "train.log_every=1", f"checkpoint.dir={tmp_path / 'ckpt'}",
            f"checkpoint.every_steps={EVERY}", "checkpoint.keep_last=0", *model]


@pytest.mark.slow
def test_a_kill_during_the_background_write_leaves_the_previous_checkpoint_newest_and_resumes_exactly(tmp_path):
    reference = run_cli(*toy_args(tmp_path / "reference"), f"hydra.run.dir={tmp_path / 'reference'}")
    assert reference.returncode == 0, reference.stderr[-3000:]
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    process = start(run_dir, *toy_args(tmp_path, "checkpoint.async=true", "+model.hold_step=4"))
    wait_for_step(run_dir, 5, process)  # trained on while step 4's files are being written
    for rank in rank_processes(process):
        rank.kill()  # SIGKILL, mid-write
    process.communicate(timeout=300)
    assert process.returncode != 0
    assert (ckpt / "latest").read_text().strip() == "step_00000002"
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_00000002"]
    resumed = run_cli(*toy_args(tmp_path, "checkpoint.async=true"), f"hydra.run.dir={run_dir}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {ckpt}/step_00000002" in resumed.stdout, resumed.stdout[-3000:]
    assert_resumes([r for r in records(run_dir) if r["step"] > 2][-6:], records(tmp_path / "reference"), at=2)
    assert (ckpt / "latest").read_text().strip() == "step_00000008"


@pytest.mark.slow
def test_a_failed_background_write_is_a_failed_save_and_one_that_stops_the_run_says_so_in_one_line(tmp_path):
    cfg = asynchronous(saving(toy("fsdp", STEPS, fail_step=4), tmp_path / "ckpt", EVERY))
    on_ranks(2, train_cases, {"goes_on": cfg}, str(tmp_path))
    failed = [json.loads(line) for line in (tmp_path / "goes_on" / "metrics.jsonl").read_text().splitlines()
              if '"save_failed"' in line]
    assert [e["step"] for e in failed] == [4] and "rank 1: OSError: disk full (injected)" in failed[0]["error"]
    assert records(tmp_path / "goes_on")[-1]["step"] == STEPS  # trained on
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*")) == ["step_00000002", "step_00000006"]

    stops = run_cli(*toy_args(tmp_path / "stops", "checkpoint.async=true", "+model.fail_step=2",
                              "checkpoint.max_failed_saves=1"), f"hydra.run.dir={tmp_path / 'stops'}")
    assert_refused(stops, "checkpoint: saving step 2 failed (1 in a row)", "rank 1: OSError: disk full (injected)",
                   "checkpoint.max_failed_saves=1")


def test_the_host_copy_is_counted_by_the_planner_and_said_on_the_start_line():
    from trainer.config import to_config
    from trainer.memory import async_save_bytes
    from trainer.models import model_facts
    from trainer.plan import make_plan
    from trainer.training.report import save_words

    def plan(**checkpoint):
        return make_plan(to_config({"model": {"name": "small"}, "checkpoint": checkpoint}), 4, 80 * 10 ** 9)

    cfg = to_config({"model": {"name": "small"}})
    facts = model_facts(cfg.model, cfg.strategy.wrap, cfg.peft)
    copy = async_save_bytes(facts.trainable, facts.params - facts.trainable, 4)
    assert copy == 12 * facts.params // 4  # a rank's share of weights and two moments, fp32
    without, saved, with_copy = plan(), plan(dir="ckpt"), plan(dir="ckpt", **{"async": True})
    assert [o.host_bytes for o in saved.options] == [o.host_bytes for o in without.options]
    assert [o.host_bytes - copy for o in with_copy.options] == [o.host_bytes for o in without.options]
    on = to_config({"model": {"name": "small"}, "checkpoint": {"dir": "ckpt", "async": True}})
    assert save_words(on, facts, 4) == [f"checkpoint.async=on (+{copy / 2 ** 20:.1f} MiB host memory a rank)"]
    assert save_words(cfg, facts, 4) == []
