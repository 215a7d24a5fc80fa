"""Sequence parallelism (strategy.sp) for model=hf: Hugging Face families attend through Ulysses
(trainer/models/hf_sequence.py), and what cannot be split is refused before any rank starts."""
from __future__ import annotations

import pytest
import torch

from tests.harness import on_ranks

SEQ = 16  # tokens of a whole row; each of 2 ranks holds 8
# Two packed documents per row (positions restart at 0): attention must stay within each.
PACKED = torch.cat([torch.arange(11), torch.arange(5)])


def model_config(path: str):
    from trainer.config import ModelConfig

    return ModelConfig(name="hf", kind="hf", path=path, seq_len=SEQ)


def logits_and_grads(model, ids, positions, targets):
    """(logits, every parameter's gradient) of the summed token loss of `ids`."""
    logits = model(ids, position_ids=positions).logits
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def rows(vocab: int):
    """Two rows of SEQ tokens (ids, targets) and their positions: plain, and two packed documents."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, SEQ + 1), generator=generator)
    return ids[:, :-1], ids[:, 1:], {"plain": torch.arange(SEQ).expand(2, SEQ), "packed": PACKED.expand(2, SEQ)}


def sharded_against_whole(env, path: str) -> dict[str, float]:
    """On each of 2 ranks: the model built for sp=2 (Ulysses attention) runs this rank's half of the
    tokens inside `sharded(...)`; its logits and gradients, joined over the ranks, against the
    model built as at sp=1 running the whole rows (same weights). The largest relative differences."""
    import torch.distributed as dist

    from trainer.models import hf, sequence

    cfg = model_config(path)
    torch.manual_seed(0)
    whole = hf.builder(cfg)()
    split = hf.builder(cfg, sp=2)()
    assert split.config._attn_implementation != whole.config._attn_implementation
    split.load_state_dict(whole.state_dict())
    group = sequence.SequenceGroup(dist.group.WORLD, 2, dist.get_rank())
    ids, targets, positions = rows(whole.config.vocab_size)
    found = {}
    for kind, position_ids in positions.items():
        whole.zero_grad(), split.zero_grad()
        expected_logits, expected_grads = logits_and_grads(whole, ids, position_ids, targets)
        with sequence.sharded(group, position_ids if kind == "packed" else None):
            logits, grads = logits_and_grads(split, group.local(ids), group.local(position_ids), group.local(targets))
        gathered = [torch.empty_like(logits) for _ in range(2)]
        dist.all_gather(gathered, logits)
        for g in grads.values():  # each rank's gradient is its own tokens' share: the sum is the whole rows'
            dist.all_reduce(g)
        found[f"{kind} logits"] = float((torch.cat(gathered, 1) - expected_logits).abs().max()
                                        / expected_logits.abs().max())
        found[f"{kind} grads"] = max(float((grads[n] - e).abs().max() / e.abs().max().clamp_min(1e-30))
                                     for n, e in expected_grads.items())
    return found


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "gpt_neox"])
def test_hf_attention_split_over_two_ranks_gives_the_whole_models_logits_and_gradients(hf_assets, family):
    """Qwen2 (grouped-query attention: 4 query heads, 2 key/value heads) and GPT-NeoX (partial rotary,
    parallel residual), on 2 gloo ranks: plain rows and rows of two packed documents."""
    found = on_ranks(2, sharded_against_whole, str(hf_assets.pretrained[family]))
    for rank, differences in found.items():
        for what, difference in differences.items():
            assert difference < 1e-5, (family, rank, what, difference)
