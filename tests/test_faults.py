"""Faults injected into real runs (a signal, a NaN, a save that fails, a
damaged manifest), the outcome checked on disk and in metrics.jsonl. A stop signal saves and exits
with its code (ctrl-c as SIGTERM does), at any point of a step: at the last step the run ends as
planned, during an evaluation and save it stops right after them."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from tests.harness import (
    CPU_ONLY,
    REPO,
    assert_refused,
    assert_resumes,
    case,
    mlflow_runs,
    on_ranks,
    records,
    refusal,
    run_cli,
    train_cases,
    with_overrides,
)
from trainer.checkpoint.resume import resolve_resume
from trainer.config import CheckpointConfig

STEPS = 40  # long enough that a signal sent at step 3 lands well before the end


def events(run_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "event" in r]


def start(run_dir: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "trainer", *overrides, f"hydra.run.dir={run_dir}"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **CPU_ONLY})


def wait_for_step(run_dir: Path, step: int, process: subprocess.Popen) -> None:
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        if metrics.exists() and any(r["step"] >= step for r in records(run_dir)):
            return
        time.sleep(0.05)
    raise AssertionError(f"no step {step} in {metrics}: {process.communicate()}")


def rank_processes(launcher: subprocess.Popen) -> list[psutil.Process]:
    """The rank processes an elastic launcher (nproc=N, torchrun) started, by the title each gives itself
    (`distributed.init`): nproc=N forks them from its rank server, torchrun spawns them."""
    return sorted((child for child in psutil.Process(launcher.pid).children(recursive=True)
                   if " ".join(child.cmdline()).startswith("trainer rank")), key=lambda p: p.pid)


ARGS = ("strategy=fsdp", f"train.max_steps={STEPS}", "train.log_every=1", "data.num_workers=0")


def reference_losses(run_dir: Path) -> list[dict]:
    """The records of a 2-rank run that nothing stops: what every interrupted run must reproduce."""
    done = run_cli("nproc=2", *ARGS, f"hydra.run.dir={run_dir}")
    assert done.returncode == 0, done.stderr[-3000:]
    return records(run_dir)


def steps_after(run_dir: Path, step: int) -> list[dict]:
    """The records of the steps after `step` in a run dir that a stopped run and its resume share."""
    return [r for r in records(run_dir) if r["step"] > step]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    return reference_losses(tmp_path_factory.mktemp("reference"))


def test_a_stop_signal_to_one_rank_stops_every_rank_with_a_checkpoint_and_resuming_is_the_run_that_never_stopped(
        tmp_path, reference):
    args = ("nproc=2", *ARGS)

    run_dir, ckpt = tmp_path / "stopped", tmp_path / "ckpt"
    stopped = start(run_dir, *args, f"checkpoint.dir={ckpt}")
    wait_for_step(run_dir, 3, stopped)
    ranks = rank_processes(stopped)
    assert len(ranks) == 2
    ranks[-1].send_signal(signal.SIGTERM)
    _, stderr = stopped.communicate(timeout=300)
    assert stopped.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    preempted = events(run_dir)[-1]
    stop_step = preempted["step"]
    assert preempted == {"event": "preempted", "step": stop_step, "signal": "SIGTERM",
                         "checkpoint": str(ckpt / f"step_{stop_step:08d}")}
    assert 3 <= stop_step < STEPS and (ckpt / "latest").read_text().strip() == f"step_{stop_step:08d}"

    resumed = run_cli(*args, f"checkpoint.dir={ckpt}", f"hydra.run.dir={run_dir}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_resumes(steps_after(run_dir, stop_step), reference, at=stop_step)  # bitwise


@pytest.mark.slow
def test_sigterm_to_the_launcher_of_zero3_ranks_saves_and_exits_without_a_traceback(tmp_path):
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    launcher = start(run_dir, "nproc=2", "strategy=zero3", f"train.max_steps={STEPS}", "train.log_every=1",
                     "data.num_workers=0", f"checkpoint.dir={ckpt}")
    wait_for_step(run_dir, 2, launcher)
    launcher.send_signal(signal.SIGTERM)
    stdout, stderr = launcher.communicate(timeout=300)
    assert launcher.returncode == 143, stderr[-3000:]
    assert "Traceback" not in stderr and "SignalException" not in stderr, stderr[-3000:]
    assert "Closing process" not in stderr and "leaked semaphore" not in stderr, stderr[-3000:]
    preempted = events(run_dir)[-1]
    assert preempted["event"] == "preempted" and preempted["signal"] == "SIGTERM"
    assert (Path(preempted["checkpoint"]) / "manifest.json").is_file()
    # where the ranks stopped and what they saved, said once (rank 0's line); the launcher adds the exit code
    stop = (f"SIGTERM: all ranks stopped after step {preempted['step']}; saved {preempted['checkpoint']}: the same "
            "command resumes from it")
    assert (stdout + stderr).count(f"after step {preempted['step']}") == 1, stdout[-3000:] + stderr[-3000:]
    assert f"[trainer] {stop}" in stdout.splitlines(), stdout[-3000:]
    assert stderr.strip().splitlines()[-1] == "trainer: stopped by a signal; exit code 143"


@pytest.mark.slow
def test_sigusr1_to_a_single_process_run_saves_exits_with_138_and_closes_its_mlflow_run_as_killed(tmp_path):
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    process = start(run_dir, f"train.max_steps={STEPS}", "train.log_every=1", "data.num_workers=0",
                    f"checkpoint.dir={ckpt}", "logger=[jsonl,mlflow]")
    wait_for_step(run_dir, 2, process)
    process.send_signal(signal.SIGUSR1)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 128 + signal.SIGUSR1, stderr[-3000:]
    preempted = events(run_dir)[-1]
    assert preempted["signal"] == "SIGUSR1" and (Path(preempted["checkpoint"]) / "manifest.json").is_file()
    _, [stopped] = mlflow_runs(run_dir)
    assert stopped.info.status == "KILLED"


def faulty_case(strategy: str, nan_steps: list[int], **overrides) -> dict:
    """The toy model of examples/, with NaN logits on rank 1 at `nan_steps`, on synthetic data."""
    cfg = with_overrides(case(strategy, steps=5), data__name="synthetic", data__num_samples=256,
                         strategy__wrap=["ToyBlock"], **overrides)
    cfg["model"] = {"name": "faulty", "kind": "custom", "_target_": "tests.faulty.build", "vocab": 64, "dim": 16,
                    "layers": 2, "nan_steps": nan_steps, "rank": 1, "vocab_size": 64, "seq_len": 32}
    return cfg


@pytest.mark.slow  # make test stays under 8 minutes: the rest of what it covers is in the quick suite
def test_a_non_finite_step_on_one_rank_is_skipped_on_every_rank_and_never_saved(tmp_path):
    configs = {name: faulty_case(name, [3], checkpoint__dir=str(tmp_path / name / "ckpt"))
               for name in ("fsdp", "zero2", "zero3")}
    on_ranks(2, train_cases, configs, str(tmp_path))
    after = {}
    for name in configs:
        steps = records(tmp_path / name)
        assert [r["skipped"] for r in steps] == [0, 0, 1, 1, 1], name
        assert steps[2]["loss"] != steps[2]["loss"], name  # NaN: recorded as it was
        assert all(r["loss"] == r["loss"] and r["grad_norm"] < 1e3 for r in steps[3:]), name
        after[name] = [r["loss"] for r in steps[3:]]
        saved = {}
        for file in (tmp_path / name / "ckpt" / "step_00000005").glob("rank_*.safetensors"):
            saved |= load_file(file)
        assert saved and all(t.isfinite().all() for t in saved.values()), name
    # Skipped alike everywhere: the steps after it agree across backends.
    assert after["zero2"] == pytest.approx(after["fsdp"], rel=1e-5)
    assert after["zero3"] == pytest.approx(after["fsdp"], rel=1e-5)


@pytest.mark.slow
def test_the_fp16_loss_scale_is_saved_and_restored_under_another_backend(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = faulty_case("fsdp", [2], train__precision="fp16", train__max_steps=3, checkpoint__dir=str(ckpt))
    on_ranks(2, train_cases, {"first": first}, str(tmp_path))

    def loss_scale(step: int) -> dict:
        return json.loads((ckpt / f"step_{step:08d}" / "manifest.json").read_text())["trainer"]["loss_scale"]

    assert loss_scale(3) == {"scale": 2.0 ** 15, "good_steps": 1}  # halved by the NaN of step 2
    resumed = with_overrides(first, strategy__name="ddp", train__max_steps=4)
    on_ranks(2, train_cases, {"resumed": resumed}, str(tmp_path))
    assert loss_scale(4) == {"scale": 2.0 ** 15, "good_steps": 2}


def deepspeed_loss_scale_resumes(env, overflows: list[bool]) -> list[int]:
    """DeepSpeed's own DynamicLossScaler (as its fp16 optimizers hold it; no fp16 on CPU to run
    them) through the strategy's save and load, cut after each step: the cuts where the scale
    that follows differs from the scaler that was never cut."""
    import deepspeed
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    from trainer.strategies.deepspeed import DeepSpeedLossScale

    deepspeed.init_distributed(dist_backend="gloo")

    def fresh() -> DynamicLossScaler:  # DeepSpeed's defaults but a short window
        return DynamicLossScaler(init_scale=2 ** 16, scale_window=4, min_scale=1, delayed_shift=2,
                                 consecutive_hysteresis=False, dtype=torch.half)


    def scales(scaler: DynamicLossScaler, steps: list[bool]) -> list[float]:
        return [scaler.update_scale(overflow) or scaler.cur_scale for overflow in steps]

    never_cut = scales(fresh(), overflows)
    assert len(set(never_cut)) > 2  # it backed off and grew
    wrong = []
    for cut in range(1, len(overflows)):
        before = fresh()
        scales(before, overflows[:cut])
        after = fresh()
        DeepSpeedLossScale(after).load(json.loads(json.dumps(DeepSpeedLossScale(before).state())))
        if scales(after, overflows[cut:]) != never_cut[cut:]:
            wrong.append(cut)
    return wrong


def test_deepspeeds_fp16_loss_scale_resumes_exactly():
    overflows = [bool(int(c)) for c in "001000001100000000010000"]
    assert on_ranks(1, deepspeed_loss_scale_resumes, overflows)[0] == []


@pytest.mark.slow
def test_max_bad_steps_in_a_row_stop_the_run_naming_the_step(tmp_path):
    result = run_cli("model=custom", "model._target_=tests.faulty.build", "+model.nan_steps=[2,3,4,5]",
                     "+model.rank=0", "strategy.wrap=[ToyBlock]", "train.max_bad_steps=3", "train.max_steps=8",
                     "data.num_workers=0", f"hydra.run.dir={tmp_path}")
    assert assert_refused(result) == (
        "trainer: error: step 4: 3 steps in a row with a non-finite loss or gradient norm (train.max_bad_steps=3); "
        "no update was made from any of them. Lower optim.lr, check the data, or resume from a checkpoint")


@pytest.mark.slow
def test_a_failed_save_keeps_the_previous_checkpoint_and_training_goes_on_until_too_many_fail(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / ".tmp-step_00000004").write_text("a file where the save wants its dir")  # rank 0's mkdir fails
    cfg = with_overrides(case("fsdp", steps=6), checkpoint__dir=str(ckpt), checkpoint__every_steps=2)
    on_ranks(2, train_cases, {"goes_on": cfg}, str(tmp_path))
    failed = [e for e in events(tmp_path / "goes_on") if e["event"] == "save_failed"]
    assert [e["step"] for e in failed] == [4] and "rank 0: FileExistsError" in failed[0]["error"]
    assert records(tmp_path / "goes_on")[-1]["step"] == 6  # trained on
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_00000002", "step_00000006"]
    assert (ckpt / "latest").read_text().strip() == "step_00000006"

    # A rank that cannot read its part of a checkpoint stops every rank (none waits for it). With
    # checksums a missing file is found before any rank starts (tests/test_checksums.py); a checkpoint
    # from before them (no checksums in its manifest) is read unverified, and its ranks find it.
    (ckpt / "step_00000006" / "rank_00001.safetensors").unlink()
    manifest = json.loads((ckpt / "step_00000006" / "manifest.json").read_text())
    manifest.pop("checksums")
    (ckpt / "step_00000006" / "manifest.json").write_text(json.dumps(manifest))
    unreadable = run_cli("nproc=2", "strategy=fsdp", "train.max_steps=8", "train.micro_batch_size=4",
                         "data.num_workers=0", f"checkpoint.dir={ckpt}", f"hydra.run.dir={tmp_path / 'unreadable'}",
                         timeout=300)
    assert_refused(unreadable, "trainer: error: checkpoint: cannot read", "rank 1: ")

    ckpt2 = tmp_path / "ckpt2"
    ckpt2.mkdir()
    for step in (2, 4):
        (ckpt2 / f".tmp-step_{step:08d}").write_text("blocked")
    result = run_cli("train.max_steps=6", "checkpoint.every_steps=2", "checkpoint.max_failed_saves=2",
                     f"checkpoint.dir={ckpt2}", "data.num_workers=0", f"hydra.run.dir={tmp_path / 'stops'}")
    assert_refused(result, "saving step 4 failed (2 in a row)", "checkpoint.max_failed_saves=2")
    assert not list(ckpt2.glob("step_*")) and not (ckpt2 / "latest").exists()


@pytest.mark.slow
def test_auto_resume_skips_a_damaged_manifest_and_a_resume_from_an_older_step_keeps_what_it_came_from(tmp_path):
    ckpt = tmp_path / "ckpt"
    cfg = with_overrides(case("ddp", steps=6), checkpoint__dir=str(ckpt), checkpoint__every_steps=2,
                         checkpoint__keep_last=2)
    on_ranks(1, train_cases, {"first": cfg}, str(tmp_path))
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_00000004", "step_00000006"]
    manifest = ckpt / "step_00000006" / "manifest.json"
    whole = manifest.read_text()
    manifest.write_text(whole[:100])  # a disk that filled up mid-write
    assert resolve_resume(CheckpointConfig(dir=str(ckpt))) == ckpt / "step_00000004"
    manifest.write_text(whole)

    resumed = with_overrides(cfg, train__max_steps=8, checkpoint__every_steps=1, checkpoint__keep_last=1,
                             checkpoint__resume=str(ckpt / "step_00000004"))
    on_ranks(1, train_cases, {"older": resumed}, str(tmp_path))
    # Resumed from 4 on purpose: its saves 5..8 pruned to the newest (keep_last=1), 4 kept (where
    # it came from), and 6, of the history it left, set aside rather than deleted.
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == [
        "step_00000004", "step_00000008", "superseded-step_00000006"]
    assert (ckpt / "latest").read_text().strip() == "step_00000008"


@pytest.mark.parametrize("overrides, message", [
    (["optim.lr=-1"], "optim.lr: must be >= 0, got -1.0"),
    (["optim.warmup_steps=-2"], "optim.warmup_steps: must be >= 0, got -2"),
    (["optim.min_lr_ratio=1.5"], "optim.min_lr_ratio: must be in [0, 1], got 1.5"),
    (["checkpoint.every_steps=-1"], "checkpoint.every_steps: must be >= 0 (0: the last step only), got -1"),
    (["checkpoint.keep_last=-1"], "checkpoint.keep_last: must be >= 0 (0: keep all), got -1"),
    (["model.n_heads=0"], "model.n_heads: must be >= 1, got 0"),
    (["data=tokens"], "data.path: data=tokens needs a file of uint16 token ids, e.g. data.path=train.bin"),
    (["data=synthetic", "data.num_samples=3"], "exceeds the 3 samples of one epoch: the data set is too small"),
    (["checkpoint.dir=/proc/trainer"], "checkpoint.dir=/proc/trainer: cannot write there"),
    (["train.max_bad_steps=0"], "train.max_bad_steps: must be >= 1, got 0"),
    (["strategy=zero2", "strategy.deepspeed_config=DS_OFFLOAD"],
     "zero_optimization.offload_optimizer turns offload on, strategy.offload_optimizer=false turns it off"),
])
def test_bad_settings_are_refused_before_any_rank_starts(tmp_path, overrides, message):
    ds_offload = tmp_path / "ds.json"
    ds_offload.write_text(json.dumps({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}))
    overrides = [o.replace("DS_OFFLOAD", str(ds_offload)) for o in overrides]
    assert message in refusal(tmp_path / "run", *overrides)


def test_hybrid_shard_needs_a_world_size_that_is_a_multiple_of_the_node_size(tmp_path, monkeypatch):
    for key, value in {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "2"}.items():  # a launcher's rank 0
        monkeypatch.setenv(key, value)
    assert "the world size 3 must be a multiple of 2" in refusal(
        tmp_path / "run", "strategy=fsdp", "strategy.sharding=HYBRID_SHARD", "nproc=3")


def start_restartable(run_dir: Path, launcher: str, *overrides: str) -> subprocess.Popen:
    """2 ranks that are restarted twice at most, by the trainer's own launcher (nproc) or torchrun."""
    if launcher == "nproc":
        return start(run_dir, "nproc=2", "max_restarts=2", "shutdown_timeout_s=10", *overrides)
    torchrun = Path(sys.executable).parent / "torchrun"
    return subprocess.Popen([str(torchrun), "--standalone", "--nproc_per_node", "2", "--max-restarts", "2",
                             "-m", "trainer", *overrides, f"hydra.run.dir={run_dir}"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **CPU_ONLY})


