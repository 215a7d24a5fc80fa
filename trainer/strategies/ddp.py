"""DDP: every rank holds everything; gradients are all-reduced in buckets during backward."""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from trainer.config import ReduceDtype
from trainer.models.weights import allocate, fill
from trainer.strategies.precision import REDUCE_DTYPES
from trainer.strategies.torch_native import TorchStrategy


class DDPStrategy(TorchStrategy):
    def wrap(self, model, weights):
        allocate(model, self.env.device)
        fill(model, weights)
        model = model.to(self.env.device)  # the buffers
        device_ids = [self.env.device.index] if self.env.device.type == "cuda" else None
        model = DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True)
        reduce_dtype = ReduceDtype(self.cfg.strategy.reduce_dtype)
        if reduce_dtype is not ReduceDtype.fp32:  # fp32 gradients, sent in the training dtype
            model.register_comm_hook(REDUCE_DTYPES[reduce_dtype], reduce_in)
        return model

    def autocast(self):
        # DDP keeps fp32 parameters; bf16/fp16 compute comes from autocast.
        if not self.precision.mixed:
            return nullcontext()
        return torch.autocast(self.env.device.type, dtype=self.precision.dtype)

    def _frozen_dtype(self):
        # the policy computes from fp32 parameters under autocast: norms and embeddings in fp32; a
        # copy in bf16 would round them, and its log-probs would differ from the policy's at step 1
        return torch.float32

    @property
    def module(self):
        return self.model.module

    def local_range(self, tensor):
        # Every rank holds everything: each saves 1/N of it and loads all of it.
        return 0, tensor.detach().view(-1), self.env.world_size, self.env.rank, None

    def micro_step(self, final):
        return self.model.no_sync() if not final and not self._reduce_every_micro_step else nullcontext()


def reduce_in(dtype, bucket):  # unannotated: DDP checks annotations, which are strings here
    """A DDP comm hook: the bucket averaged in `dtype` (bf16 or fp16), then put back in its fp32
    buffer. torch's own bf16_compress_hook is refused off NCCL; this one runs on gloo too."""
    compressed = bucket.buffer().to(dtype).div_(dist.get_world_size())

    def put_back(done):
        return bucket.buffer().copy_(done.value()[0])

    return dist.all_reduce(compressed, async_op=True).get_future().then(put_back)
