"""TRL's other DPO metrics, with TRL 1.16's definitions: `logps/chosen|rejected`
the policy's summed log-probabilities of the responses, means over the pairs; `logits/chosen|rejected`
the mean over the vocabulary of the policy's logits at each response token, means over the tokens."""
from __future__ import annotations

import torch
from torch import nn

from trainer.config import ObjectiveConfig, ObjectiveName
from trainer.data.sources import IGNORE_INDEX
from trainer.losses.objectives import DirectPreference, Reference, record


class FixedLogits(nn.Module):
    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.logits = logits

    def forward(self, ids, position_ids=None):
        return self.logits


def test_logps_are_means_over_pairs_and_logits_means_over_response_tokens():
    torch.manual_seed(0)
    vocab, width = 7, 12
    # one row, two pairs: pair 0 (sequences 0, 1) with 1 and 2 response tokens, pair 1 (2, 3) with 4 and 1
    spans = {0: (0, 2), 1: (2, 5), 2: (5, 10), 3: (10, 12)}
    sequence = torch.full((1, width), -1)
    targets = torch.full((1, width), IGNORE_INDEX)
    for number, (start, end) in spans.items():
        sequence[0, start:end] = number
        targets[0, start + 1:end] = torch.randint(vocab, (end - start - 1,))  # the first position is the prompt's
    logits = torch.randn(1, width, vocab) * 3
    batch = (torch.zeros(1, width, dtype=torch.long), targets, torch.zeros(1, width, dtype=torch.long), sequence)
    table = torch.tensor([-1.0, -2.0, -3.0, -4.0])
    objective = DirectPreference(ObjectiveConfig(name=ObjectiveName.dpo), Reference(table))
    _, sums = objective.loss_sum(FixedLogits(logits), batch)
    got = record(objective.stats, sums, objective.count(batch))

    token_logps = torch.log_softmax(logits[0], -1)
    logps, mean_logits, tokens = {}, {}, {}
    for number, (start, end) in spans.items():
        positions = range(start + 1, end)
        logps[number] = sum(token_logps[i, targets[0, i]] for i in positions)
        mean_logits[number] = sum(logits[0, i].mean() for i in positions)
        tokens[number] = len(positions)
    expected = {"logps/chosen": (logps[0] + logps[2]) / 2, "logps/rejected": (logps[1] + logps[3]) / 2,
                "logits/chosen": (mean_logits[0] + mean_logits[2]) / (tokens[0] + tokens[2]),
                "logits/rejected": (mean_logits[1] + mean_logits[3]) / (tokens[1] + tokens[3]),
                "rewards/chosen": 0.1 * (logps[0] + 1 + logps[2] + 3) / 2}
    for name, value in expected.items():
        assert abs(got[name] - float(value)) < 1e-5, (name, got[name], float(value))
    assert not any(name.startswith("tokens/") for name in got), got
