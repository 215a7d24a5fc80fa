"""ZeRO-3's start moves no parameter values between ranks: each rank builds its partitions under
zero.Init and fills them from the weights itself, so neither the build nor deepspeed.initialize
broadcasts or gathers a parameter (DeepSpeed alone sends the whole model twice: rank 0's initial
values to every rank as each parameter is made, then every parameter gathered whole to register
its gradient hook). The partitions hold the stored values, and the model computes from_pretrained's
loss (the small parameters, which ZeRO-3 keeps whole on every rank, included). The same with the
experts split (strategy.ep=2), whose modules are partitioned again over the ranks that hold them."""
from __future__ import annotations

import pytest
import torch

from tests.harness import CollectiveBytes, case, full_state, on_ranks, with_overrides
from tests.test_core_behaviour import build, loss_of


def started(env, path: str, ep: int) -> tuple[dict, dict | None, float]:
    """What the start sent, the weights it gave (whole, on rank 0), and the loss of a fixed batch."""
    from trainer.demo import VOCAB

    cfg = with_overrides(case("zero3"), data__name="synthetic", strategy__ep=ep)
    cfg["model"] = {"name": "hf", "kind": "hf", "path": path, "seq_len": 16, "vocab_size": VOCAB}
    counter = CollectiveBytes()
    with counter:
        strategy, model, _ = build(env, cfg)
    weights = full_state(strategy)
    x = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        loss = loss_of(model, x).item()
    strategy.teardown()
    return counter.bytes, weights, loss


@pytest.mark.slow  # one launch of 2 ranks each: 20 s here
@pytest.mark.parametrize("ep", [1, 2])
def test_zero3_starts_without_sending_parameters(tmp_path, ep):
    from transformers import AutoModelForCausalLM

    from trainer.demo import VOCAB, make_model_dir

    path = make_model_dir(tmp_path / "qwen3_moe", "qwen3_moe", weights=True, seed=1)
    by_rank = on_ranks(2, started, str(path), ep)
    for rank, (sent, _, _) in by_rank.items():
        assert sent["broadcast"] == 0 and sent["all_gather"] == 0, (rank, sent)
    _, weights, loss = by_rank[0]
    reference = AutoModelForCausalLM.from_pretrained(str(path))
    params = dict(reference.named_parameters())
    assert weights.keys() == params.keys()
    for name, value in params.items():
        assert torch.equal(weights[name], value.detach()), name
    x = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = loss_of(reference, x).item()
    assert abs(loss - expected) <= 1e-6 * expected, (loss, expected)