def kill_a_rank_after_step(run_dir: Path, launcher: subprocess.Popen, step: int) -> None:
    wait_for_step(run_dir, step, launcher)
    ranks = rank_processes(launcher)
    assert len(ranks) == 2, ranks
    ranks[-1].kill()  # SIGKILL: no handler, no save


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["nproc", "torchrun"])
def test_a_rank_killed_mid_run_is_restarted_and_the_group_resumes_with_the_losses_of_a_run_never_killed(
        tmp_path, reference, launcher):
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    process = start_restartable(run_dir, launcher, *ARGS, "checkpoint.every_steps=3", f"checkpoint.dir={ckpt}")
    kill_a_rank_after_step(run_dir, process, 7)
    stdout, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-3000:]
    if launcher == "nproc":  # the launcher names the rank; torchrun's own agent says nothing of it
        assert "trainer: rank 1 (pid " in stderr and f"was killed by SIGKILL; restart 1 of 2, resuming from the " \
            f"newest checkpoint in {ckpt}" in stderr, stderr[-3000:]
    restarted = [e for e in events(run_dir) if e["event"] in ("restarted", "resumed")]
    resumed_at = restarted[-1]["step"]  # the newest checkpoint when the rank died, at step 7 or later
    assert restarted[0]["event"] == "restarted" and resumed_at % 3 == 0 and 6 <= resumed_at < STEPS
    assert f"[trainer] restart 1: resumed from {ckpt}/step_{resumed_at:08d} at step {resumed_at}" in stdout
    from trainer.metrics import read_records  # the steps trained twice, once each

    assert [r["step"] for r in read_records(run_dir)] == list(range(1, STEPS + 1))
    assert_resumes(records(run_dir)[-(STEPS - resumed_at):], reference, at=resumed_at)  # bitwise
    assert events(run_dir)[-1]["event"] == "end"


