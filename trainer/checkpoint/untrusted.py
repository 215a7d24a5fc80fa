"""Reading checkpoint files the trainer did not write without running what they carry
(docs/checkpoints.md: What the trainer reads, and what can run code).

A torch.save file is a pickle: unpickled in full, it calls whatever globals it names (a `__reduce__`
payload runs as the file loads). Every such file from elsewhere is loaded with `weights_only=True`,
whose unpickler builds tensors, containers and the globals on an allowlist, nothing else; a file that
names any other global is refused in one line naming the file and the global, before it is loaded.

A torch DCP dir is read by DCP's own loader (what its `dcp_to_torch_save` does) with two parts swapped:
its `.metadata`, a plain pickle, goes through an unpickler that builds only `dcp_metadata_globals()`, and
each non-tensor entry loads as a torch.save file from elsewhere does (`load`).

DeepSpeed's checkpoints go through DeepSpeed's own ds_to_universal, which loads them with
`weights_only=False`: `python -m trainer.checkpoint.untrusted ARGS` runs it (ARGS: ds_to_universal's
own) with `deepspeed_globals()` allowed and every torch.load in the process made weights-only.
"""
from __future__ import annotations

import io
import os
import pickle
import sys
from dataclasses import is_dataclass
from pathlib import Path

import torch

from trainer.errors import ERROR_EXIT_CODE, CheckpointError


def refuse_code(file: Path | io.BytesIO, name: Path | str | None = None) -> None:
    """A CheckpointError naming `file` (or `name`) and the globals it names beyond the allowlist
    (torch's own and those registered with torch.serialization.add_safe_globals). The scan is static;
    the weights-only load that follows is what keeps code out."""
    name = file if name is None else name
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(file)
    except ValueError as e:  # not a torch.save zip file, which is all DeepSpeed and DCP write
        raise CheckpointError(f"{name}: refused: {e}") from None
    if unsafe:
        raise CheckpointError(f"{name}: refused: loading it would call {', '.join(sorted(unsafe))}, which is not "
                              "on the trainer's allowlist of checkpoint globals (it could run any code)")


def load(file: Path | io.BytesIO, name: Path | str | None = None) -> object:
    """`file` loaded weights-only; `name` says it in a refusal (by default `file` itself)."""
    name = file if name is None else name
    refuse_code(file, name)
    if isinstance(file, io.BytesIO):
        file.seek(0)
    try:
        return torch.load(file, weights_only=True)
    except pickle.UnpicklingError as e:  # a global pushed in a way the static scan does not see
        raise CheckpointError(f"{name}: refused: {str(e).splitlines()[0]}") from None


def dcp_metadata_globals() -> dict[tuple[str, str], object]:
    """What torch 2.13's DCP pickles in `.metadata` (FileSystemWriter, `pickle.dump(Metadata)`), by
    (module, name): the Metadata dataclasses, each entry's place in its file (`_StorageInfo`), the
    checkpoint_id (`PosixPath`), and a tensor's size, dtype, layout and memory format. Each is plain
    data: built from its fields (`__new__` and its state, or its constructor on a value), none runs
    code as it is built."""
    from torch.distributed.checkpoint import filesystem, metadata

    classes = [metadata.Metadata, metadata.TensorStorageMetadata, metadata.BytesStorageMetadata,
               metadata.ChunkStorageMetadata, metadata.TensorProperties, metadata.MetadataIndex,
               metadata.StorageMeta, metadata._MEM_FORMAT_ENCODING, filesystem._StorageInfo, Path().__class__]
    allowed: dict[tuple[str, str], object] = {(c.__module__, c.__qualname__): c for c in classes}
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    allowed.update({("torch", n): v for n, v in vars(torch).items() if isinstance(v, torch.dtype)})
    return allowed


class _MetadataUnpickler(pickle._Unpickler):  # the Python one: its BUILD can be checked
    """Builds only `dcp_metadata_globals()`, and sets state only on instances of those classes
    (never on a class, which pickle's BUILD would otherwise let it rewrite). torch's weights-only
    unpickler cannot be used: it reads pickle protocol 2, and DCP writes `.metadata` in 4 (FRAME,
    STACK_GLOBAL, MEMOIZE)."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str) -> object:
        found = self.globals.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"loading it would call {module}.{name}, which is not on the trainer's "
                                         "allowlist of DCP metadata globals (it could run any code)")
        return found

    def load_build(self) -> None:
        if type(self.stack[-2]) not in self.classes:
            raise pickle.UnpicklingError(f"it sets the state of a {type(self.stack[-2]).__name__}, which is not "
                                         "a DCP metadata class")
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = load_build

    def __init__(self, file):
        super().__init__(file)
        self.globals = dcp_metadata_globals()
        self.classes = {v for v in self.globals.values() if isinstance(v, type) and is_dataclass(v)}


def read_dcp_metadata(file: Path) -> object:
    """A DCP `.metadata`, built through `_MetadataUnpickler`; anything else is refused in one line."""
    with open(file, "rb") as f:
        try:
            return _MetadataUnpickler(f).load()
        except Exception as e:  # an allowlisted global misused, or not a pickle at all
            raise CheckpointError(f"{file}: refused: {str(e).splitlines()[0] if str(e) else type(e).__name__}") \
                from None


def load_dcp(folder: Path) -> dict:
    """A torch DCP dir whole, as DCP's `dcp_to_torch_save` reads it, running nothing it carries. Through
    DCP's private loader, reader and planner (`_load_state_dict`, `_EmptyStateDictLoadPlanner`), checked
    against torch 2.13."""
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    metadata = read_dcp_metadata(folder / ".metadata")  # here: DCP would log a refusal's traceback and go on

    class Reader(FileSystemReader):  # FileSystemReader.read_metadata but for its pickle.load
        def read_metadata(self, *args, **kwargs):
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class Planner(_EmptyStateDictLoadPlanner):  # DefaultLoadPlanner.load_bytes but for its weights_only=False
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            where = folder / reader.storage_data[read_item.storage_index].relative_path
            loaded = load(value, f"{where} (entry {read_item.dest_index.fqn})")
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    reader = Reader(folder)
    state: dict = {}
    try:
        _load_state_dict(state, storage_reader=reader, planner=Planner(), no_dist=True)
    except CheckpointException as e:  # DCP's wrapping of what a step raised, by rank
        for exc, _ in e.failures.values():
            if isinstance(exc, CheckpointError):
                raise exc from None
        raise
    return state


def deepspeed_globals() -> list:
    """What DeepSpeed 0.19.8's ZeRO optimizer states pickle besides tensors: the loss scaler
    (`LossScaler`; `DynamicLossScaler` under fp16), the stage (`ZeroStageEnum`) and each parameter's
    range in the flat partition (`fragment_address`). Each is plain data: rebuilt from its fields,
    none runs code as it is built."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def ds_to_universal() -> None:
    """DeepSpeed's ds_to_universal on sys.argv, loading only what the allowlist lets through; a
    refused file is said in one line on stderr, exit code ERROR_EXIT_CODE, before any conversion."""
    from deepspeed.checkpoint import ds_to_universal as deepspeed_tool

    torch.serialization.add_safe_globals(deepspeed_globals())
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"  # read at each torch.load; its worker processes inherit it
    args = deepspeed_tool.parse_arguments()
    try:
        for file in sorted(Path(args.input_folder).glob("*.pt")):
            refuse_code(file)
    except CheckpointError as e:
        print(e, file=sys.stderr)
        sys.exit(ERROR_EXIT_CODE)
    deepspeed_tool.main(args)


if __name__ == "__main__":
    ds_to_universal()
