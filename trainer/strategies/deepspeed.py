"""DeepSpeed ZeRO-1/2/3: `deepspeed.initialize` with a config built from ours.

The loop owns accumulation (as for DDP/FSDP): DeepSpeed sees gradient_accumulation_steps=1,
`backward` does not divide the loss again, and `micro_step` holds all micro-steps of a step in
one `coalesce_grad_reduction` block, so gradients are reduced once, after the final backward.
"""
from __future__ import annotations

from contextlib import ExitStack, contextmanager
from functools import partial
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from trainer.config import Precision
from trainer.log import chatter
from trainer.models.experts import shard_experts
from trainer.models.weights import WeightSource, allocate_params, fill
from trainer.patches import watch_op_builds, zero3_start_build, zero3_start_hooks
from trainer.strategies.base import (
    Strategy,
    follow_rank0_buffers,
    hold_in,
    optimizer_state_tensors,
    peak_device_bytes,
    tensor_bytes,
    trainable,
)
from trainer.strategies.ds_config import build_ds_config
from trainer.strategies.ds_state import ZeroPartitions, named_params, z3_local, z3_range
from trainer.strategies.ds_tp import output_layers, partition_config, split_logits, tensor_slice


class DeepSpeedStrategy(Strategy):
    def __init__(self, cfg, env):
        super().__init__(cfg, env)
        watch_op_builds()
        with chatter():
            deepspeed.init_distributed(dist_backend="nccl" if env.device.type == "cuda" else "gloo")  # joins ours
        self.ds_config = build_ds_config(cfg, env.world_size)
        # DeepSpeed keeps its groups (tensor, data-parallel, experts, an AutoTP engine's `mpu`) in its modules for
        # the process, so an earlier run's stand for this one's: a tp=1 engine after a tp=2 one reads that one's
        # `mpu` and fails; its tensor groups are made once, whatever the next run's degree. Released here (as its
        # destroy_process_group does), every run makes its own.
        from deepspeed.utils import groups
        groups._release_process_group_references(group=None)
        if self.layout.degrees.tp > 1:
            self._tensor_groups()
        self.stage = self.ds_config["zero_optimization"]["stage"]
        self.engine = None
        self.frozen_engines = []  # setup_frozen's, destroyed with the policy's
        self.zero: ZeroPartitions | None = None  # the portable state of the engine's partitions, after setup
        self._coalescing = None
        self._gradient_peak = 0  # bytes of gradients at the end of autograd's pass (measure_memory)

    def _tensor_groups(self) -> None:
        """strategy.tp: DeepSpeed's (dp, tp) groups, made now (ZeRO-3's zero.Init partitions over its
        data-parallel group; `deepspeed.initialize` takes them as made). Its tensor groups are consecutive
        ranks, as the layout's (layout.py): the rows a rank reads are those its tensor group's ranks read."""
        from deepspeed.utils import groups

        groups._init_tp_mesh_device(tensor_model_parallel_size=self.layout.degrees.tp)
        first, tp = self.env.rank - self.layout.tp_rank, self.layout.degrees.tp
        assert dist.get_process_group_ranks(groups.get_tensor_model_parallel_group()) == list(range(first, first + tp))
        assert dist.get_rank(groups.get_data_parallel_group()) == self.layout.dp_rank  # the rows it reads
        # the logits' tensor group, for their vocabulary-parallel loss (ds_tp.split_logits)
        self.tensor_mesh = DeviceMesh.from_group(groups.get_tensor_model_parallel_group(), self.env.device.type)

    def model_init_context(self):
        if self.stage == 3:  # parameters are partitioned as each module is built
            return self._partitioned_build()
        return super().model_init_context()

    @contextmanager
    def _partitioned_build(self):
        from deepspeed.utils import groups

        # setup (and setup_frozen) fill every rank's partition: rank 0's initial values are not sent
        # strategy.tp: over the data-parallel group, as AutoTP partitions the slices it makes (without it,
        # the parameters it leaves whole would stay partitioned over the world)
        group = {"data_parallel_group": groups.get_data_parallel_group()} if self.layout.degrees.tp > 1 else {}
        with zero3_start_build(), deepspeed.zero.Init(config_dict_or_path=self.ds_config, **group):
            yield

    def setup(self, model, optimizer_factory, weights):
        ep = self.layout.experts.size
        if ep > 1:  # strategy.ep: this rank's experts
            from trainer.strategies.ds_experts import make_groups, partition_experts

            make_groups(ep)
            experts = (partition_experts(model, self.layout.experts, self.env.device) if self.stage == 3
                       else shard_experts(model, self.layout.experts))
        else:
            experts = []
        if self.stage == 3:  # each rank fills its own partition of every parameter
            self._experts.add(experts)
            fill(model, weights, partial(z3_local, experts=self._experts))
        else:  # every rank holds the whole model, in the training dtype (the fp32 masters are DeepSpeed's
            # partitions, set below): allocated so where it trains and filled a tensor at a time, so that
            # no rank's host holds a full fp32 copy (a 7B model: 28 GB per local rank)
            hold_in(model, self.precision.dtype, frozen_only=False)
            allocate_params(model, self.env.device)
            self._experts.add(experts)
            fill(model, weights, lambda p: (self._experts.start(p), p.detach().view(-1), self._experts.block(p)))
        optimizer = optimizer_factory(trainable(model, self.full_shape))
        if ep > 1:
            from trainer.strategies.ds_experts import expert_param_groups, tell_deepspeed

            tell_deepspeed(model, experts, ep)
            expert_param_groups(optimizer, self._experts, ep)
        if self.cfg.strategy.offload_optimizer:  # DeepSpeed steps offloaded state with its CPU Adam
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            d = optimizer.defaults
            optimizer = DeepSpeedCPUAdam(optimizer.param_groups, lr=d["lr"], betas=d["betas"], eps=d["eps"],
                                         weight_decay=d["weight_decay"], adamw_mode=True)
        config, split_outputs = self.ds_config, []
        if self.layout.degrees.tp > 1:  # AutoTP splits the layers of the model's plan, as fsdp does
            config = {**config, "tensor_parallel": {**config["tensor_parallel"], "partition_config": partition_config(model)}}
            split_outputs = output_layers(model)
        with zero3_start_hooks():  # ZeRO-3's optimizer: its gradient hooks on the partitioned parameters
            self.engine, ds_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        if split_outputs:
            split_logits(self.engine.module, split_outputs, self.tensor_mesh)
        self.zero = ZeroPartitions(self.engine, self.stage, self.layout, self._experts)
        if self.precision.mixed:
            self._set_masters(weights)
        scaler = getattr(self.engine.optimizer, "loss_scaler", None)
        if self.precision.setting is Precision.fp16 and getattr(scaler, "dynamic", False):  # static: a setting, not state
            self.precision.loss_scale = DeepSpeedLossScale(scaler)
        follow_rank0_buffers(self.engine.module, self.env.device, self.env.world_size)
        return self.engine, ds_optimizer

    def setup_frozen(self, model, weights):
        if self.stage != 3:
            return super().setup_frozen(model, weights)
        # Partitioned by zero.Init as it was built, like the policy; each rank fills its partition.
        # Its forward gathers each module's parameters: DeepSpeed's engine without an optimizer
        # holds a ZeRO-3 model in DeepSpeedZeRoOffload, the hooks that do that (engine.py's
        # _configure_zero_optimizer(None), DeepSpeed 0.19.8; TRL's reference under ZeRO-3 too).
        model.requires_grad_(False)
        fill(model, weights, z3_local)
        engine, *_ = deepspeed.initialize(model=model, config=self.ds_config)
        self.frozen_engines.append(engine)
        engine.eval()  # DeepSpeedEngine.eval returns None
        return self.holds(engine)

    @torch.no_grad()
    def _set_masters(self, weights: WeightSource) -> None:
        """DeepSpeed clones its fp32 masters from the bf16/fp16 parameters, rounded; DDP and FSDP2
        start from the fp32 values themselves. This rank's master ranges, read again from them."""
        from deepspeed.utils import safe_set_local_fp32_param

        for name, p in named_params(self.module):
            if not p.requires_grad:
                continue
            at, block = self.zero.place(p)  # strategy.ep, strategy.tp: this rank's part of the full tensor
            if self.stage == 3:
                start, numel = z3_range(p, self._experts)
                if numel:
                    padded = torch.zeros(p.ds_tensor.numel(), dtype=torch.float32, device=p.ds_tensor.device)
                    padded[:numel] = weights.read(name, at + start, numel, block)
                    safe_set_local_fp32_param(p, padded)
            elif getattr(p, "_hp_mapping", None) is not None:
                fragment = p._hp_mapping.lp_fragment_address
                start = at + self._experts.start(p) + fragment.start
                p._hp_mapping.get_hp_fragment().copy_(weights.read(name, start, fragment.numel, block))

    @contextmanager
    def micro_step(self, final):
        if self._reduce_every_micro_step:  # DeepSpeed's unmanaged accumulation (build_ds_config)
            yield
            return
        # One coalesce block spans every micro-step of the step: it opens on the first
        # non-final micro-step and its exit, after the final backward, reduces once.
        enabled = not final
        if enabled and self._coalescing is None:
            self._coalescing = self.engine.coalesce_grad_reduction()
            self._coalescing.__enter__()
        yield
        if not enabled and self._coalescing is not None:
            coalescing, self._coalescing = self._coalescing, None
            coalescing.__exit__(None, None, None)

    def backward(self, loss, measure_memory=False):
        if measure_memory and self.stage == 1 and loss.requires_grad:
            # ZeRO-1 holds every full gradient to the end of autograd's pass and reduces them into
            # partitions in DeepSpeed's backward epilogue: measured at that end, their peak.
            engine = torch.autograd.Variable._execution_engine
            loss.register_hook(lambda grad: engine.queue_callback(self._note_gradient_peak) or grad)
        with self.autocast():
            self.engine.backward(loss, scale_wrt_gas=False)

    def _note_gradient_peak(self) -> None:
        self._gradient_peak = max(self._gradient_peak, self._gradient_bytes())

    def grad_norm(self):
        # DeepSpeed's own norm of the reduced gradient partitions, which its step takes again.
        zero = self.engine.optimizer
        if self._reduce_every_micro_step:
            # Unmanaged accumulation: engine.step() is the boundary, and its boundary work comes first
            # in it; done here instead, before the norm (ZeRO-2/3 finalize their partitions, ZeRO-1
            # reduces, as step() would), and step() must then not do it again (_stepped).
            if self.stage >= 2:
                zero.finalize_gradient_accumulation_boundary()
            else:
                zero.set_gradient_accumulation_boundary(True)
                zero.reduce_gradients()
        if self.stage == 3:
            from deepspeed.runtime.utils import combine_grad_norm_groups

            scaled = combine_grad_norm_groups(zero._get_norm_groups())
        else:
            zero._wait_for_offload_copies()  # as its step() does first: offloaded gradients copied
            scaled = zero.scaled_global_norm()
        return (torch.as_tensor(scaled, dtype=torch.float32) / float(zero.loss_scale)).cpu()

    def apply(self, max_grad_norm):
        # Clipping is DeepSpeed's, from "gradient_clipping" in the config (built from train.grad_clip).
        self._stepped()

    def skip(self, finite_gradients):
        # DeepSpeed's own overflow path: no update to masters, moments or step count, gradients
        # cleared, the fp16 scale backed off. Nothing public takes it on demand (patches.py).
        from trainer.patches import deepspeed_overflow

        with self.precision.kept(finite_gradients), deepspeed_overflow(self.engine.optimizer):
            self._stepped()

    def _stepped(self) -> None:
        """engine.step(), after grad_norm: under unmanaged accumulation without the boundary work
        grad_norm did (ZeRO-1's step() reduces where enable_backward_allreduce is set; ZeRO-2/3's
        finalize, replaced for this call)."""
        from trainer.patches import deepspeed_boundary_done

        self._gradient_peak = 0
        engine, own_setting = self.engine, self.engine.enable_backward_allreduce
        with ExitStack() as unmanaged:
            if self._reduce_every_micro_step and self.stage >= 2:
                unmanaged.enter_context(deepspeed_boundary_done(engine.optimizer))
            elif self._reduce_every_micro_step:
                engine.enable_backward_allreduce = False
                unmanaged.callback(setattr, engine, "enable_backward_allreduce", own_setting)
            engine.step()

    def _gradient_bytes(self) -> int:
        zero = self.engine.optimizer
        # Unreduced gradients by their own size: ZeRO-2/3 place them in a reduce bucket whose
        # capacity (reduce_bucket_size) is a communication buffer, not gradients.
        unreduced = sum(p.grad.numel() * p.grad.element_size() for p in self.module.parameters()
                        if p.grad is not None)
        partitions = [m.grad for m in self.zero.masters()]
        for buffers in ("averaged_gradients", "all_grad_tensors"):  # ZeRO-1/2: reduced, and accumulating
            partitions += [g for gs in getattr(zero, buffers, {}).values() for g in (gs or [])]
        partitions.append(getattr(zero, "grads_in_partition", None))  # ZeRO-2
        partitions.append(getattr(zero, "grad_partitions_flat_buffer", None))  # ZeRO-3
        return unreduced + tensor_bytes(partitions)

    def memory_bytes(self):
        masters = self.zero.masters()
        return {"params": tensor_bytes(getattr(p, "ds_tensor", p) for p in self.module.parameters()) + self._held_bytes(),
                "grads": max(self._gradient_bytes(), self._gradient_peak),  # now, or at this step's peak
                "optim": tensor_bytes(masters) + tensor_bytes(optimizer_state_tensors(self.engine.optimizer.optimizer)),
                "peak": peak_device_bytes(self.env.device)}

    def _held_bytes(self):
        # ZeRO-3's frozen copy holds this rank's partition of each parameter (ds_tensor)
        return tensor_bytes(getattr(p, "ds_tensor", p) for model in self._held for p in model.parameters())

    @property
    def module(self):
        return self.engine.module

    def state_dict(self, model_only=False):
        return self.zero.state_dict(model_only, with_step=self.env.is_main)

    def state_layout(self):
        return self.zero.state_layout()

    def load_state_dict(self, values):
        self.zero.load_state_dict(values)

    def save_native(self, directory: Path, tag: str) -> None:
        """DeepSpeed's own checkpoint of the engine (convert --to deepspeed): the only backend with a format
        of its own, so no member of the common surface."""
        self.engine.save_checkpoint(str(directory), tag=tag)

    def full_shape(self, p):
        # ZeRO-3 partitions parameters as they are built; strategy.ep: this rank's experts' rows;
        # strategy.tp: AutoTP's slice
        if self.layout.degrees.tp > 1:
            return tensor_slice(p, self.layout.tp_rank).full_shape
        return self._experts.full_shape(p, tuple(getattr(p, "ds_shape", p.shape)))

    def teardown(self):
        for engine in self.frozen_engines:
            engine.destroy()
        self.frozen_engines = []
        if self.engine is not None:
            self.engine.destroy()
            self.engine = None
        # zero.Init swaps in its own F.linear for the whole process and leaves it ("persists
        # unless manually reset"): put torch's back, so later work in this process is unaffected.
        from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as patcher
        if hasattr(patcher, "linear_bk"):
            torch.nn.functional.linear = patcher.linear_bk


class DeepSpeedLossScale:
    """DeepSpeed's DynamicLossScaler (fp16 with a dynamic scale; a static scale is a setting of
    ds_config, not state)."""

    def __init__(self, scaler):
        self.scaler = scaler

    def state(self):
        s = self.scaler
        # Steps since the last overflow, and the overflows it still tolerates before it backs off
        # (fp16.hysteresis), which torch's scaler does not have
        return {"scale": float(s.cur_scale), "good_steps": int(s.cur_iter - s.last_overflow_iter - 1),
                "hysteresis": int(s.cur_hysteresis)}

    def load(self, state):
        s = self.scaler
        s.cur_scale = state["scale"]
        s.cur_iter, s.last_overflow_iter = state["good_steps"], -1
        s.cur_hysteresis = state.get("hysteresis", s.delayed_shift)  # from torch's: a fresh one