@pytest.mark.slow
def test_without_restarts_a_killed_rank_ends_the_job_naming_the_rank(tmp_path):
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    process = start(run_dir, "nproc=2", *ARGS, "checkpoint.every_steps=3", f"checkpoint.dir={ckpt}")
    kill_a_rank_after_step(run_dir, process, 4)  # step 4's record follows step 3's save
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 1, stderr[-3000:]
    assert "trainer: error: rank 1 (pid" in stderr and "was killed by SIGKILL" in stderr, stderr[-3000:]
    assert f"resumes from the newest checkpoint in {ckpt}" in stderr and "Traceback" not in stderr
    assert "end" not in {e["event"] for e in events(run_dir)}
    assert resolve_resume(CheckpointConfig(dir=str(ckpt))) is not None  # what the same command resumes from


@pytest.mark.slow
def test_a_hung_rank_ends_the_job_after_the_collective_timeout(tmp_path):
    run_dir = tmp_path / "run"
    process = start(run_dir, "nproc=2", *ARGS, "collective_timeout_s=5")
    wait_for_step(run_dir, 3, process)
    waiting, hung = rank_processes(process)
    hung.suspend()  # SIGSTOP: alive, never answers
    waiting.wait(timeout=120)  # its next collective fails after collective_timeout_s
    # Freed now, the hung rank meets the SIGTERM torch's launcher sent it and fails its collective
    # with the rank that left; one that never wakes is killed 30 s later (SIGKILL; seen: 38 s in all).
    hung.resume()
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 1, stderr[-3000:]
    assert "Timed out waiting 5000ms" in stderr and "trainer: error: rank 0 (pid" in stderr, stderr[-3000:]


