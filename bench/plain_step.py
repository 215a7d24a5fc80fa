"""One training step under torchrun with nothing of the trainer imported: the baseline of
bench/startup.py. A model of the trainer's default size (conf/model/tiny.yaml), its default
micro-batch, AdamW, gloo on CPU.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 bench/plain_step.py ddp|fsdp|zero3
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, HEADS, LAYERS, SEQ, BATCH = 256, 64, 4, 2, 64, 8


def main(strategy: str) -> None:
    torch.manual_seed(0)
    blocks = [nn.TransformerEncoderLayer(WIDTH, HEADS, 4 * WIDTH, dropout=0.0, batch_first=True) for _ in range(LAYERS)]
    model = nn.Sequential(nn.Embedding(VOCAB, WIDTH), *blocks, nn.Linear(WIDTH, VOCAB))
    if strategy == "zero3":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True, "steps_per_print": 2 ** 31}
        model, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                                              config=config)
        backward, step = model.backward, model.step
    else:
        dist.init_process_group("gloo")
        if strategy == "fsdp":
            from torch.distributed.fsdp import fully_shard

            for block in blocks:
                fully_shard(block)
            fully_shard(model)
        else:
            model = nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(model.parameters())
        backward, step = (lambda loss: loss.backward()), optimizer.step
    x = torch.randint(0, VOCAB, (BATCH, SEQ + 1))
    loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
    backward(loss)
    step()
    print(f"rank {dist.get_rank()}: loss {loss.item():.4f}")
    dist.destroy_process_group()
    os._exit(0)  # FACTS.md: gloo can abort at interpreter exit after backward


if __name__ == "__main__":
    main(sys.argv[1])
