"""The trainer's AdamW is torch's fused one (one kernel for all parameters): under FSDP2 the loop
of ~12 DTensor ops per parameter cost ~7x its step (docs/benchmarks.md, against the peers)."""
import torch

from trainer.config import to_config
from trainer.training.setup import adamw_factory


def test_adamw_is_fused_and_steps_as_the_loop_does():
    o = to_config({}).optim
    weights = [torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(4))]
    reference = [torch.nn.Parameter(w.detach().clone()) for w in weights]
    optimizer = adamw_factory(o)([(p, tuple(p.shape)) for p in weights])
    assert optimizer.defaults["fused"] is True
    looped = torch.optim.AdamW([{"params": [reference[0]], "weight_decay": o.weight_decay},
                                {"params": [reference[1]], "weight_decay": 0.0}], lr=o.lr, betas=tuple(o.betas),
                               eps=o.eps, foreach=False)
    for _ in range(3):
        for p, q in zip(weights, reference):
            p.grad = torch.full_like(p, 0.5)
            q.grad = torch.full_like(q, 0.5)
        optimizer.step()
        looped.step()
    for p, q in zip(weights, reference):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
