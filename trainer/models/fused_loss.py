"""train.fused_loss=true: the output layer returns each token's loss in place of its logits,
computed by torch's `linear_cross_entropy` in chunks of tokens, so that the [tokens, vocab] logits
and their gradient are never held whole.

The loss is computed inside the output layer's own forward (its class gets `ChunkedLoss` mixed
in: `fuse_output_layer`), so each backend's hooks on that layer give it its whole weight, in
forward and again in backward: ZeRO-3 gathers the layer's partitioned weight (a fused loss that
read the weight outside the model's forward would read ZeRO-3's empty partition), FSDP2 unshards
the root that holds it, and a tied weight is the embedding's own. The objective hands the targets
in around the model's forward (`token_losses`); the layer's input must be the hidden states of
those targets' tokens, and the model's logits its output unchanged: `check_output_layer`
(models/checks.py) runs a forward of the model built small on the CPU to see so, before any work.

Each token's loss (reduction="none", 0 where there is no target), summed by the caller in fp32:
a bf16 or fp16 sum of a micro-batch's losses would round (fp16: overflow past 65504). torch's op
recomputes each chunk's logits in backward, from the layer's input and weight (which it keeps:
the activations it saves are [tokens] log-sum-exps, nothing [tokens, vocab]).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from trainer.errors import ConfigError
from trainer.models.lora import output_layer

_targets: tuple[torch.Tensor, int] | None = None  # (targets [b, t], ignore_index) inside `token_losses`


@contextmanager
def token_losses(targets: torch.Tensor, ignore_index: int) -> Iterator[None]:
    """Inside, a model whose output layer is fused returns each token's loss [b, t] where it
    returned logits [b, t, vocab]; `ignore_index`: the target of no token (its loss is 0)."""
    global _targets
    previous, _targets = _targets, (targets, ignore_index)
    try:
        yield
    finally:
        _targets = previous


class ChunkedLoss:
    """Mixed into the output layer's class (a torch Linear's): inside `token_losses`, its forward
    gives the tokens' losses; outside (a probe, an export), its logits as before."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if _targets is None:
            return super().forward(hidden)
        targets, ignore_index = _targets
        if hidden.shape[:-1] != targets.shape:
            raise RuntimeError(f"train.fused_loss: the output layer's input {tuple(hidden.shape)} is not the hidden "
                               f"states of the targets {tuple(targets.shape)}")
        losses = F.linear_cross_entropy(hidden.flatten(0, -2), self.weight, targets.flatten(), linear_bias=self.bias,
                                        reduction="none", ignore_index=ignore_index,
                                        options=nn.LinearCrossEntropyOptions())
        return losses.view(targets.shape)


_FUSED_CLASSES: dict[type, type] = {}


def fused_class(cls: type) -> type:
    """`cls` with ChunkedLoss's forward first: the same parameters, names, hooks and init."""
    if cls not in _FUSED_CLASSES:
        _FUSED_CLASSES[cls] = type(f"Fused{cls.__name__}", (ChunkedLoss, cls), {})
    return _FUSED_CLASSES[cls]


def the_output_layer(model: nn.Module, vocab_size: int) -> nn.Linear:
    """The layer that makes the logits (`get_output_embeddings()`, else the last linear layer as wide
    as the vocabulary), a torch Linear; refused in one line otherwise."""
    head = output_layer(model, vocab_size)
    if head is None:
        raise ConfigError(f"train.fused_loss: {type(model).__name__} has no output layer to fuse: neither "
                          f"get_output_embeddings() nor a linear layer {vocab_size} wide (the vocabulary)")
    if not isinstance(head, nn.Linear):
        raise ConfigError(f"train.fused_loss: {type(model).__name__}'s output layer is a {type(head).__module__}.{type(head).__name__}, "
                          "not a torch Linear (with LoRA, leave the output layer out of peft.target_modules)")
    return head


def fuse_output_layer(model: nn.Module, vocab_size: int) -> None:
    """The model's output layer, in place, computes the tokens' losses inside `token_losses`."""
    head = the_output_layer(model, vocab_size)
    head.__class__ = fused_class(type(head))
