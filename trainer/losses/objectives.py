"""What a micro-batch's loss is (`objective=lm|dpo`), and the units a step's loss is the mean over.

The loop sums an objective's losses over a step's micro-batches and divides by the step's units
of all ranks (target tokens for lm, pairs for dpo), counted from the batches before any forward:
the same mean at any world size and accumulation (docs/design.md, The loss; for DPO, trl#2615 is what goes
wrong otherwise). Each objective also sums its own statistics (DPO's rewards), reduced and
divided the same way where a step is logged.

DPO (TRL 1.16's DPOTrainer): a response's log-probability is the sum over its own target tokens;
with the reference's, the log-ratios r_c = logp_c - ref_c and r_r = logp_r - ref_r give
sigmoid: -log sigmoid(beta (r_c - r_r)); ipo: ((r_c / n_c - r_r / n_r) - 1 / (2 beta))^2, n the
response's tokens. Rewards are beta r_c and beta r_r; accuracy is reward_c > reward_r. As TRL's
step records: `logps/*` the policy's log-probabilities of the responses, means over the pairs;
`logits/*` the mean over the vocabulary of the policy's logits at each response token, means over
the tokens.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from trainer.config import DpoLoss, ObjectiveConfig
from trainer.data.sources import IGNORE_INDEX
from trainer.models import logits_of
from trainer.models.fused_loss import token_losses
from trainer.models.sequence import WHOLE_ROWS, SequenceGroup

REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")
# summed per micro-batch like the rewards; logits/* are means over the responses' tokens, summed
# beside them (tokens/*, not recorded), the others means over the pairs
DPO_STATS = (*REWARDS, "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected", "tokens/chosen",
             "tokens/rejected")
PER_TOKEN = {"logits/chosen": "tokens/chosen", "logits/rejected": "tokens/rejected"}


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The sum (not the mean) of the token cross-entropies, in fp32; padding is no target. Logits split
    over the vocabulary (strategy.tp: a DTensor, its loss computed in the strategy's loss_parallel)
    give a loss every rank of the tensor group holds alike: its value, as a plain tensor."""
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")
    return loss.full_tensor() if hasattr(loss, "full_tensor") else loss


def target_count(targets: torch.Tensor) -> torch.Tensor:
    return (targets != IGNORE_INDEX).sum()


