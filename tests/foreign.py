"""Programs written only against other libraries' public APIs (torch, torch.distributed.checkpoint,
FSDP2's fully_shard, DeepSpeed, transformers, accelerate) that make and read those libraries' own
checkpoints, for the tests of checkpoint interchange to run as subprocesses. Nothing here imports
`trainer`. From the repository root:

    python -m tests.foreign ds_zero2_save      --model DIR --out OUT     [--steps 3] [--nproc 2]
    python -m tests.foreign fsdp2_save_dcp     --model DIR --out OUT     [--steps 3] [--nproc 2]
    python -m tests.foreign fsdp2_load_dcp     --model DIR --dcp DCP_DIR --out OUT.pt [--nproc 3]
    python -m tests.foreign ds_load_universal  --model DIR --ckpt UNI_DIR [--tag TAG] --out OUT.pt [--nproc 1]
    python -m tests.foreign accelerate_ds_save --model DIR --out OUT     [--steps 3] [--nproc 2]

Each starts its own gloo ranks on 127.0.0.1 and exits non-zero with the traceback if one fails.
The model is the Hugging Face causal LM in --model (fp32); each rank trains on its own seeded random
token ids (4 x 32); the optimizer is torch AdamW with the trainer's two groups (matrices with weight
decay 0.1, the rest without). The ground truth, written by rank 0 with torch.save (expected.pt in
the save commands, OUT.pt in the load ones), is gathered with the library's own API:

    {"params": {name: fp32 tensor}, "exp_avg": {name: ...}, "exp_avg_sq": {name: ...}, "step": int}
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # these programs run on the CPU, with gloo

MICRO_BATCH, SEQ_LEN, SEED = 4, 32, 0


# --- shared helpers --------------------------------------------------------------------------------

def load_model(model_dir: str):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()  # tqdm's lock is a semaphore that os._exit below would leak
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()


def param_groups(model) -> list[dict]:
    """The trainer's groups: trainable params with ndim >= 2 (decayed), then the others."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


def adamw(model) -> torch.optim.AdamW:
    return torch.optim.AdamW(param_groups(model), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)


def batch(step: int, vocab_size: int) -> torch.Tensor:
    """This rank's token ids for `step`: the same on every run."""
    g = torch.Generator().manual_seed(SEED + 1000 * step + dist.get_rank())
    return torch.randint(0, vocab_size, (MICRO_BATCH, SEQ_LEN), generator=g)


def ds_config(stage: int = 2, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
            "gradient_clipping": 0.0, "bf16": {"enabled": False}, "fp16": {"enabled": False}, **extra}


def ds_truth(engine) -> dict:
    """The full fp32 params and Adam moments of a DeepSpeed engine (collectives: every rank calls)."""
    from deepspeed.utils import (
        lazy_init_hp_params_optimizer_state,
        safe_get_full_fp32_param,
        safe_get_full_optimizer_state,
    )

    zero = engine.optimizer
    # DeepSpeed 0.19 (ZeRO-1/2) links the params' moment fragments once, right after stepping the
    # first param group, so the second group's stay unlinked: link them all.
    for group, flat in zip(zero.bit16_groups, zero.single_partition_of_fp32_groups, strict=True):
        lazy_init_hp_params_optimizer_state(group, flat, zero.optimizer.state)
    truth = {"params": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for name, p in engine.module.named_parameters():
        truth["params"][name] = safe_get_full_fp32_param(p).detach().clone().cpu()
        for key in ("exp_avg", "exp_avg_sq"):
            truth[key][name] = safe_get_full_optimizer_state(p, key).detach().clone().cpu()
    base = zero.optimizer  # torch AdamW over DeepSpeed's flat fp32 partitions, one per group
    truth["step"] = int(base.state[base.param_groups[0]["params"][0]]["step"])
    return truth


def fsdp2_model(model_dir: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = load_model(model_dir)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.gpt_neox.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def fsdp2_truth(model, optimizer) -> dict | None:
    """The full state of an FSDP2 model and its optimizer, on rank 0 (a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return None
    names = [name for name, _ in model.named_parameters()]
    state = osd["state"]
    return {"params": {n: msd[n].clone() for n in names},
            "exp_avg": {n: state[n]["exp_avg"].clone() for n in names},
            "exp_avg_sq": {n: state[n]["exp_avg_sq"].clone() for n in names},
            "step": int(state[names[0]]["step"])}


def save_on_rank0(obj, path) -> None:
    if dist.get_rank() == 0:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        torch.save(obj, path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, fn, args, world_size: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    fn(args)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skips interpreter teardown, where gloo ranks sometimes abort (FACTS.md)


def launch(fn, args) -> None:
    """fn(args) on `args.nproc` fresh ranks of one gloo group; a rank's exception is raised here."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(args.nproc),
                      LOCAL_WORLD_SIZE=str(args.nproc))
    mp.spawn(_rank_main, args=(fn, args, args.nproc), nprocs=args.nproc, join=True)


# --- the programs ----------------------------------------------------------------------------------

def ds_zero2_save(a) -> None:
    """Plain DeepSpeed ZeRO-2: `steps` steps, engine.save_checkpoint(OUT), OUT/expected.pt."""
    import deepspeed

    model = load_model(a.model)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=adamw(model), config=ds_config(2))
    for step in range(a.steps):
        x = batch(step, model.config.vocab_size)
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
    engine.save_checkpoint(a.out)
    save_on_rank0(ds_truth(engine), Path(a.out) / "expected.pt")


