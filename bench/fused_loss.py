"""The output layer and its loss alone, plain against `train.fused_loss=true` (not a test: prints numbers).

    python bench/fused_loss.py [--tokens 4096] [--width 768] [--vocab 32000] [--dtype fp32|bf16] [--repeat 3]

One forward and backward of `linear + cross-entropy` over `tokens` tokens: the plain loss (the
[tokens, vocab] logits, cross-entropy in fp32) and the fused layer (models/fused_loss.py). Printed
for each: the largest single allocation (torch.profiler), the bytes saved for backward beyond the
weight (saved-tensor hooks), the median time of `repeat` forward+backward passes; and how far the
fused loss and gradients are from the plain ones.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from trainer.data.sources import IGNORE_INDEX
from trainer.models.fused_loss import fused_class, token_losses
from trainer.saved_bytes import SavedBytes

MiB = 2 ** 20


def loss_of(layer: nn.Linear, hidden: torch.Tensor, targets: torch.Tensor, fused: bool) -> torch.Tensor:
    if fused:
        with token_losses(targets, IGNORE_INDEX):
            return layer(hidden).sum()
    return F.cross_entropy(layer(hidden).float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")


def measure(layer: nn.Linear, hidden: torch.Tensor, targets: torch.Tensor, fused: bool, repeat: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    hidden = hidden.detach().requires_grad_()
    with SavedBytes() as saved:
        loss = loss_of(layer, hidden, targets, fused)
    saved_bytes = saved.bytes - hidden.untyped_storage().nbytes()  # the layer's input is the model's anyway
    del loss
    layer.zero_grad()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss_of(layer, hidden, targets, fused).backward()
    largest = max((e.self_cpu_memory_usage for e in prof.events()), default=0)  # one op's own allocation
    grads = (hidden.grad.clone(), layer.weight.grad.clone(), loss_of(layer, hidden, targets, fused).item())
    times = []
    for _ in range(repeat):
        hidden.grad, layer.weight.grad = None, None
        start = time.perf_counter()
        loss_of(layer, hidden, targets, fused).backward()
        times.append(time.perf_counter() - start)
    return {"largest_allocation_mib": largest / MiB, "saved_mib": saved_bytes / MiB,
            "seconds": statistics.median(times), "grads": grads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    torch.manual_seed(0)
    plain = nn.Linear(args.width, args.vocab, bias=False, dtype=dtype)
    fused = nn.Linear(args.width, args.vocab, bias=False, dtype=dtype)
    fused.load_state_dict(plain.state_dict())
    fused.__class__ = fused_class(nn.Linear)  # as fuse_output_layer makes a model's output layer
    hidden = torch.randn(args.tokens, args.width, dtype=dtype)
    targets = torch.randint(0, args.vocab, (args.tokens,))
    print(f"{args.tokens} tokens x {args.width} wide x {args.vocab} vocabulary, {args.dtype}, "
          f"{torch.get_num_threads()} threads")
    results = {name: measure(layer, hidden, targets, name == "fused", args.repeat)
               for name, layer in (("plain", plain), ("fused", fused))}
    for name, r in results.items():
        print(f"{name:5s}: largest allocation {r['largest_allocation_mib']:8.1f} MiB, saved for backward "
              f"{r['saved_mib']:7.2f} MiB, forward+backward {r['seconds']:6.2f} s")
    (gh, gw, loss), (fh, fw, fused_loss) = results["plain"]["grads"], results["fused"]["grads"]
    print(f"fused vs plain: loss {abs(fused_loss - loss) / abs(loss):.1e} relative; gradients "
          f"{((fh - gh).abs().max() / gh.abs().max()).item():.1e} (input), "
          f"{((fw - gw).abs().max() / gw.abs().max()).item():.1e} (weight) of the largest")


if __name__ == "__main__":
    main()
