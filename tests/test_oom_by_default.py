"""Out-of-memory adapts by default (train.on_oom=adapt, max_restarts unset): the trainer's own launcher
restarts the ranks, one process too, for each adaptation within train.max_adaptations, and keeps
max_restarts for the other failures; a run out of host memory so finishes with the losses of the run
that had the memory; an out-of-memory during set-up is said in one line, not a traceback."""
from __future__ import annotations

import json
import shutil
import sys
from dataclasses import asdict
from types import SimpleNamespace

import pytest

from tests.harness import records, run_cli
from trainer.__main__ import Restarts
from trainer.config import to_config
from trainer.errors import OUT_OF_MEMORY_EXIT_CODE
from trainer.oom import TEST_SWITCH, Adaptation, append, read_oom_records


def said(stderr: str) -> list[str]:
    """The trainer's lines on stderr, without the progress bar drawn before them."""
    return [line[line.index("trainer: "):] for line in stderr.splitlines() if "trainer: " in line]


def test_the_launcher_restarts_to_adapt_within_max_adaptations_and_for_faults_within_max_restarts(tmp_path, capsys):
    cfg = to_config({"max_restarts": 1, "train": {"max_adaptations": 2}})
    restarts = Restarts(cfg, tmp_path)
    killed, out_of_memory = SimpleNamespace(exitcode=-9, pid=7, signal_name=lambda: "SIGKILL"), \
        SimpleNamespace(exitcode=OUT_OF_MEMORY_EXIT_CODE, pid=8)
    for adaptations in (0, 1):  # two adaptations, whatever max_restarts says
        append(tmp_path, {"event": "out_of_memory", "plan": asdict(Adaptation(8, 1, False, 8, adaptations=adaptations))})
        assert restarts({0: out_of_memory})
    assert restarts({1: killed})  # the one fault restart, untouched by the adaptations
    assert not restarts({1: killed})
    append(tmp_path, {"event": "out_of_memory", "plan": asdict(Adaptation(2, 4, False, 8, adaptations=2))})
    assert not restarts({0: out_of_memory})  # max_adaptations used up: the rank's line said so
    assert said(capsys.readouterr().err) == [
        "trainer: rank 0 (pid 8) ran out of memory (its line is above); restarting to adapt (adaptation 1 of "
        "train.max_adaptations=2), starting over (no checkpoint.dir)",
        "trainer: rank 0 (pid 8) ran out of memory (its line is above); restarting to adapt (adaptation 2 of "
        "train.max_adaptations=2), starting over (no checkpoint.dir)",
        "trainer: rank 1 (pid 7) was killed by SIGKILL; restart 1 of 1, starting over (no checkpoint.dir)"]
    on_oom_fail = Restarts(to_config({"max_restarts": 0, "train": {"on_oom": "fail"}}), tmp_path)
    assert not on_oom_fail({0: out_of_memory})


