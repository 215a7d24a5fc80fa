"""The router's load-balancing loss of a mixture-of-experts model (docs/design.md, Mixtures of experts), added to any objective.

A Hugging Face MoE family whose causal LM has `router_aux_loss_coef` (Mixtral, Qwen2-MoE, Qwen3-MoE,
OLMoE, gpt-oss, ...) adds, when its config's `output_router_logits` is true (or
`model.router_aux_loss=true`), `router_aux_loss_coef * aux` to its loss, with transformers'
`load_balancing_loss_func` (the same in every family of transformers 5.24, Switch Transformer's
eqs. 4-6): over all MoE layers' tokens, f_e the fraction of top-k choices that went to expert e and
P_e the mean router probability of e, aux = E * sum_e f_e P_e. None of these families defines a
router z-loss; DeepSeek-V3 balances with a routing bias and has no such loss (refused if asked for).

How the statistics are taken here: per sequence (each document of each row: f and P over the
document's own tokens, up to its last target: padding routes nowhere; a packed row's documents are
told apart by their position ids, which restart at each one). transformers takes them over the
micro-batch it is given, which makes the loss depend on how rows are grouped into micro-batches, so
on micro_batch_size and, at a fixed global batch, on the world size, and on packing. Per document,
the loss is the same at any world size and accumulation, packed or padded, and a micro-batch of one
unpacked row gives transformers' own number. A row's aux is its documents' aux weighted by their
target tokens. A row's aux counts in the step's mean as its token losses do: weighted by its units
(target tokens; pairs for dpo), so `loss` = (sum of token losses + coef * sum of units_row *
aux_row) / units of the step, all ranks, which the loop already divides by. Global-batch statistics (arXiv 2501.11873: f
all-reduced over data-parallel ranks) are not offered: exact, they need every micro-batch's routing
before the first backward (a second forward); approximated per micro-batch, they change with the
accumulation. At strategy.sp > 1 a row's tokens are spread over the sequence-parallel group: its
counts, token count and units are summed over the group (no gradient); each rank's share of the
probabilities carries its own gradient, and the shares' aux values add up to the row's.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trainer.data.sources import IGNORE_INDEX
from trainer.errors import ConfigError
from trainer.models.sequence import SequenceGroup

AUX = "aux_loss"  # the step record's and the validation line's field: the mean aux over rows, by units


def moe_causal_lm(model: nn.Module) -> nn.Module | None:
    """The module of `model` (wrapped, sharded, with adapters) that computes a load-balancing loss:
    a transformers causal LM with `router_aux_loss_coef`; None for a model without one."""
    for module in model.modules():
        # its transformers config: a DeepSpeed engine passes the model's attributes through, not its config
        if all(hasattr(module, a) for a in ("router_aux_loss_coef", "num_experts", "num_experts_per_tok")) \
                and hasattr(getattr(module, "config", None), "output_router_logits"):
            return module
    return None


def router_loss_on(model: nn.Module) -> bool:
    """Whether the model's config asks for the router's loss (and the model has one)."""
    lm = moe_causal_lm(model)
    return lm is not None and bool(getattr(lm.config, "output_router_logits", False))


def check_router_loss(asked: bool | None, model: nn.Module) -> None:
    """model.router_aux_loss=true on a model without a load-balancing loss: one line, before any work."""
    if asked and moe_causal_lm(model) is None:
        raise ConfigError("model.router_aux_loss: this model has no router load-balancing loss (a Hugging Face "
                          "mixture-of-experts causal LM with router_aux_loss_coef: Mixtral, Qwen2/3-MoE, OLMoE, "
                          "gpt-oss, ...); DeepSeek-V3 balances with a routing bias instead")


class RouterLogits:
    """The routers' logits of a causal LM's forward, for the trainer's statistics: kept by forward
    hooks on its routers (the modules, and the output, transformers itself records `router_logits`
    from: its `_can_record_outputs`), while transformers' own recording and loss stay off
    (models/hf.py: without_transformers_aux). The hooks are made before the model's first forward
    and stay, switched by a flag: a compiled block traces the hooks it has at its first forward
    only, with the flag guarded. Each router keeps its logits on itself, not in a list: a list that
    grows layer by layer would compile the block again for every layer."""

    def __init__(self, lm: nn.Module):
        self.lm, self.on = lm, False
        spec = lm._can_record_outputs["router_logits"]
        self.index = spec.index
        layer = f".{spec.layer_name.strip('.')}." if spec.layer_name else "."  # as transformers matches it
        self.routers = [module for name, module in lm.named_modules()
                        if isinstance(module, spec.target_class) and layer in f".{name}."]
        for router in self.routers:
            router.kept_logits = None
            router.register_forward_hook(self._keep)
        lm.register_forward_hook(self._stop)

    def _keep(self, router: nn.Module, _args, output) -> None:
        if self.on:
            router.kept_logits = output[self.index] if isinstance(output, tuple) else output

    def _stop(self, *_) -> None:
        self.on = False  # the first forward's only: dpo's reference may run the same model after it

    @contextmanager
    def first_forward(self) -> Iterator[list[torch.Tensor]]:
        """The routers' logits of the first forward of the model within the block, filled at its end.
        Nothing is kept outside the block: activation checkpointing's forwards again in the backward."""
        logits: list[torch.Tensor] = []
        self.on = True
        try:
            yield logits
            logits.extend(router.kept_logits for router in self.routers)
            assert all(kept is not None for kept in logits), "a router of the model did not run in its forward"
        finally:
            self.on = False
            for router in self.routers:
                router.kept_logits = None  # not held past the step


