"""One run writes a checkpoint dir at a time; a resume on other data starts them at their
beginning; the resume notes show what changed, in enough digits (issue 29)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness import (
    CPU_ONLY,
    REPO,
    assert_refused,
    case,
    on_ranks,
    records,
    run_cli,
    saving,
    train_cases,
    with_overrides,
)
from trainer.checkpoint.resume import WRITER_LOCK, hold_checkpoint_dir
from trainer.config import to_config
from trainer.errors import CheckpointError
from trainer.training.resume_notes import resume_notes

HOLD = ("import sys, time; from pathlib import Path; from trainer.checkpoint.resume import hold_checkpoint_dir; "
        "held = hold_checkpoint_dir(Path(sys.argv[1])); print('held', flush=True); time.sleep(float(sys.argv[2]))")


def holder(ckpt: Path, seconds: float) -> subprocess.Popen:
    """Another process that holds `ckpt` for `seconds`, once it has said so."""
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(ckpt), str(seconds)], cwd=REPO, text=True,
                               stdout=subprocess.PIPE, env={**os.environ, **CPU_ONLY})
    assert process.stdout.readline().strip() == "held"
    return process


def wait_for_lock(ckpt: Path, timeout_s: float = 120) -> dict:
    """What the run that took `ckpt` wrote in its lock file (its host and pid), once it has."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = (ckpt / WRITER_LOCK).read_text() if (ckpt / WRITER_LOCK).is_file() else ""
        if text:
            return json.loads(text)
        time.sleep(0.2)
    raise AssertionError(f"no run took {ckpt}")


def test_a_second_run_on_a_checkpoint_dir_in_use_is_refused_naming_the_holder_and_a_dead_one_holds_nothing(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = subprocess.Popen([sys.executable, "-m", "trainer", "train.max_steps=100000", "data=synthetic",
                              "model=tiny", "data.num_workers=0", f"checkpoint.dir={ckpt}",
                              f"hydra.run.dir={tmp_path / 'first'}"], cwd=REPO, env={**os.environ, **CPU_ONLY},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        held_by = wait_for_lock(ckpt)
        assert (held_by["host"], held_by["pid"]) == (socket.gethostname(), first.pid)  # the launching process
        second = run_cli("nproc=2", "train.max_steps=4", f"checkpoint.dir={ckpt}", f"hydra.run.dir={tmp_path / 'second'}")
        assert_refused(second, f"checkpoint.dir={ckpt} is in use by another run (host {socket.gethostname()}, "
                               f"pid {first.pid}, since ")
        assert not (tmp_path / "second").exists()  # refused before any rank started
        assert first.poll() is None  # ... and the first run goes on
    finally:
        first.kill()
        first.wait()
    held = hold_checkpoint_dir(ckpt)  # the kernel let go of the dead run's lock
    held.close()


def test_a_restart_waits_for_its_old_process_to_go_and_another_run_is_refused_at_once(tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    old = holder(ckpt, 3)
    started = time.monotonic()
    with pytest.raises(CheckpointError, match=f"in use by another run .host {socket.gethostname()}, pid {old.pid},"):
        hold_checkpoint_dir(ckpt)
    assert time.monotonic() - started < 2  # not waited for
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a restart of the same job: its old rank 0 is leaving
    held = hold_checkpoint_dir(ckpt)
    assert time.monotonic() - started > 2 and old.wait(timeout=10) == 0  # taken once the old one ended
    assert json.loads((ckpt / WRITER_LOCK).read_text())["pid"] == os.getpid()
    held.close()


@pytest.mark.slow
def test_a_resume_on_other_data_says_so_and_starts_them_at_their_beginning(tmp_path):
    # 8 steps an epoch of synthetic data: step 10 is 8 samples into epoch 1
    synthetic = case("ddp", steps=10, data__name="synthetic", data__num_samples=32)
    ckpt = tmp_path / "ckpt"
    on_ranks(1, train_cases, {"synthetic": saving(synthetic, ckpt, 10)}, str(tmp_path))
    text = with_overrides(synthetic, data__name="text", train__max_steps=12,
                          checkpoint__resume=str(ckpt / "step_00000010"))
    on_ranks(1, train_cases, {"text": text}, str(tmp_path))
    steps = [r for r in records(tmp_path / "text") if "loss" in r]
    assert [(r["step"], r["epoch"]) for r in steps] == [(11, 0), (12, 0)]  # not epoch 1, 8 samples in
    log = (tmp_path / "text" / "trainer.log").read_text()
    assert "resume: the checkpoint was trained on other data (data.name=synthetic, now text): this run starts its " \
           "data at their beginning, not at the checkpoint's position (epoch 1, 8 samples in)" in log
    assert "schedule and data position" not in log


def test_the_resume_note_on_a_schedule_change_shows_the_learning_rates_apart_or_none(tmp_path):
    cfg = to_config({"optim": {"lr": 3e-3, "warmup_steps": 10}, "checkpoint": {"dir": str(tmp_path)}})
    state = {"step": 6, "global_batch": 8, "schedule_steps": 1000, "run_dir": str(tmp_path),
             "data": {"epoch": 0, "samples_consumed": 48}}
    inside_warmup, = resume_notes(state, cfg, 8, 1001, tmp_path)
    assert inside_warmup == ("the learning-rate schedule now ends at step 1001, not 1000: "
                             "optim.schedule_steps=1000 keeps the old end")
    after_warmup, = resume_notes({**state, "step": 40}, cfg, 8, 1001, tmp_path)
    assert "step 41 trains at 0.00299389 instead of 0.00299387; " in after_warmup, after_warmup