FAKE_SLURM = {  # what launch/slurm.sbatch calls of SLURM, on one node: srun runs its command here
    "srun": '#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n',
    "scontrol": '#!/bin/bash\ncase "$1" in\n  show) echo localhost ;;\n  requeue) echo "$2" >> "$REQUEUED" ;;\n'
                'esac\n',
}


@pytest.mark.slow
def test_the_sbatch_script_passes_the_time_limit_warning_on_requeues_and_the_requeued_job_resumes(
        tmp_path, reference):
    """The documented command as it stands (no checkpoint.dir, the script's own run dir), submitted
    from the job's working dir; SLURM runs a requeued job with the same job id and command line,
    and SLURM_RESTART_COUNT=1."""
    bin_dir, work = tmp_path / "bin", tmp_path / "work"
    bin_dir.mkdir()
    work.mkdir()
    for name, text in FAKE_SLURM.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    job_id = next(i for i in range(1000) if port_is_free(29500 + i))  # the script's MASTER_PORT
    run_dir = work / "outputs" / f"slurm-{job_id}"
    env = {**os.environ, **CPU_ONLY, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "SLURM_JOB_ID": str(job_id), "SLURM_JOB_NODELIST": "localhost", "SLURM_NNODES": "1",
           "SLURM_GPUS_ON_NODE": "2", "REQUEUED": str(tmp_path / "requeued")}
    env.pop("TRAINER_RUN_DIR", None)

    def submit(**slurm) -> subprocess.Popen:  # the same command line both times, as a requeued job has
        return subprocess.Popen(["bash", str(REPO / "launch" / "slurm.sbatch"), *ARGS], cwd=work,
                                env={**env, **slurm}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    job = submit()
    wait_for_step(run_dir, 3, job)
    job.send_signal(signal.SIGUSR1)  # SLURM's `--signal=B:USR1@300`: to the batch script
    _, stderr = job.communicate(timeout=300)
    assert job.returncode == 128 + signal.SIGUSR1, stderr[-3000:]
    assert (tmp_path / "requeued").read_text().split() == [str(job_id)]
    stop_step = events(run_dir)[-1]["step"]
    assert events(run_dir)[-1]["event"] == "preempted" and 3 <= stop_step < STEPS
    assert (work / events(run_dir)[-1]["checkpoint"]).parent == run_dir / "checkpoints"  # the job's own

    requeued = submit(SLURM_RESTART_COUNT="1")
    _, stderr = requeued.communicate(timeout=600)
    assert requeued.returncode == 0, stderr[-3000:]
    assert (tmp_path / "requeued").read_text().split() == [str(job_id)]  # not again: it finished
    assert_resumes(steps_after(run_dir, stop_step), reference, at=stop_step)  # bitwise


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def manifest_only(root: Path, step: int) -> Path:
    """A step dir as resume's choice reads it: its manifest alone."""
    from trainer.checkpoint.format import FORMAT_VERSION, MANIFEST, step_dir_name

    path = root / step_dir_name(step)
    path.mkdir(parents=True)
    (path / MANIFEST).write_text(json.dumps({"format": FORMAT_VERSION, "step": step, "tensors": {}}))
    return path


@pytest.mark.parametrize("restart_variable", ["TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"])
def test_a_restart_resumes_from_the_newest_checkpoint_whatever_checkpoint_resume_named(
        tmp_path, monkeypatch, restart_variable):
    ckpt, elsewhere = tmp_path / "ckpt", tmp_path / "elsewhere"
    named = manifest_only(ckpt, 3)
    newest = manifest_only(ckpt, 6)
    first = CheckpointConfig(dir=str(ckpt), resume=str(named))
    assert resolve_resume(first) == named  # the first start begins where it is told
    monkeypatch.setenv(restart_variable, "1")
    assert resolve_resume(first) == newest
    named.rename(tmp_path / "pruned")  # keep_last removed it
    assert resolve_resume(first) == newest
    assert resolve_resume(CheckpointConfig(dir=str(ckpt), resume="none")) == newest  # this run's own saves
    ahead = manifest_only(elsewhere, 9)  # newer than anything this run saved yet: still the start
    assert resolve_resume(CheckpointConfig(dir=str(ckpt), resume=str(ahead))) == ahead
    assert resolve_resume(CheckpointConfig(dir=str(tmp_path / "empty"), resume=str(ahead))) == ahead


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["nproc", "torchrun"])
def test_a_rank_killed_after_keep_last_pruned_the_named_checkpoint_restarts_from_the_newest(
        tmp_path, reference, launcher):
    ckpt = tmp_path / "ckpt"
    first = run_cli("nproc=2", "strategy=fsdp", "train.max_steps=3", f"optim.schedule_steps={STEPS}",
                    "train.log_every=1", "data.num_workers=0", f"checkpoint.dir={ckpt}",
                    f"hydra.run.dir={tmp_path / 'first'}")
    assert first.returncode == 0, first.stderr[-3000:]
    named = ckpt / "step_00000003"
    run_dir = tmp_path / "run"
    process = start_restartable(run_dir, launcher, *ARGS, f"checkpoint.dir={ckpt}", "checkpoint.every_steps=3",
                                "checkpoint.keep_last=1", f"checkpoint.resume={named}")
    kill_a_rank_after_step(run_dir, process, 7)  # step 6 saved, step 3 pruned
    stdout, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-3000:]
    resumed = [e for e in events(run_dir) if e["event"] == "resumed"]
    assert resumed[0] == {"event": "resumed", "step": 3, "from": str(named)}  # the first start
    resumed_at = resumed[-1]["step"]  # the restart: the newest checkpoint when the rank died
    assert resumed_at % 3 == 0 and 6 <= resumed_at < STEPS
    assert resumed[-1]["from"] == str(ckpt / f"step_{resumed_at:08d}")
    assert not named.exists() and not list(ckpt.glob("superseded-*"))  # no newer work set aside
    assert_resumes(records(run_dir)[-(STEPS - resumed_at):], reference, at=resumed_at)  # bitwise
    assert events(run_dir)[-1]["event"] == "end"


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
