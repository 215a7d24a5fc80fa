"""Chaos, 20 kills (bench/chaos.py; `make test-all` only): a LoRA fine-tune of a tiny Qwen2 on a
three-source mixture, and a DPO run against a precomputed reference, each killed again and again
at random (seeded) moments: SIGKILL of one rank, SIGKILL of the whole job, SIGTERM; in training
steps, during saves, at epoch changes, during the reference's precompute and during the start.
Each restart resumes under the next of fsdp@2, zero2@2, zero3@1, ddp@2.

What it guarantees, after every kill and at every step:
  - the job is gone within 60 s of the signal, and none of its processes is left behind;
  - every checkpoint in the checkpoint dir is intact (`python -m trainer.verify CKPT_DIR`);
  - every step any start recorded has the loss of the run that was never killed (fsdp@2) within
    1e-6 relative (fp32), its epoch too, and every step of the run was recorded;
  - the run ends (a start past the last checkpoint finishes it).
"""
from __future__ import annotations

import sys

import pytest

from tests.harness import REPO

sys.path.insert(0, str(REPO / "bench"))


@pytest.mark.slow
def test_twenty_kills_lose_nothing(tmp_path):
    import chaos

    report = chaos.chaos(chaos.parse(["--kills", "20", "--seed", "1", "--mode", "both", "--steps", "10",
                                      "--out", str(tmp_path)]))
    assert chaos.ok(report), report
    assert report["kills"] == 20 and set(report["by_kind"]) == set(chaos.KINDS), report
    assert report["resumes"] > 0 and report["runs"] >= 2 and report["max_rel_loss_diff"] <= 1e-6, report
    assert report["steps_compared"] >= 2 * 10, report