def test_a_plain_run_trains_in_its_own_process_and_restarts_it_to_adapt(tmp_path):
    """No max_restarts, one process: the first round trains in the trainer's own process (no launcher
    to start: the pid it names is the command's), the restart adapts and resumes from the checkpoint."""
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    result = run_cli("train.max_steps=3", "train.log_every=1", "data.num_workers=0", f"checkpoint.dir={ckpt}",
                     "checkpoint.every_steps=1", f"hydra.run.dir={run_dir}", env={TEST_SWITCH: "rank=0,rows=8,from_step=2"},
                     launcher=["bash", "-c", 'echo "pid $$" >&2; exec "$0" "$@"', sys.executable, "-m", "trainer"],
                     timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    pid = result.stderr.split("pid ", 1)[1].split()[0]
    lines = said(result.stderr)
    assert "Traceback" not in result.stderr and len(lines) == 2, result.stderr[-3000:]
    assert lines[0].startswith("trainer: error: rank 0 ran out of memory in the forward of step 2 at "
                               "train.micro_batch_size=8") and lines[0].endswith(
        "the restart adapts (train.micro_batch_size=4 train.grad_accum_steps=2)"), lines
    assert lines[1] == (f"trainer: rank 0 (pid {pid}) ran out of memory (its line is above); restarting to adapt "
                        f"(adaptation 1 of train.max_adaptations=4), resuming from the newest checkpoint in {ckpt}")
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"event"' in line]
    assert [(r["event"], r.get("restart"), r["step"]) for r in events] == [
        ("adapted", None, 2), ("restarted", 1, 1), ("resumed", None, 1), ("end", None, 3)], events
    assert [r["step"] for r in records(run_dir)] == [1, 2, 3]


def test_one_process_without_max_restarts_adapts_and_stops_once_max_adaptations_are_used_up(tmp_path):
    """max_restarts=2 left untouched: the second out-of-memory ends the job (exit 3) with the rank's line."""
    run_dir = tmp_path / "run"
    result = run_cli("train.max_steps=2", "data.num_workers=0", "train.max_adaptations=1", "max_restarts=2",
                     f"hydra.run.dir={run_dir}", env={TEST_SWITCH: "rank=0,rows=1"}, timeout=300)
    assert result.returncode == OUT_OF_MEMORY_EXIT_CODE, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and [line.split(": it asked")[0].split(" (pid")[0]
                                                 for line in said(result.stderr)] == [
        "trainer: error: rank 0 ran out of memory in the forward of step 1 at train.micro_batch_size=8",
        "trainer: rank 0",
        "trainer: error: rank 0 ran out of memory in the forward of step 1 at train.micro_batch_size=4"], result.stderr
    lines = said(result.stderr)
    assert lines[0].endswith("the restart adapts (train.micro_batch_size=4 train.grad_accum_steps=2)")
    assert lines[1].endswith("restarting to adapt (adaptation 1 of train.max_adaptations=1), starting over "
                             "(no checkpoint.dir)")
    assert lines[2].endswith("train.max_adaptations=1 are used up: python -m trainer.plan for a strategy that fits")


def test_a_set_up_out_of_memory_is_one_line(tmp_path):
    """A real one: a model whose build asks for more than the machine would give (1 TiB of embedding)."""
    run_dir = tmp_path / "run"
    result = run_cli("model.vocab_size=4294967296", "data=synthetic", "train.on_oom=fail", "train.max_steps=1",
                     "data.num_workers=0", f"hydra.run.dir={run_dir}", timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert said(result.stderr) == [
        "trainer: error: rank 0 ran out of memory during set-up at train.micro_batch_size=8: it asked for 1024.00 GiB "
        f"with {read_oom_records(run_dir)[0]['free'] / 2 ** 30:.2f} GiB free; try python -m trainer.plan for a strategy "
        "that fits, or train.on_oom=adapt"], result.stderr[-3000:]
    adapting = run_cli("model.vocab_size=4294967296", "data=synthetic", "train.max_adaptations=0", "train.max_steps=1",
                       "data.num_workers=0", f"hydra.run.dir={tmp_path / 'adapting'}", timeout=300)
    assert adapting.returncode == OUT_OF_MEMORY_EXIT_CODE and "Traceback" not in adapting.stderr, adapting.stderr[-3000:]
    assert len(said(adapting.stderr)) == 1 and said(adapting.stderr)[0].endswith(
        "train.max_adaptations=0 are used up: python -m trainer.plan for a strategy that fits"), adapting.stderr[-3000:]


# The issue's run (model=small at 1024 tokens, micro-batch 16), shortened to 2 steps (the first runs
# out of memory, the second is trained at the adapted plan): under 3 GiB of address space micro-batch
# 16 does not fit here.
ISSUE_RUN = ["model=small", "model.seq_len=1024", "data=synthetic", "train.micro_batch_size=16", "train.max_steps=2",
             "train.log_every=1", "data.num_workers=0"]
HOST_LIMIT = 3 << 30


@pytest.mark.slow
@pytest.mark.skipif(not shutil.which("prlimit"), reason="needs util-linux's prlimit")
def test_a_plain_run_out_of_host_memory_adapts_and_has_the_losses_of_the_run_with_the_memory(tmp_path):
    run_dir, planned = tmp_path / "run", tmp_path / "planned"
    saving = [f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.every_steps=2"]
    limited = run_cli(*ISSUE_RUN, *saving, f"hydra.run.dir={run_dir}", timeout=1200,
                      launcher=["prlimit", f"--as={HOST_LIMIT}", sys.executable, "-m", "trainer"])
    assert limited.returncode == 0, limited.stderr[-3000:]
    adapted = [r for r in read_oom_records(run_dir) if r["event"] == "adapted"]
    assert adapted and all("DefaultCPUAllocator" in r["error"] for r in read_oom_records(run_dir)
                           if r["event"] == "out_of_memory"), read_oom_records(run_dir)
    reference = run_cli(*ISSUE_RUN, f"hydra.run.dir={planned}", timeout=1200)
    assert reference.returncode == 0, reference.stderr[-3000:]
    expected = [r["loss"] for r in records(planned)]
    last = {r["step"]: r["loss"] for r in records(run_dir)}  # a step logged again after a restart: the last
    assert all(abs(a - e) <= 1e-6 * e for a, e in zip([last[s] for s in sorted(last)], expected, strict=True))
