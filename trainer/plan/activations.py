"""The planner's count of activation memory (`python -m trainer.plan`): the bytes autograd keeps
from a forward for its backward, counted with the loop's own counter (trainer/saved_bytes.py:
`SavedBytes`, what `mem.activations` measures) around the model's forward and loss on the meta
device (no memory, no compute), at three short lengths (of a model whose blocks are all alike, the
first two blocks, the second's saves counted for each block after it). That gives bytes per token per layer and
outside the layers (the logits' share apart), and any part that grows with the square of the
length. On meta, attention is counted as a fused kernel keeps it (flash / memory-efficient, and
torch's CPU kernel: queries, keys and values, the output and its log-sum-exp; never the
[t, t] probabilities), and data-dependent checks (`.item()`, which meta tensors cannot answer) read 1.
"""
from __future__ import annotations

import dataclasses
import json
import math
import weakref
from collections import OrderedDict
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from trainer.config import StrategyName, model_node, rows_carry_positions
from trainer.losses.objectives import NextToken
from trainer.memory import DTYPE_BYTES
from trainer.models import build_model, sequence
from trainer.models.blocks import apply_checkpointing, find_blocks
from trainer.models.checks import attends_packed_rows
from trainer.models.fused_loss import fuse_output_layer
from trainer.models.lora import output_layer
from trainer.models.tensor_plan import uses_sequence_parallel
from trainer.plan.tensor import hold_local_shares, hold_sequence_shares
from trainer.saved_bytes import SavedBytes


