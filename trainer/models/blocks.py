"""Find the blocks to shard and checkpoint, by class name (`strategy.wrap`) or the model's
`_no_split_modules`; apply activation checkpointing per block, the same for every backend."""
from __future__ import annotations

from collections import Counter
from functools import partial

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)

from trainer.errors import ConfigError


def block_class_names(model: nn.Module, wrap: list[str] | None) -> list[str]:
    names = list(wrap) if wrap else list(getattr(model, "_no_split_modules", None) or [])
    if not names:
        raise ConfigError(f"strategy.wrap: {type(model).__name__} has no _no_split_modules; name its block "
                          f"classes, e.g. strategy.wrap=[{', '.join(block_like_classes(model)) or 'Block'}]")
    return names


def block_like_classes(model: nn.Module) -> list[str]:
    """Classes that repeat inside a ModuleList or Sequential: the candidates for `strategy.wrap`."""
    counts = Counter(type(child).__name__ for m in model.modules()
                     if isinstance(m, (nn.ModuleList, nn.Sequential)) for child in m.children())
    return sorted(name for name, n in counts.items() if n > 1 or len(counts) == 1)


def find_blocks(model: nn.Module, wrap: list[str] | None) -> list[nn.Module]:
    """The modules whose class name is in `wrap`, in model order. Every name must occur."""
    names = block_class_names(model, wrap)
    present = {type(m).__name__ for m in model.modules()}
    missing = [n for n in names if n not in present]
    if missing:
        raise ConfigError(f"strategy.wrap: no module of class {', '.join(missing)} in {type(model).__name__}; "
                          f"block-like classes in this model: {', '.join(block_like_classes(model)) or 'none'}")
    return [m for m in model.modules() if type(m).__name__ in names]


def apply_checkpointing(model: nn.Module, blocks: list[nn.Module]) -> None:
    """Non-reentrant activation checkpointing around each block (recomputed in backward)."""
    block_ids = {id(b) for b in blocks}
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: id(m) in block_ids,
    )