def router_logits(model: nn.Module) -> RouterLogits | None:
    """The hooks that keep the routers' logits, where the model's config asks for the router's loss;
    made before the model's first forward (dpo's precomputed reference runs one before training)."""
    return RouterLogits(moe_causal_lm(model)) if router_loss_on(model) else None


def documents(batch, group: SequenceGroup) -> tuple[torch.Tensor, int]:
    """([b, t] each token's document within its whole row, the most documents a row has). Packed rows
    (chat, dpo) carry position ids, restarting at 0 at each document; other rows are one document.
    At sp > 1 the documents begun on the group's earlier ranks are counted in."""
    if len(batch) < 3:  # rows without position ids (at sp > 1 every share carries them)
        return torch.zeros_like(batch[1]), 1
    number = (batch[2] == 0).long().cumsum(-1)
    begun = number[:, -1].contiguous()  # [b] the documents begun in this share
    earlier, total = torch.zeros_like(begun), begun
    if group.size > 1:
        counts = [torch.empty_like(begun) for _ in range(group.size)]
        dist.all_gather(counts, begun, group=group.group)
        earlier, total = sum(counts[:group.rank], earlier), sum(counts)
    return number + earlier[:, None] - 1, int(total.max())


def real_tokens(targets: torch.Tensor, docs: torch.Tensor, n_docs: int, group: SequenceGroup) -> torch.Tensor:
    """[b, t] 1.0 where a token is not padding: up to its document's last target (of the whole row:
    at sp > 1 the last target may be on a later rank of the group). Padding routes nowhere."""
    t = targets.shape[1]
    positions = (torch.arange(t, device=targets.device) + group.rank * t).expand_as(targets)  # within the whole row
    last = torch.full((targets.shape[0], n_docs), -1, device=targets.device, dtype=positions.dtype)
    last = last.scatter_reduce(1, docs, torch.where(targets != IGNORE_INDEX, positions, -1), "amax")
    if group.size > 1:
        dist.all_reduce(last, op=dist.ReduceOp.MAX, group=group.group)
    return (positions <= last.gather(1, docs)).float()


