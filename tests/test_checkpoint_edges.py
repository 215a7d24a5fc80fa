"""The edges of a save: the last step's save failing, pruning that fails after the save is
complete or is killed halfway, a step saved again, and a second resume of an older step."""
from __future__ import annotations

import logging
import shutil

import pytest

from tests.harness import assert_refused, run_cli
from trainer.checkpoint.format import PRUNED_PREFIX, REPLACED_PREFIX
from trainer.checkpoint.manager import CheckpointManager
from trainer.config import CheckpointConfig


def manager(root, **cfg) -> CheckpointManager:
    return CheckpointManager(CheckpointConfig(dir=str(root), **cfg), strategy=None, strategy_name="ddp")


def step_dir(root, step: int, prefix: str = ""):
    path = root / f"{prefix}step_{step:08d}"
    path.mkdir(parents=True)
    (path / "manifest.json").write_text('{"tensors": {}}')
    return path


def test_a_run_whose_last_save_fails_does_not_end_with_exit_0(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / ".tmp-step_00000003").write_text("a file where the last save wants its dir")
    result = run_cli("train.max_steps=3", f"checkpoint.dir={ckpt}", "data.num_workers=0",
                     f"hydra.run.dir={tmp_path / 'run'}")
    assert_refused(result, "trainer: error: checkpoint: saving step 3 failed", "the run is not saved")


def test_a_prune_that_fails_after_the_save_is_a_warning(tmp_path, monkeypatch, caplog):
    old, new = step_dir(tmp_path, 2), step_dir(tmp_path, 4)

    def cannot_remove(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(shutil, "rmtree", cannot_remove)
    with caplog.at_level(logging.WARNING):
        manager(tmp_path, keep_last=1)._prune(keep=new)
    assert "saved step_00000004, but could not remove the older step_00000002" in caplog.text
    # set aside, no longer a step dir: the next save removes it
    assert not old.exists() and (tmp_path / f"{PRUNED_PREFIX}step_00000002").is_dir() and new.is_dir()


def test_a_prune_killed_halfway_leaves_no_step_dir_with_files_missing(tmp_path, monkeypatch):
    """keep_last's removal, killed after its first file (bench/chaos.py found a step dir with its
    manifest and without its rank file): every step dir left is whole, and the next save removes
    what the prune left."""
    old, new = step_dir(tmp_path, 2), step_dir(tmp_path, 4)
    for path in (old, new):
        (path / "rank_00000.safetensors").write_bytes(b"weights")
    removing = shutil.rmtree

    def killed_after_one_file(path, *args, **kwargs):
        (path / "rank_00000.safetensors").unlink()
        raise KeyboardInterrupt  # the signal, mid-removal

    monkeypatch.setattr(shutil, "rmtree", killed_after_one_file)
    with pytest.raises(KeyboardInterrupt):
        manager(tmp_path, keep_last=1)._prune(keep=new)
    left = sorted(tmp_path.glob("step_*"))
    assert left == [new] and all((p / f).is_file() for p in left for f in ("manifest.json", "rank_00000.safetensors"))
    monkeypatch.setattr(shutil, "rmtree", removing)
    manager(tmp_path)._prepare(tmp_path / ".tmp-step_00000005")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-step_00000005", "step_00000004"]


@pytest.mark.parametrize("renamed_back", [True, False])
def test_a_step_saved_again_is_never_lost_to_a_save_that_dies(tmp_path, renamed_back):
    # The complete step dir set aside while the same step is saved again: not named .tmp-, which a
    # save removes. Died before the new one was renamed in: the old one comes back; after: it goes.
    replaced = step_dir(tmp_path, 6, prefix=REPLACED_PREFIX)
    if not renamed_back:
        step_dir(tmp_path, 6)
    manager(tmp_path)._prepare(tmp_path / ".tmp-step_00000007")
    assert (tmp_path / "step_00000006" / "manifest.json").is_file() and not replaced.exists()


def test_a_second_resume_of_an_older_step_keeps_the_first_superseded_set(tmp_path):
    step_dir(tmp_path, 4)
    first = step_dir(tmp_path, 6, prefix="superseded-")  # set aside by the first resume from step 4
    step_dir(tmp_path, 6)  # written by that resumed run
    m = manager(tmp_path)
    m.resumed_older = tmp_path / "step_00000004"
    m._set_aside_newer(5)
    assert first.is_dir() and (tmp_path / "superseded-2-step_00000006").is_dir()
    assert not (tmp_path / "step_00000006").exists()
