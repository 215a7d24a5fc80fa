"""train.fused_loss=true: the output layer returns each token's loss in place of its logits,
computed a chunk of the vocabulary at a time, so that the [tokens, vocab] logits and their gradient
are never held whole.

The loss is computed inside the output layer's own forward (its class gets `ChunkedLoss` mixed
in: `fuse_output_layer`), so each backend's hooks on that layer give it its whole weight, in
forward and again in backward: ZeRO-3 gathers the layer's partitioned weight (a fused loss that
read the weight outside the model's forward would read ZeRO-3's empty partition), FSDP2 unshards
the root that holds it, and a tied weight is the embedding's own. The objective hands the targets
in around the model's forward (`token_losses`); the layer's input must be the hidden states of
those targets' tokens, and the model's logits its output unchanged: `check_output_layer`
(models/checks.py) runs a forward of the model built small on the CPU to see so, before any work.

Each token's loss in fp32 (0 where there is no target), from `ChunkedCrossEntropy`: the output layer's
vocabulary in chunks, each chunk's logits in the compute dtype as the layer makes them, their
log-sum-exp and the loss in fp32, so a bf16 or fp16 run's losses are those of its plain loss (logits
in the compute dtype, cross-entropy in fp32), not rounded to bf16. Backward recomputes each chunk's
logits and scales their gradient by each token's own fp32 gradient before the cast to the compute
dtype: no common factor (1 / tokens) is rounded, and a per-sequence weight (DPO) stays exact. What it
keeps for backward: the layer's input, the tokens' log-sum-exps [tokens] fp32, and the weight
parameter itself, not an alias of it, so that ZeRO-3 frees the gathered weight after forward (and
gathers it again for backward) as it does for any linear layer. torch's `linear_cross_entropy` (used
before) returns bf16 losses for bf16 inputs, takes their gradient in bf16 and keeps a detached alias
of the weight, which ZeRO-3's release leaves alive until backward (1.1 GB bf16 for an 8B model).
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from trainer.errors import ConfigError
from trainer.models.lora import output_layer


@dataclass
class FusedTargets:
    """What the fused output layer reads inside `token_losses`, and what it leaves beside its losses."""
    targets: torch.Tensor  # [b, t]
    ignore_index: int  # the target of no token (its loss is 0)
    mean_logits: torch.Tensor | None = None  # [b, t] fp32, no gradient: each token's logits' mean over the vocabulary


_targets: FusedTargets | None = None  # inside `token_losses`


@contextmanager
def token_losses(targets: torch.Tensor, ignore_index: int) -> Iterator[FusedTargets]:
    """Inside, a model whose output layer is fused returns each token's loss [b, t] (fp32) where it
    returned logits [b, t, vocab]; the context's `mean_logits` are set by that forward (DPO's logits/*)."""
    global _targets
    previous, _targets = _targets, FusedTargets(targets, ignore_index)
    try:
        yield _targets
    finally:
        _targets = previous


class ChunkedLoss:
    """Mixed into the output layer's class (a torch Linear's): inside `token_losses`, its forward
    gives the tokens' losses; outside (a probe, an export), its logits as before."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if _targets is None:
            return super().forward(hidden)
        targets = _targets.targets
        if hidden.shape[:-1] != targets.shape:
            raise RuntimeError(f"train.fused_loss: the output layer's input {tuple(hidden.shape)} is not the hidden "
                               f"states of the targets {tuple(targets.shape)}")
        losses, mean_logits = ChunkedCrossEntropy.apply(hidden.flatten(0, -2), self.weight, self.bias,
                                                        targets.flatten(), _targets.ignore_index)
        _targets.mean_logits = mean_logits.view(targets.shape)
        return losses.view(targets.shape)


def vocabulary_chunks(weight: torch.Tensor) -> list[tuple[int, int]]:
    """The output layer's rows in chunks as wide as its input: a chunk's fp32 logits [tokens, width]
    are twice the bf16 hidden states, never [tokens, vocab]."""
    vocab, width = weight.shape
    return [(start, min(start + width, vocab)) for start in range(0, vocab, width)]


def autocasting(device: torch.device) -> bool:
    return torch.amp.is_autocast_available(device.type) and torch.is_autocast_enabled(device.type)  # meta has none


def compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype the layer's matmul runs in: autocast's (DDP's bf16/fp16), else its input's."""
    return torch.get_autocast_dtype(hidden.device.type) if autocasting(hidden.device) else hidden.dtype


def chunk_logits(hidden, weight, bias, start: int, end: int) -> torch.Tensor:
    """The logits of the vocabulary rows [start, end) in `hidden`'s dtype, as the plain layer makes
    them (autocast's too), in fp32."""
    bias = None if bias is None else bias[start:end].to(hidden.dtype)
    with torch.autocast(hidden.device.type, enabled=False) if autocasting(hidden.device) else nullcontext():
        return F.linear(hidden, weight[start:end].to(hidden.dtype), bias).float()


class ChunkedCrossEntropy(torch.autograd.Function):
    """Each token's cross-entropy loss (fp32 [tokens]) of the logits `linear(hidden, weight, bias)`,
    a chunk of the vocabulary at a time; and, without gradient, each token's logits' mean."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, ignore_index):
        ctx.dtype = compute_dtype(hidden)  # backward runs outside autocast: it makes the same logits
        computed = hidden.to(ctx.dtype)
        counted = targets != ignore_index
        # as cross_entropy does: a target outside the vocabulary is an error, not a loss of log-sum-exp
        # (on CUDA an assertion on the device, no host sync)
        torch._assert_async((((targets >= 0) & (targets < weight.shape[0])) | ~counted).all(),
                            f"train.fused_loss: a target outside the vocabulary [0, {weight.shape[0]})")
        log_sum_exp = torch.full(targets.shape, -torch.inf, device=hidden.device)
        target_logit = torch.zeros(targets.shape, device=hidden.device)
        logit_sum = torch.zeros(targets.shape, device=hidden.device)
        for start, end in vocabulary_chunks(weight):
            logits = chunk_logits(computed, weight, bias, start, end)
            log_sum_exp = torch.logaddexp(log_sum_exp, logits.logsumexp(-1))
            logit_sum += logits.sum(-1)
            inside = (targets >= start) & (targets < end)
            column = (targets - start).clamp(0, end - start - 1).unsqueeze(1)
            target_logit += torch.where(inside, logits.gather(1, column).squeeze(1), 0.0)
        ctx.save_for_backward(computed, weight, bias, targets, log_sum_exp)  # the input as autocast's linear keeps it
        ctx.ignore_index, ctx.input_dtype = ignore_index, hidden.dtype
        mean_logits = logit_sum / weight.shape[0]
        ctx.mark_non_differentiable(mean_logits)
        return torch.where(counted, log_sum_exp - target_logit, 0.0), mean_logits

    @staticmethod
    def backward(ctx, grad_losses, _):
        computed, weight, bias, targets, log_sum_exp = ctx.saved_tensors
        scale = torch.where(targets != ctx.ignore_index, grad_losses, 0.0).unsqueeze(1)  # fp32 [tokens, 1]
        grad_hidden = torch.zeros(computed.shape, device=computed.device) if ctx.needs_input_grad[0] else None
        grad_weight = torch.empty_like(weight) if ctx.needs_input_grad[1] else None
        grad_bias = torch.empty_like(bias) if bias is not None and ctx.needs_input_grad[2] else None
        for start, end in vocabulary_chunks(weight):
            logits = chunk_logits(computed, weight, bias, start, end)
            grad_logits = (logits - log_sum_exp.unsqueeze(1)).exp_()  # the softmax
            inside = (targets >= start) & (targets < end)
            column = (targets - start).clamp(0, end - start - 1).unsqueeze(1)
            grad_logits.scatter_add_(1, column, -inside.float().unsqueeze(1))  # minus one at the target
            grad_logits *= scale
            if grad_bias is not None:
                grad_bias[start:end] = grad_logits.sum(0)
            grad_logits = grad_logits.to(ctx.dtype)
            if grad_weight is not None:
                grad_weight[start:end] = grad_logits.t() @ computed
            if grad_hidden is not None:
                grad_hidden += grad_logits @ weight[start:end].to(ctx.dtype)
        if grad_hidden is not None:
            grad_hidden = grad_hidden.to(ctx.input_dtype)
        return grad_hidden, grad_weight, grad_bias, None, None


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