def forward(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The logits of a micro-batch (inputs, targets[, position_ids, ...]). Rows of packed
    conversations carry position ids, restarting at each one: the model keeps attention within each."""
    inputs, _, *position_ids = batch
    return logits_of(model(inputs, position_ids=position_ids[0]) if position_ids else model(inputs))


class Objective(Protocol):
    stats: tuple[str, ...]  # the names of the statistics `loss_sum` sums (step-record fields)

    def count(self, batch) -> torch.Tensor:
        """The units of a micro-batch that its loss is summed over (before any forward)."""

    def loss_sum(self, model: nn.Module, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(the summed loss of a micro-batch, with gradients; its summed statistics, without)."""

    def evaluation(self, split: str) -> Objective:
        """The objective of another split's rows (validation)."""


class NextToken:
    """objective=lm: the summed token loss over the target tokens. `fused` (train.fused_loss): the
    model's output layer gives each token's loss itself (models/fused_loss.py), never the logits."""
    stats: tuple[str, ...] = ()

    def __init__(self, fused: bool = False):
        self.fused = fused

    def count(self, batch) -> torch.Tensor:
        return target_count(batch[1])

    def loss_sum(self, model: nn.Module, batch) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused:
            with token_losses(batch[1], IGNORE_INDEX):
                loss = forward(model, batch).float().sum()
        else:
            loss = token_loss_sum(forward(model, batch), batch[1])
        return loss, torch.zeros(0, device=batch[1].device)

    def evaluation(self, split: str) -> NextToken:
        return self


def per_sequence(values: torch.Tensor, targets: torch.Tensor, sequence: torch.Tensor, group: SequenceGroup = WHOLE_ROWS
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the sum of `values` [..., b, t] over each sequence's targets [..., sequences], its number of
    targets, its number), for the sequences of the micro-batch that have targets, in the order of
    their numbers: a pair's chosen (2 p) then its rejected (2 p + 1). Positions without a target
    count for nothing (a validation slot that repeats a row without targets, too). At strategy.sp > 1
    each rank of the `group` holds a share of every row: the sums are over the whole rows, on every
    rank of the group, with gradients to each rank's own tokens."""
    targeted = targets.flatten() != IGNORE_INDEX
    whole_targets, whole_sequence = group.whole(targets), group.whole(sequence)
    numbers = torch.unique(whole_sequence[whole_targets != IGNORE_INDEX])
    which = torch.searchsorted(numbers, sequence.flatten()[targeted])
    sums = torch.zeros(*values.shape[:-2], len(numbers), dtype=values.dtype, device=values.device)
    sums = sums.index_add(-1, which, values.flatten(-2)[..., targeted])
    return group.summed(sums), group.summed(torch.bincount(which, minlength=len(numbers))), numbers


def token_logps(model: nn.Module, batch, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(each token's log-probability of its target [b, t] fp32, 0 where there is none; each token's
    logits' mean over the vocabulary [b, t] fp32, without gradient). `fused` (train.fused_loss): from
    the model's fused output layer (models/fused_loss.py), never the [b, t, vocab] logits."""
    if fused:
        with token_losses(batch[1], IGNORE_INDEX) as layer:
            losses = forward(model, batch)
        return -losses, layer.mean_logits
    logits = forward(model, batch)
    losses = F.cross_entropy(logits.float().flatten(0, 1), batch[1].flatten(), ignore_index=IGNORE_INDEX,
                             reduction="none")
    return -losses.view(batch[1].shape), logits.detach().float().mean(-1)


def sequence_logps(model: nn.Module, batch, fused: bool, group: SequenceGroup = WHOLE_ROWS
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the summed log-probability of each sequence's targets, its number of targets, its number, the
    sum of its target tokens' mean logits): `per_sequence` of `token_logps`."""
    logps, mean_logits = token_logps(model, batch, fused)
    sums, lengths, numbers = per_sequence(torch.stack([logps, mean_logits]), batch[1], batch[3], group)  # one pass
    return sums[0], lengths, numbers, sums[1]


def pair_count(batch) -> torch.Tensor:
    """The pairs of a micro-batch: its sequences with targets, two a pair (data/preference.py keeps
    only pairs whose responses both have one)."""
    targets, sequence = batch[1], batch[3]
    return torch.unique(sequence[targets != IGNORE_INDEX]).numel() // 2


def adapters_off(model: nn.Module):
    """The model's LoRA adapters switched off for a block (peft's own switch on each adapted layer)."""
    from trainer.models.lora import adapters_disabled

    return adapters_disabled(model)


class Reference:
    """The reference's log-probabilities of a micro-batch's sequences, by sequence number: the
    policy's own model with its LoRA adapters off (none of `table`, `frozen`, `adapters`), a table
    computed before training (`table`, by sequence number of the split), a frozen copy of the
    starting model (`frozen`, from Strategy.setup_frozen), or the policy's model with the adapters
    it started from in place of its own (`adapters`: models.lora.StartingAdapters, peft.init).
    Always in eval mode, never with gradients."""

    def __init__(self, table: torch.Tensor | None = None, autocast=nullcontext, frozen: nn.Module | None = None,
                 adapters=None, fused: bool = False, sequence: SequenceGroup = WHOLE_ROWS):
        self.table, self.autocast, self.frozen, self.adapters = table, autocast, frozen, adapters
        self.fused = fused  # train.fused_loss: the model's (and the frozen copy's) output layer is fused
        self.sequence = sequence  # strategy.sp: the ranks that hold shares of the same rows

    @torch.no_grad()
    def logps(self, model: nn.Module, batch, numbers: torch.Tensor) -> torch.Tensor:
        if self.table is not None:
            return self.table.to(numbers.device)[numbers].float()
        if self.frozen is not None:
            model, switch = self.frozen, nullcontext()
        else:
            switch = self.adapters.applied(model) if self.adapters is not None else adapters_off(model)
        was_training = model.training
        model.eval()  # no dropout in the reference (trl#1652)
        try:
            with switch, self.autocast():
                logps, _, ref_numbers, _ = sequence_logps(model, batch, self.fused, self.sequence)
        finally:
            model.train(was_training)
        assert torch.equal(ref_numbers, numbers)
        return logps


class DirectPreference:
    """objective=dpo: the summed pair losses of a micro-batch, and its summed statistics (DPO_STATS)."""
    stats = DPO_STATS

    def __init__(self, cfg: ObjectiveConfig, reference: Reference, splits: dict | None = None, fused: bool = False,
                 sequence: SequenceGroup = WHOLE_ROWS):
        self.cfg, self.beta, self.loss, self.fused = cfg, cfg.beta, DpoLoss(cfg.loss), fused
        self.sequence = sequence  # strategy.sp: each rank holds a share of the rows, the pairs are the group's
        self.reference = reference
        self.splits = splits or {}  # split name -> its own table (validation pairs are numbered apart)

    def count(self, batch) -> torch.Tensor:
        return torch.tensor(pair_count(batch), device=batch[1].device)

    def evaluation(self, split: str) -> DirectPreference:
        """The same loss against another split's reference (a table of its own, where precomputed)."""
        return DirectPreference(self.cfg, self.splits.get(split, self.reference), self.splits, self.fused, self.sequence)

    def loss_sum(self, model: nn.Module, batch) -> tuple[torch.Tensor, torch.Tensor]:
        logps, lengths, numbers, mean_logits = sequence_logps(model, batch, self.fused, self.sequence)
        mean_logits = mean_logits.view(-1, 2)
        ref = self.reference.logps(model, batch, numbers)
        ratios = (logps - ref).view(-1, 2)  # [pair, chosen | rejected]
        if self.loss is DpoLoss.sigmoid:
            losses = -F.logsigmoid(self.beta * (ratios[:, 0] - ratios[:, 1]))
        else:  # ipo: per-token log-ratios (TRL normalises by the response's tokens)
            per_token = ratios / lengths.view(-1, 2).clamp(min=1)
            losses = (per_token[:, 0] - per_token[:, 1] - 1 / (2 * self.beta)) ** 2
        rewards, pair_logps = self.beta * ratios.detach(), logps.detach().view(-1, 2)
        stats = torch.stack([rewards[:, 0].sum(), rewards[:, 1].sum(), (rewards[:, 0] > rewards[:, 1]).float().sum(),
                             (rewards[:, 0] - rewards[:, 1]).sum(), *pair_logps.sum(0), *mean_logits.sum(0),
                             *lengths.view(-1, 2).sum(0).to(rewards.dtype)])
        # strategy.sp: every rank of the group has every pair's loss; each takes 1 / sp of it, whose
        # gradient the group's all-reduce sums back to the whole (per_sequence), and the first its statistics
        first_in_group = self.sequence.rank == 0
        return losses.sum() / self.sequence.size, stats if first_in_group else torch.zeros_like(stats)


def record(stats: tuple[str, ...], sums: torch.Tensor, loss_units: torch.Tensor) -> dict:
    """An objective's statistics as step-record fields: their means over the units of all ranks, or
    (PER_TOKEN) over the tokens summed beside them, which are not recorded."""
    summed = dict(zip(stats, sums))
    return {name: (value / (summed[PER_TOKEN[name]] if name in PER_TOKEN else loss_units)).item()
            for name, value in summed.items() if name not in PER_TOKEN.values()}
