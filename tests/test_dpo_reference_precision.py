"""Full fine-tuning's frozen copy computes as the policy does at its start, in
bf16 on ddp too (the policy: fp32 parameters under autocast, norms and embeddings in fp32)."""
from __future__ import annotations

import torch

from tests.harness import case, on_ranks, with_overrides


def start_logps(env, precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(the policy's log-probs at its start, in eval mode under the strategy's autocast; the frozen
    copy's, as the objective reads them) of two sequences, on the tiny built-in model."""
    from trainer.config import to_config
    from trainer.distributed import seed_everything
    from trainer.losses.objectives import Reference, sequence_logps
    from trainer.strategies import build_strategy
    from trainer.training.dpo_reference import frozen_copy
    from trainer.training.setup import setup_model

    cfg = to_config(with_overrides(case("ddp"), train__precision=precision))
    seed_everything(0)
    strategy = build_strategy(cfg, env)
    policy, _, _, _ = setup_model(cfg, strategy)
    frozen = frozen_copy(cfg, strategy)
    seq = cfg.model.seq_len
    ids = torch.arange(2 * seq).view(2, seq) % cfg.model.vocab_size
    batch = (ids, ids.roll(-1, 1), torch.arange(seq).repeat(2, 1), torch.tensor([0, 1]).repeat_interleave(seq).view(2, seq))
    policy.eval()
    with torch.no_grad(), strategy.autocast():
        policy_logps = sequence_logps(policy, batch, fused=False)[0]
    reference_logps = Reference(autocast=strategy.autocast, frozen=frozen).logps(policy, batch, torch.tensor([0, 1]))
    strategy.teardown()
    return policy_logps, reference_logps


def test_the_frozen_copy_gives_the_policys_log_probs_in_bf16_on_ddp():
    policy, reference = on_ranks(1, start_logps, "bf16")[0]
    assert torch.equal(policy, reference), (policy, reference)