class _FusedAttention(torch.autograd.Function):
    """On meta only: what a fused attention kernel keeps for backward (q, k, v with key/value heads
    as they come, the output, the log-sum-exp per head and query); never run backward."""

    @staticmethod
    def forward(ctx, q, k, v, mask, causal, scale):
        heads = q.shape[-3]
        repeat = (lambda x: x.repeat_interleave(heads // x.shape[-3], -3)) if k.shape[-3] != heads else (lambda x: x)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, repeat(k), repeat(v), 0.0, causal, attn_mask=mask, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, *([mask] if mask is not None else []))
        return out

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("a planning trace never runs backward")


class _AsFusedKernels(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v, *rest = args
            mask = kwargs.get("attn_mask", rest[0] if rest else None)
            causal = kwargs.get("is_causal", rest[2] if len(rest) > 2 else False)
            return _FusedAttention.apply(q, k, v, mask, causal, kwargs.get("scale"))
        return func(*args, **kwargs)


class _MetaItems(TorchDispatchMode):
    """On meta: a data-dependent read (`.item()`) answers 1; torch's grouped matmul (a mixture of
    experts' experts: transformers' grouped_mm) runs in any float dtype, as its CPU kernel does,
    where its meta function asks for bf16 (torch 2.13): it is shaped in bf16, returned in the inputs' dtype."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            return 1
        if func is torch.ops.aten._grouped_mm.default and args[0].is_meta and args[0].dtype != torch.bfloat16:
            a, b, *rest = args
            return func(a.to(torch.bfloat16), b.to(torch.bfloat16), *rest, **(kwargs or {})).to(a.dtype)
        return func(*args, **(kwargs or {}))


@dataclass(frozen=True)
class ActivationCount:
    """Bytes one rank keeps for backward per micro-batch, as a function of the tokens of a row it
    holds (seq_len / sp of each row, at the sp it was counted for)."""
    per_token: float  # per token of a row: every layer, the embeddings, the output layer and the loss
    per_token_squared: float  # x tokens^2 (attention that keeps [t, t]: eager attention, masks)
    constant: float = 0.0  # once a micro-batch, whatever its rows and length
    per_token_per_layer: float = 0.0  # of per_token, what each block keeps (without checkpointing)
    logits_per_token: float = 0.0  # of per_token, the output layer's and loss's [tokens, vocab] share (none: fused)
    sp: int = 1  # counted for strategy.sp: a rank holds seq_len / sp tokens of each row
    exchanged_per_token: float = 0.0  # bytes the forward's all-to-alls carry (sp > 1), per token a rank holds
    # beside everything kept, at the start of backward: the output layer's and loss's gradients (the
    # plain loss: [tokens, vocab] fp32 twice and their cast to the compute dtype), per token a rank holds
    output_backward_per_token: float = 0.0

    def bytes(self, seq_len: int, micro_batch: int = 1) -> int:
        held = seq_len / self.sp
        return int(micro_batch * (self.per_token * held + self.per_token_squared * held * held) + self.constant)

    def longest(self, budget: float, micro_batch: int = 1) -> int:
        """The longest seq_len (a multiple of sp) whose activations fit `budget` bytes (0: none)."""
        a, b = self.per_token_squared * micro_batch, self.per_token * micro_batch
        room = budget - self.constant
        if room <= 0 or b <= 0:
            return 0
        held = room / b if a == 0 else (-b + math.sqrt(b * b + 4 * a * room)) / (2 * a)
        return int(held) * self.sp


class _SameShapeExchange:
    """On meta, in place of the sequence group's all-to-all: a tensor of its output's shape, as a
    differentiable op that keeps nothing (as the all-to-all keeps nothing); counts the bytes it
    carries, in all and in the part of the model `saved` is in."""

    def __init__(self, saved: SavedBytes):
        self.saved = saved
        self.bytes = self.last_block_bytes = 0

    def __call__(self, output: torch.Tensor, input: torch.Tensor, group=None) -> torch.Tensor:
        self.bytes += input.numel() * input.element_size()
        if self.saved.part == LAST_BLOCK:
            self.last_block_bytes += input.numel() * input.element_size()
        return input.clone()


def _autocast_on_meta(device_type: str, *args, **kwargs) -> torch.autocast:
    """torch.autocast, where a meta tensor's device asks for one: the CPU's (meta has no autocast
    dtype). peft 0.21's LoRA on stacked expert parameters folds its delta into the weight under
    `torch.autocast(device_type=W.device.type, enabled=False)`."""
    return _AUTOCAST("cpu" if device_type == "meta" else device_type, *args, **kwargs)


_AUTOCAST = torch.autocast


def packed_positions(tokens: int) -> torch.Tensor:
    """Position ids of a packed row of `tokens` as the planner counts it: two documents (what packing
    costs does not depend on how many: attention keeps no [t, t] tensor, models/sequence.py)."""
    return (torch.arange(tokens) % -(-tokens // 2))[None]


LAST_BLOCK = "last block"  # SavedBytes' part: the saves first made in the last of the blocks traced


def trace(model: nn.Module, blocks: list[nn.Module], loss_of, tokens: int, sp: int = 1,
          packed: bool = False) -> tuple[SavedBytes, _SameShapeExchange]:
    """The saves of one forward and loss of a [1, tokens] row on the meta device, those inside the
    blocks apart ("layers", the last block's `LAST_BLOCK`); at sp > 1, as rank 0 of a sequence-parallel group holding `tokens` of each row
    (attention over the whole row for 1 / sp of the heads, models/sequence.py), and the bytes its
    all-to-alls carried; `packed`: rows of packed documents, whose position ids the model gets
    (`loss_of(model, ids, positions)`: at sp > 1 also plain rows carry theirs in the whole row,
    training/sequence_shares.py)."""
    saved = SavedBytes()
    exchange = _SameShapeExchange(saved)
    parts = ["layers"] * (len(blocks) - 1) + [LAST_BLOCK]
    handles = [h for block, part in zip(blocks, parts) for h in (
        block.register_forward_pre_hook(lambda *_, part=part: setattr(saved, "part", part)),
        block.register_forward_hook(lambda *_: setattr(saved, "part", "outside")))]
    ids = torch.zeros(1, tokens, dtype=torch.long, device="meta")
    group = sequence.SequenceGroup(None, sp, 0)
    whole = packed_positions(tokens * sp) if packed else None  # on the CPU: the documents are found from values
    positions = (group.local(whole) if packed else torch.arange(tokens)[None]).to("meta") if packed or sp > 1 else None
    sharded = sequence.sharded(group, whole)
    try:
        with _MetaItems(), _AsFusedKernels(), mock.patch.object(sequence, "all_to_all_single", exchange), \
                mock.patch.object(torch, "autocast", _autocast_on_meta), sharded, saved:
            loss = loss_of(model, ids, positions)
        saved.kept_by_functions(loss)
    finally:
        for h in handles:
            h.remove()
    return saved, exchange


class _LiveBytes(TorchDispatchMode):
    """The bytes of the tensors the ops inside make (views and in-place results are their inputs'),
    alive at once (`live`), and the most of them (`peak`)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {id(t) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and id(t) not in given and not t._is_view():
                made = t.untyped_storage().nbytes()
                self.live += made
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._free, made)
        return out

    def _free(self, made: int) -> None:
        self.live -= made


def output_backward_bytes(model: nn.Module, vocab: int, fused_loss: bool, tokens: int) -> int:
    """On meta: the most bytes the backward of the output layer and the loss of a [1, tokens] row
    makes alive at once (its weight's gradient left out: that is the gradients' own memory); 0 for a
    model whose logits no linear layer makes (a custom model's `F.linear` on its embedding)."""
    head = output_layer(model, vocab)
    if not isinstance(getattr(head, "weight", None), torch.Tensor) or head.weight.dim() != 2:
        return 0
    trainable = [p for p in head.parameters() if p.requires_grad]
    hidden = torch.zeros(1, tokens, head.weight.shape[1], dtype=head.weight.dtype, device="meta", requires_grad=True)
    targets = torch.zeros(1, tokens, dtype=torch.long, device="meta")
    try:
        for p in trainable:
            p.requires_grad_(False)
        with _LiveBytes() as live, mock.patch.object(torch, "autocast", _autocast_on_meta):
            loss = NextToken(fused=fused_loss).loss_sum(head, [hidden, targets])[0]
            start = live.peak = live.live
            loss.backward()
    finally:
        for p in trainable:
            p.requires_grad_(True)
    return live.peak - start


@dataclass(frozen=True)
class Saves:
    """What one trace of a [1, tokens] row kept: in all, inside the blocks, the logits' share
    (storages of at least tokens x vocab elements outside the blocks), and of the blocks' what the
    last one traced kept first (storages shared with the blocks before it, as the rotary's cos and
    sin, counted in the first); the bytes its all-to-alls carried, in all and in the last block."""
    total: float
    layers: float
    logits: float
    last_block: float
    exchanged: float
    last_block_exchanged: float

    @classmethod
    def of(cls, traced: tuple[SavedBytes, _SameShapeExchange], tokens: int, vocab: int) -> Saves:
        saved, exchange = traced
        last = saved.bytes_of(LAST_BLOCK)
        return cls(saved.bytes, saved.bytes_of("layers") + last, saved.bytes_of("outside", elements_at_least=tokens * vocab),
                   last, exchange.bytes, exchange.last_block_bytes)

    def deeper(self, more: int) -> Saves:
        """With `more` blocks alike the last one after it."""
        return dataclasses.replace(self, total=self.total + more * self.last_block, layers=self.layers + more * self.last_block,
                                   exchanged=self.exchanged + more * self.last_block_exchanged)


_OUTPUT_BACKWARD: dict[tuple, float] = {}


def output_backward_per_token(model: nn.Module, vocab: int, fused_loss: bool, short: int) -> float:
    """`output_backward_bytes` per token (from `short` and 2 x `short` tokens), once per output
    layer shape and loss (whatever sp and checkpointing)."""
    weight = getattr(output_layer(model, vocab), "weight", None)
    key = (vocab, fused_loss, short, *((tuple(weight.shape), weight.dtype) if isinstance(weight, torch.Tensor) else ()))
    if key not in _OUTPUT_BACKWARD:
        one, two = (output_backward_bytes(model, vocab, fused_loss, n) for n in (short, 2 * short))
        _OUTPUT_BACKWARD[key] = (two - one) / short
    return _OUTPUT_BACKWARD[key]


def fit(counts: dict[int, Saves], n_layers: int, logits: bool = True) -> ActivationCount:
    """From the saves at three lengths t, 2t, 4t: f(n) = C + a n + c n^2 for the total, the layers'
    part and the logits' part. C is once a micro-batch, whatever its rows."""
    t = min(counts)

    def parts(f) -> tuple[float, float, float]:
        f1, f2, f4 = (f(counts[n]) for n in (t, 2 * t, 4 * t))
        # differences: f2 - f1 = a t + 3 c t^2, f4 - f2 = 2 a t + 12 c t^2
        c = max((f4 - f2) - 2 * (f2 - f1), 0) / (6 * t * t)
        a = ((f2 - f1) - 3 * c * t * t) / t
        return a, c, max(f1 - a * t - c * t * t, 0)

    total, squared, constant = parts(lambda s: s.total)
    layers = parts(lambda s: s.layers)[0]
    logits_per_token = parts(lambda s: s.logits)[0] if logits else 0.0
    return ActivationCount(total, squared, constant, layers / max(n_layers, 1), max(logits_per_token, 0.0))


def _signature(block: nn.Module) -> list:
    """What makes blocks alike for the bytes they keep: their modules' classes, settings (a
    sliding window, a layer's kind; its index left out) and parameter shapes."""
    def settings(m: nn.Module) -> list:
        return sorted((k, repr(v)) for k, v in vars(m).items()
                      if isinstance(v, (bool, int, float, str, tuple, type(None))) and "layer_id" not in k)
    return [(name, type(m).__name__, settings(m),
             [(n, tuple(t.shape), t.dtype) for n, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]])
            for name, m in block.named_modules()]


def alike_stack(model: nn.Module, blocks: list[nn.Module]) -> nn.ModuleList | None:
    """The ModuleList that holds `blocks` and nothing else, where the blocks are all alike and the
    model names no kinds of layers; else None (traced whole)."""
    kinds = getattr(getattr(model, "config", None), "layer_types", None)
    if len(blocks) < 2 or (kinds and len(set(kinds)) > 1):
        return None
    first = _signature(blocks[0])
    if any(_signature(b) != first for b in blocks[1:]):
        return None
    ids = [id(b) for b in blocks]
    return next((m for m in model.modules() if isinstance(m, nn.ModuleList) and [id(c) for c in m.children()] == ids), None)


@contextmanager
def first_blocks(stack: nn.ModuleList, n: int):
    """`stack` holding only its first `n` modules, within."""
    whole = stack._modules
    stack._modules = OrderedDict(list(whole.items())[:n])
    try:
        yield
    finally:
        stack._modules = whole


_COUNTS: dict[str, ActivationCount] = {}


def inputs_without_gradient(model: nn.Module, blocks: list[nn.Module], modules: list[nn.Module]) -> set[int]:
    """ids of `modules` whose input needs no gradient in a forward and loss of `model` on the meta device: with
    frozen parameters (LoRA's base), those before any that trains (the first block's attention's input
    projections, reading the frozen embedding's output), whose input's gradient autograd never computes (nor a
    tensor group all-reduces). Of a model whose blocks are all alike, the first two traced (a later one's input
    needs a gradient wherever the first two's adapters train)."""
    quiet: set[int] = set()

    def note(module, args):
        if args and isinstance(args[0], torch.Tensor) and not args[0].requires_grad:
            quiet.add(id(module))

    hooks = [m.register_forward_pre_hook(note) for m in modules]
    objective = NextToken(fused=False)
    stack = alike_stack(model, blocks)
    try:
        with first_blocks(stack, 2) if stack else nullcontext():
            trace(model, [], lambda m, ids, positions: objective.loss_sum(m, [ids, ids.clone()])[0], 8)
    finally:
        for h in hooks:
            h.remove()
    return quiet


def planned(cfg, checkpointing: bool, fused_loss: bool, sp: int = 1, short: int = 64, tp: int = 1) -> ActivationCount:
    """The activations of `cfg`'s model (a Config) per micro-batch and rank, counted on the meta
    device in the training dtype, built as the trainer builds it: activation checkpointing per
    block, with train.fused_loss the output layer that gives each token's loss
    (models/fused_loss.py), at strategy.sp=`sp` the rank's share of each row through Ulysses
    attention (the all-to-alls exchanged for a copy of the same shape, their bytes counted), at
    strategy.tp=`tp` as a rank of the tensor group of cfg's strategy (each split layer holding its share of the weights:
    its heads, its features, its logits; what the group sums is whole, as the blocks' inputs, or with
    strategy.tp_sequence_parallel and the model's `_tp_sequence_plan` its 1 / tp of the sequence), on rows
    of packed documents where the data packs them (`rows_carry_positions`)."""
    dtype = {4: torch.float32, 2: torch.bfloat16}[DTYPE_BYTES[cfg.train.precision]]
    packed = rows_carry_positions(cfg)
    strategy = StrategyName(cfg.strategy.name)  # on zero1/2/3 (AutoTP) the embeddings stay whole, the norms too
    key = json.dumps([model_node(cfg.model), str(cfg.peft), cfg.strategy.wrap, str(dtype), checkpointing, fused_loss,
                      sp, packed, tp, cfg.strategy.tp_sequence_parallel, strategy.value], default=str)
    if key not in _COUNTS:
        attended = packed and attends_packed_rows(cfg.model)  # else transformers' own, with its packed mask
        model = build_model(cfg.model, torch.device("meta"), cfg.peft, sp, attended).to(dtype)
        # the norms sequence-parallel as the run takes them (fsdp's, where the plan declares it)
        sequence_parallel = uses_sequence_parallel(dataclasses.replace(cfg.strategy, tp=tp), model)
        if tp > 1:
            hold_local_shares(model, tp, strategy)
        exchanges = hold_sequence_shares(model, tp) if sequence_parallel else []
        if fused_loss:
            fuse_output_layer(model, cfg.model.vocab_size)
        blocks = find_blocks(model, cfg.strategy.wrap)
        if checkpointing:
            apply_checkpointing(model, blocks)
            # a checkpointed block keeps what its wrapper does (its input)
            wrappers = {id(m._checkpoint_wrapped_module): m for m in model.modules() if isinstance(m, CheckpointWrapper)}
            blocks = [wrappers.get(id(b), b) for b in blocks]
        objective = NextToken(fused=fused_loss)

        def loss_of(m, ids, positions):
            # the targets a tensor of their own, as a batch's are (the fused loss keeps them: 8 bytes a token)
            return objective.loss_sum(m, [ids, ids.clone(), *([positions] if positions is not None else [])])[0]

        lengths = (short, 2 * short, 4 * short)
        vocab = cfg.model.vocab_size

        # blocks all alike: the first two traced, the second's saves counted for every one after it
        # (the whole depth traced: seconds for a 7B model, once per sp, fused loss and checkpointing)
        stack = alike_stack(model, blocks)
        traced = blocks[:2] if stack else blocks
        with first_blocks(stack, 2) if stack else nullcontext():
            # strategy.tp: a rank's logits are its 1 / tp of the vocabulary
            counts = {n: Saves.of(trace(model, traced, loss_of, n, sp, packed), n, vocab // tp).deeper(len(blocks) - len(traced))
                      for n in lengths}
        for exchange in exchanges:  # the output layer's backward below takes its input whole
            exchange.remove()
        _COUNTS[key] = dataclasses.replace(fit(counts, len(blocks), logits=not fused_loss),
                                           sp=sp, exchanged_per_token=counts[short].exchanged / short,
                                           output_backward_per_token=output_backward_per_token(model, vocab, fused_loss, short))
    return _COUNTS[key]
