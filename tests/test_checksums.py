"""Every checkpoint file is hashed as it is written and verified where it is read: a damaged
file is never trained on, exported or converted, and `python -m trainer.verify` finds it offline."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.harness import case, on_ranks, records, refusal, run_cli, saving, train_cases
from trainer import verify
from trainer.checkpoint.convert import convert
from trainer.checkpoint.export import export
from trainer.checkpoint.format import CHECKSUM, PieceReader, file_checksum, read_manifest
from trainer.errors import CheckpointError

FLAGS = ["checkpoint.every_steps=3", "train.log_every=1", "train.micro_batch_size=8", "optim.warmup_steps=2",
         "data.num_workers=0"]


def flip(path: Path) -> None:
    """Four bytes in the middle of a file inverted: what a bad disk or a bad copy does."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 4] = bytes(b ^ 0xFF for b in data[middle:middle + 4])
    path.write_bytes(bytes(data))


def verify_cli(path: Path, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        verify.main([str(path)])
        raise SystemExit(0)
    out = capsys.readouterr()
    return e.value.code, out.out + out.err


@pytest.mark.slow  # make test stays under 8 minutes: the rest of what it covers is in the quick suite
def test_a_flipped_byte_is_found_skipped_by_auto_and_refused_everywhere_else(tmp_path, capsys):
    ckpt, step6 = tmp_path / "ckpt", tmp_path / "ckpt" / "step_00000006"
    result = run_cli(*FLAGS, f"checkpoint.dir={ckpt}", "train.max_steps=6", f"hydra.run.dir={tmp_path / 'straight'}")
    assert result.returncode == 0, result.stderr[-2000:]
    manifest = read_manifest(step6)
    assert set(manifest["checksums"]) == set(manifest["files"]) == {"rank_00000.safetensors"}
    for name, written in manifest["checksums"].items():  # hashed as written: what is on disk, a safetensors file
        assert written == {"bytes": (step6 / name).stat().st_size, CHECKSUM: file_checksum(step6 / name)}
        assert load_file(step6 / name)
    assert verify_cli(ckpt, capsys)[0] == 0

    flip(step6 / "rank_00000.safetensors")
    code, said = verify_cli(ckpt, capsys)
    assert code == 2 and "step_00000003: intact" in said, said
    assert "step_00000006: damaged" in said and "rank_00000.safetensors does not match the xxh3_128 checksum" in said
    with pytest.raises(CheckpointError, match="rank_00000.safetensors does not match"):  # what each rank reads through
        PieceReader(step6, manifest).read_full("model.tok_emb.weight")
    error = refusal(tmp_path / "refused", f"checkpoint.resume={step6}", "train.max_steps=8")
    assert "rank_00000.safetensors does not match" in error, error
    with pytest.raises(CheckpointError, match="rank_00000.safetensors does not match"):
        export(step6, tmp_path / "out.safetensors")
    with pytest.raises(CheckpointError, match="rank_00000.safetensors does not match"):
        convert(ckpt, tmp_path / "dcp", "dcp")
    assert not (tmp_path / "out.safetensors").exists() and not (tmp_path / "dcp").exists()

    result = run_cli(*FLAGS, f"checkpoint.dir={ckpt}", "train.max_steps=6", f"hydra.run.dir={tmp_path / 'resumed'}")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count("skipping step 6, damaged: ") == 1, result.stdout  # said once, naming the file
    assert f"{step6}/rank_00000.safetensors" in result.stdout
    assert f"resumed from {ckpt / 'step_00000003'} at step 3" in result.stdout
    straight, resumed = records(tmp_path / "straight"), records(tmp_path / "resumed")
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight[3:]]  # from intact step 3, exactly
    assert verify_cli(ckpt, capsys)[0] == 0  # step 6 saved again, intact, in place of the damaged one


def test_a_checkpoint_from_before_checksums_loads_and_says_it_cannot_be_verified(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    on_ranks(1, train_cases, {"old": saving(case("ddp", steps=2), ckpt, 2)}, str(tmp_path))
    step = ckpt / "step_00000002"
    manifest = read_manifest(step)
    del manifest["checksums"]
    (step / "manifest.json").write_text(json.dumps(manifest))
    code, said = verify_cli(step, capsys)
    assert code == 0 and "saved without checksums" in said and "cannot be verified" in said, said
    export(step, tmp_path / "out.safetensors")
    assert "saved without checksums" in capsys.readouterr().out


def damage(step: Path, how: str) -> None:
    ranks = [step / "rank_00000.safetensors", step / "rank_00001.safetensors"]
    if how == "truncate":
        ranks[1].write_bytes(ranks[1].read_bytes()[:-4096])
    else:  # swap two ranks' files
        ranks[0].rename(step / "swap")
        ranks[1].rename(ranks[0])
        (step / "swap").rename(ranks[1])


@pytest.mark.slow
@pytest.mark.parametrize("strategy,how", [("fsdp", "truncate"), ("zero3", "swap")])
def test_damaged_sharded_checkpoints_are_skipped_or_refused(tmp_path, strategy, how):
    ckpt, step6 = tmp_path / "ckpt", tmp_path / "ckpt" / "step_00000006"
    run = [*FLAGS, f"strategy={strategy}", "nproc=2", "train.micro_batch_size=4", f"checkpoint.dir={ckpt}",
           "train.max_steps=6"]
    result = run_cli(*run, f"hydra.run.dir={tmp_path / 'straight'}")
    assert result.returncode == 0, result.stderr[-2000:]
    damage(step6, how)
    found = "rank_00001.safetensors has .* were written: truncated" if how == "truncate" else "rank_00000.safetensors"
    error = refusal(tmp_path / "refused", f"strategy={strategy}", "nproc=2", f"checkpoint.resume={step6}")
    assert re.search(found, error), error
    for act in (lambda: export(step6, tmp_path / "out.safetensors"), lambda: convert(step6, tmp_path / "hf", "trainer")):
        with pytest.raises(CheckpointError, match=found):
            act()
    result = run_cli(*run, f"hydra.run.dir={tmp_path / 'resumed'}")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "skipping step 6, damaged" in result.stdout and f"resumed from {ckpt / 'step_00000003'}" in result.stdout
    straight, resumed = records(tmp_path / "straight"), records(tmp_path / "resumed")
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight[3:]]
    shutil.rmtree(ckpt)