def balance_sums(router_logits: tuple[torch.Tensor, ...], docs: torch.Tensor, n_docs: int, mask: torch.Tensor,
                 top_k: int, experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per document of each row, over all MoE layers: (top-k choices per expert [b, D, E], without
    gradient; the summed router probabilities per expert [b, D, E]; the routed tokens [b, D], each
    token once per layer). All layers at once: one softmax and one top-k over their stacked logits,
    one histogram of the choices, the probabilities summed over the layers before the documents."""
    b, t = mask.shape
    p = F.softmax(torch.stack(router_logits).float(), dim=-1).view(len(router_logits), b, t, experts)
    chosen = torch.topk(p.detach(), top_k, dim=-1).indices  # [L, b, t, k]
    document = torch.arange(b, device=docs.device)[:, None] * n_docs + docs  # [b, t] numbered over the micro-batch
    routed = mask[None, ..., None].expand(chosen.shape)  # padding routes nowhere
    choices = torch.zeros(b * n_docs * experts, device=mask.device).index_add_(
        0, (document[None, ..., None] * experts + chosen).flatten(), routed.flatten())
    in_document = F.one_hot(docs, n_docs).to(mask.dtype) * mask[..., None]  # [b, t, D]
    probs = torch.einsum("btd,lbte->bde", in_document, p)
    return choices.view(b, n_docs, experts), probs, in_document.sum(1) * len(router_logits)


class RouterBalanced:
    """An objective (`NextToken`, `DirectPreference`) plus the router's load-balancing loss, per row
    (see the top), and its mean as the statistic `aux_loss`."""

    def __init__(self, inner, routers: RouterLogits, group: SequenceGroup):
        self.inner, self.routers, self.group = inner, routers, group
        lm = routers.lm
        self.coef = float(lm.router_aux_loss_coef)
        self.experts, self.top_k = int(lm.num_experts), int(lm.num_experts_per_tok)
        self.stats = (*inner.stats, AUX)

    def count(self, batch) -> torch.Tensor:
        return self.inner.count(batch)

    def evaluation(self, split: str) -> RouterBalanced:
        return RouterBalanced(self.inner.evaluation(split), self.routers, self.group)

    def loss_sum(self, model: nn.Module, batch) -> tuple[torch.Tensor, torch.Tensor]:
        with self.routers.first_forward() as logits:  # the policy's forward comes first
            loss, stats = self.inner.loss_sum(model, batch)
        aux = self.weighted_aux(tuple(logits), batch)
        return loss + self.coef * aux, torch.cat([stats, aux.detach().view(1).to(stats.dtype)])

    def weighted_aux(self, router_logits, batch) -> torch.Tensor:
        """sum over rows of units_row * aux_row: this rank's share of it (all of it at sp=1). A row's aux
        is its documents' aux, weighted by their target tokens (one document: its own aux)."""
        docs, n_docs = documents(batch, self.group)
        mask = real_tokens(batch[1], docs, n_docs, self.group)
        choices, probs, tokens = balance_sums(router_logits, docs, n_docs, mask, self.top_k, self.experts)
        targets = torch.zeros_like(tokens).scatter_add(1, docs, (batch[1] != IGNORE_INDEX).float())
        # a row's units from the whole row (strategy.sp: a DPO pair's two sequences may lie in two shares)
        rows = [self.group.whole(field) for field in batch]
        row_units = torch.stack([self.inner.count([field[i:i + 1] for field in rows]) for i in range(mask.shape[0])])
        b, e = mask.shape[0], self.experts
        whole = torch.cat([choices.flatten(), tokens.flatten(), targets.flatten()])
        if self.group.size > 1:  # the whole rows' counts; the probabilities stay this rank's share
            dist.all_reduce(whole, group=self.group.group)
        choices, tokens, targets = whole.split([b * n_docs * e, b * n_docs, b * n_docs])
        row_units = row_units.to(whole.dtype)
        choices, tokens, targets = choices.view(b, n_docs, e), tokens.view(b, n_docs), targets.view(b, n_docs)
        tokens = tokens.clamp(min=1)  # a document without tokens has no targets either: it adds 0
        aux = self.experts * ((choices / tokens[..., None]) * (probs / tokens[..., None])).sum(-1)  # [b, D]
        row_aux = (targets * aux).sum(1) / targets.sum(1).clamp(min=1)
        return (row_units * row_aux).sum()


def with_router_loss(objective, routers: RouterLogits | None, group: SequenceGroup):
    """`objective` with the router's loss where the model's config asks for it (`router_logits`); else as it is."""
    return objective if routers is None else RouterBalanced(objective, routers, group)


def language_loss(objective, loss: float, stats: dict) -> float:
    """A mean loss without the router's term (what a perplexity is of)."""
    return loss - getattr(objective, "coef", 0.0) * stats.get(AUX, 0.0)


def start_words(objective) -> str:
    """The start line's words for the router's loss, where it is on."""
    if not isinstance(objective, RouterBalanced):
        return ""
    return (f" router_aux_loss=on (coef {objective.coef:g}, top-{objective.top_k} of {objective.experts} experts, "
            "balance statistics per sequence)")