def fsdp2_save_dcp(a) -> None:
    """Plain FSDP2: `steps` steps, dcp.save({"model", "optim"}) to OUT, OUT/expected.pt."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = fsdp2_model(a.model)
    optimizer = adamw(model)
    for step in range(a.steps):
        x = batch(step, model.config.vocab_size)
        model(input_ids=x, labels=x).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=a.out)
    save_on_rank0(fsdp2_truth(model, optimizer), Path(a.out) / "expected.pt")


def fsdp2_load_dcp(a) -> None:
    """Plain FSDP2: dcp.load the "model" and "optim" entries of DCP_DIR, then OUT.pt."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = fsdp2_model(a.model)
    optimizer = adamw(model)
    msd, osd = get_state_dict(model, optimizer)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=a.dcp)
    set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)
    save_on_rank0(fsdp2_truth(model, optimizer), a.out)


def ds_load_universal(a) -> None:
    """DeepSpeed ZeRO-2 with load_universal: engine.load_checkpoint(UNI_DIR, TAG), then OUT.pt."""
    import deepspeed

    model = load_model(a.model)
    config = ds_config(2, checkpoint={"load_universal": True})
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=adamw(model), config=config)
    path, _ = engine.load_checkpoint(a.ckpt, tag=a.tag, load_optimizer_states=True)
    if path is None:
        raise RuntimeError(f"DeepSpeed loaded nothing from {a.ckpt} (tag {a.tag})")
    save_on_rank0(ds_truth(engine), a.out)


def accelerate_ds_save(a) -> None:
    """The same ZeRO-2 training through accelerate: accelerator.save_state(OUT), OUT/expected.pt."""
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.utils import InitProcessGroupKwargs

    # Without a GPU, accelerate's DeepSpeed path counts one process per rank unless told the backend.
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config(2)),
                              kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    if accelerator.num_processes != dist.get_world_size():
        raise RuntimeError(f"accelerate sees {accelerator.num_processes} processes, not {dist.get_world_size()}")
    model = load_model(a.model)
    engine, optimizer = accelerator.prepare(model, adamw(model))
    for step in range(a.steps):
        x = batch(step, model.config.vocab_size)
        accelerator.backward(engine(input_ids=x, labels=x).loss)
        optimizer.step()
        optimizer.zero_grad()
    accelerator.save_state(a.out)
    save_on_rank0(ds_truth(engine), Path(a.out) / "expected.pt")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.foreign", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for fn, nproc, options in [(ds_zero2_save, 2, ["out", "steps"]), (fsdp2_save_dcp, 2, ["out", "steps"]),
                               (fsdp2_load_dcp, 3, ["dcp", "out"]), (ds_load_universal, 1, ["ckpt", "tag", "out"]),
                               (accelerate_ds_save, 2, ["out", "steps"])]:
        sub = commands.add_parser(fn.__name__, help=fn.__doc__)
        sub.set_defaults(fn=fn)
        sub.add_argument("--model", required=True, help="a Hugging Face model folder")
        sub.add_argument("--nproc", type=int, default=nproc)
        for option in options:
            if option == "steps":
                sub.add_argument("--steps", type=int, default=3)
            else:
                sub.add_argument(f"--{option}", required=option != "tag", default=None)
    args = parser.parse_args(argv)
    launch(args.fn, args)


if __name__ == "__main__":
    main()
