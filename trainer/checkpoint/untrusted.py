"""Reading checkpoint files the trainer did not write without running what they carry
(docs/checkpoints.md: What the trainer reads, and what can run code).

A torch.save file is a pickle: unpickled in full, it calls whatever globals it names (a `__reduce__`
payload runs as the file loads). Every such file from elsewhere is loaded with `weights_only=True`,
whose unpickler builds tensors, containers and the globals on an allowlist, nothing else; a file that
names any other global is refused in one line naming the file and the global, before it is loaded.

DeepSpeed's checkpoints go through DeepSpeed's own ds_to_universal, which loads them with
`weights_only=False`: `python -m trainer.checkpoint.untrusted ARGS` runs it (ARGS: ds_to_universal's
own) with `deepspeed_globals()` allowed and every torch.load in the process made weights-only.
"""
from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path

import torch

from trainer.errors import ERROR_EXIT_CODE, CheckpointError


def refuse_code(file: Path) -> None:
    """A CheckpointError naming `file` and the globals it names beyond the allowlist (torch's own and
    those registered with torch.serialization.add_safe_globals). The scan is static; the weights-only
    load that follows is what keeps code out."""
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(file)
    except ValueError as e:  # not a torch.save zip file, which is all DeepSpeed and DCP write
        raise CheckpointError(f"{file}: refused: {e}") from None
    if unsafe:
        raise CheckpointError(f"{file}: refused: loading it would call {', '.join(sorted(unsafe))}, which is not "
                              "on the trainer's allowlist of checkpoint globals (it could run any code)")


def load(file: Path) -> object:
    refuse_code(file)
    try:
        return torch.load(file, weights_only=True)
    except pickle.UnpicklingError as e:  # a global pushed in a way the static scan does not see
        raise CheckpointError(f"{file}: refused: {str(e).splitlines()[0]}") from None


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
