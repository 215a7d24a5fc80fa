"""A stop signal before the ranks train says what was running and names only files that exist:
during the launching process's start-up, one line and the signal's exit code (not a silent death);
once the ranks were started but stopped before recording where, the launcher's line says how far
they got, pointing at metrics.jsonl only where it exists."""
from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.harness import CPU_ONLY
from trainer.__main__ import unsaid_stop


def test_a_stop_signal_while_the_launcher_starts_is_said_in_one_line_with_its_exit_code(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    # The launcher waits on checkpoint.dir's lock, held here, as a requeued job waits for its old
    # process (SLURM_RESTART_COUNT): a start-up that lasts until the signal comes.
    with open(ckpt / ".writer.lock", "a+") as held:
        fcntl.lockf(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        launcher = subprocess.Popen([sys.executable, "-m", "trainer", "nproc=2", f"checkpoint.dir={ckpt}",
                                     f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    env={**os.environ, **CPU_ONLY, "SLURM_RESTART_COUNT": "1"})
        deadline = time.monotonic() + 120
        while not any(Path(f.path).name == ".writer.lock" for f in psutil.Process(launcher.pid).open_files()):
            assert time.monotonic() < deadline and launcher.poll() is None, launcher.communicate()
            time.sleep(0.05)
        launcher.send_signal(signal.SIGTERM)
        _, stderr = launcher.communicate(timeout=120)
    assert launcher.returncode == 143, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == ("trainer: stopped by SIGTERM during start-up, before any rank started "
                                               "training: nothing to save; exit code 143"), stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]


def test_the_launchers_stop_line_names_metrics_jsonl_only_where_it_says_more(tmp_path):
    """unsaid_stop: what the launcher's `trainer: stopped by a signal...` line adds after the ranks."""
    metrics = tmp_path / "metrics.jsonl"
    assert unsaid_stop(tmp_path) == " while the ranks were starting, before their first step: nothing to save"
    lines = [{"event": "sources", "step": 0}, {"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0},
             {"step": 2, "split": "val", "loss": 4.5}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in lines[:1]))  # written before the first step
    assert unsaid_stop(tmp_path) == " while the ranks were starting, before their first step: nothing to save"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in lines))  # killed before they could say where
    assert unsaid_stop(tmp_path) == f" after step 2, before the ranks said where they stopped; see {metrics}"
    with metrics.open("a") as f:  # rank 0 said it (its `SIGTERM: all ranks stopped after step 2` line)
        f.write(json.dumps({"event": "preempted", "step": 2, "signal": "SIGTERM", "checkpoint": None}) + "\n")
    assert unsaid_stop(tmp_path) == ""
