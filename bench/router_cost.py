"""The router's balance statistics alone: the trainer's against transformers' own (not a test: prints numbers).

    python bench/router_cost.py [--layers 48] [--tokens 4096] [--experts 128] [--top-k 8] [--repeat 5]

At Qwen3-30B-A3B's router shape by default (48 MoE layers, 128 experts, top-8), one row of
`tokens` tokens, fp32 router logits with gradients: the median time of `repeat` forwards and of
their backwards (the two contenders in turn), for transformers' `load_balancing_loss_func` (what
the model's forward computes under `output_router_logits=True`) and for the trainer's
(losses/router_loss.py: `balance_sums` and the aux of its sums), and how far the two losses are apart.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from trainer.losses.router_loss import balance_sums


def ours(logits: tuple[torch.Tensor, ...], top_k: int, experts: int) -> torch.Tensor:
    """One unpacked row without padding: one document, every token routed."""
    mask = torch.ones(1, logits[0].shape[0])
    choices, probs, tokens = balance_sums(logits, torch.zeros_like(mask, dtype=torch.long), 1, mask, top_k, experts)
    return experts * ((choices / tokens[..., None]) * (probs / tokens[..., None])).sum()


def theirs(logits: tuple[torch.Tensor, ...], top_k: int, experts: int) -> torch.Tensor:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    return load_balancing_loss_func(logits, experts, top_k)


def measure(contenders: dict, logits: tuple[torch.Tensor, ...], top_k: int, experts: int, repeat: int) -> dict:
    """{name: median forward s, median backward s, loss}; the contenders in turn within each repeat,
    so that other work on the machine slows them alike."""
    times: dict = {name: ([], []) for name in contenders}
    losses = {}
    for i in range(repeat + 1):  # the first: warm-up
        for name, loss_of in contenders.items():
            for layer in logits:
                layer.grad = None
            start = time.perf_counter()
            loss = loss_of(logits, top_k, experts)
            middle = time.perf_counter()
            loss.backward()
            if i:
                times[name][0].append(middle - start)
                times[name][1].append(time.perf_counter() - middle)
            losses[name] = loss.item()
    return {name: {"forward_s": statistics.median(forwards), "backward_s": statistics.median(backwards),
                   "loss": losses[name]} for name, (forwards, backwards) in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    logits = tuple(torch.randn(args.tokens, args.experts, requires_grad=True) for _ in range(args.layers))
    print(f"{args.layers} layers x {args.tokens} tokens x {args.experts} experts, top-{args.top_k}, fp32, "
          f"{torch.get_num_threads()} threads; median of {args.repeat}")
    print(f"{'':14} {'forward s':>10} {'backward s':>11} {'total s':>8}  loss")
    results = measure({"transformers": theirs, "trainer": ours}, logits, args.top_k, args.experts, args.repeat)
    for name, r in results.items():
        print(f"{name:14} {r['forward_s']:10.3f} {r['backward_s']:11.3f} {r['forward_s'] + r['backward_s']:8.3f}  "
              f"{r['loss']:.7f}")
    gap = abs(results["trainer"]["loss"] - results["transformers"]["loss"]) / results["transformers"]["loss"]
    print(f"losses apart: {gap:.1e} relative")


if __name__ == "__main__":
    main()
