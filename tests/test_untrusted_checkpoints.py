"""A checkpoint from elsewhere never runs code. A torch.save file whose pickle would call
anything beyond tensors, containers and the allowlisted globals (trainer.checkpoint.untrusted) is
refused in one line naming the file and the global, exit code 2, and its payload never runs: a
universal checkpoint read by `python -m trainer.convert`, a DeepSpeed checkpoint read through
ds_to_universal, a torch DCP dir (its `.metadata`, a plain pickle, and its non-tensor entries), and the
DPO reference table the trainer caches. The legitimate conversions, whose
files need the allowlist, pass in tests/test_convert.py (a plain DeepSpeed ZeRO-2 loop's checkpoint,
a plain FSDP2 loop's DCP, ours to a universal checkpoint through a ZeRO-1 engine's)."""
from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.harness import CPU_ONLY, REPO, assert_refused, on_ranks
from tests.test_dpo_reference_cache import tables_on_nodes
from trainer.checkpoint.convert import read
from trainer.errors import CheckpointError


class Payload:
    """Unpickled in full, it creates `marker`: what any code a pickle carries could do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def universal_with_payload(root: Path, marker: Path) -> Path:
    """A universal checkpoint as ds_to_universal lays it out, whose one parameter's fp32.pt carries the payload."""
    folder = root / "universal" / "zero" / "w"
    folder.mkdir(parents=True)
    torch.save({"param": Payload(marker)}, folder / "fp32.pt")
    torch.save(torch.tensor(3), folder / "step.pt")
    return root / "universal"


def assert_conversion_refused(src: Path, out: Path, culprit: Path, marker: Path) -> None:
    """`python -m trainer.convert SRC OUT --to trainer` refuses, in one line naming `culprit` and the
    global its payload calls; the payload never ran and nothing was written."""
    done = subprocess.run([sys.executable, "-m", "trainer.convert", str(src), str(out), "--to", "trainer"],
                          cwd=REPO, capture_output=True, text=True, env={**os.environ, **CPU_ONLY})
    assert_refused(done, f"{culprit}: refused", "io.open", prog="trainer.convert")
    assert not marker.exists(), "the payload ran"
    assert not out.exists()


def test_converting_a_universal_checkpoint_with_a_payload_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    src = universal_with_payload(tmp_path, marker)
    assert_conversion_refused(src, tmp_path / "out", src / "zero" / "w" / "fp32.pt", marker)


def test_a_deepspeed_checkpoint_with_a_payload_is_refused_before_ds_to_universal_loads_it(tmp_path):
    """DeepSpeed's ds_to_universal, run as it is, unpickles the optimizer states' payload."""
    marker = tmp_path / "ran"
    tag = tmp_path / "deepspeed" / "global_step1"
    tag.mkdir(parents=True)
    torch.save({"module": {"w": torch.zeros(2)}}, tag / "mp_rank_00_model_states.pt")
    optim = tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": Payload(marker)}, optim)
    (tag.parent / "latest").write_text(tag.name)
    with pytest.raises(CheckpointError) as refused:
        read(tag.parent)
    said = str(refused.value)
    assert f"{optim}: refused" in said and "io.open" in said and "\n" not in said, said
    assert not marker.exists(), "the payload ran"


def dcp_save(state: dict, out: Path) -> Path:
    with pytest.warns(UserWarning):  # "torch.distributed is disabled ...": one process, as meant
        dcp.save(state, checkpoint_id=str(out), no_dist=True)
    return out


def test_converting_a_dcp_dir_whose_metadata_carries_a_payload_is_refused_and_runs_nothing(tmp_path):
    """DCP's own reader (dcp_to_torch_save, FileSystemReader) unpickles `.metadata` in full."""
    marker = tmp_path / "ran"
    src = dcp_save({"model": {"w": torch.ones(2)}}, tmp_path / "dcp")
    metadata = pickle.loads((src / ".metadata").read_bytes())
    metadata.storage_meta.modules = [Payload(marker)]
    (src / ".metadata").write_bytes(pickle.dumps(metadata))
    assert_conversion_refused(src, tmp_path / "out", src / ".metadata", marker)


def test_a_dcp_entry_with_a_payload_is_refused_and_runs_nothing(tmp_path):
    """DCP's own planner loads a non-tensor entry with torch.load(weights_only=False)."""
    marker = tmp_path / "ran"
    src = dcp_save({"model": {"w": torch.ones(2)}, "train": {"step": 3, "extra": Payload(marker)}}, tmp_path / "dcp")
    with pytest.raises(CheckpointError) as refused:
        read(src)
    said = str(refused.value)
    assert f"{src}/__0_0.distcp (entry train.extra): refused" in said and "io.open" in said and "\n" not in said, said
    assert not marker.exists(), "the payload ran"


def test_a_dcp_class_rewritten_by_its_metadata_is_refused(tmp_path):
    """Setting state on an allowlisted class (rather than on an instance of it) is refused: pickle's
    BUILD would set the class's attributes for the rest of the process."""
    from torch.distributed.checkpoint.metadata import StorageMeta

    src = dcp_save({"model": {"w": torch.ones(2)}}, tmp_path / "dcp")
    name = b"rewritten"  # BUILD (None, {"rewritten": None}) on the class: setattr(StorageMeta, "rewritten", None)
    (src / ".metadata").write_bytes(pickle.dumps(StorageMeta, protocol=2)[:-1] + pickle.NONE + pickle.EMPTY_DICT
                                    + pickle.BINUNICODE + struct.pack("<I", len(name)) + name + pickle.NONE
                                    + pickle.SETITEM + pickle.TUPLE2 + pickle.BUILD + pickle.STOP)
    with pytest.raises(CheckpointError, match=r"\.metadata: refused: it sets the state of a type"):
        read(src)
    assert not hasattr(StorageMeta, "rewritten")


def cached_table_refusal(env, root: str) -> str:
    try:
        tables_on_nodes(env, root)
    except Exception as e:  # what was raised, by name: the rank returns it
        return type(e).__name__
    return "read"


def test_the_dpo_reference_table_is_read_as_tensors_only(tmp_path, monkeypatch):
    """Even where the environment turns torch.load's default to full unpickling (as users do for old
    checkpoints), the cached table is read weights-only."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    marker = tmp_path / "ran"
    (tmp_path / "node0").mkdir()
    torch.save(Payload(marker), tmp_path / "node0" / "train.pt")
    assert on_ranks(1, cached_table_refusal, str(tmp_path))[0] == "UnpicklingError"
    assert not marker.exists(), "the payload ran"
