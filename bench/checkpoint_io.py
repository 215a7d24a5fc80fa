"""Checkpoint save/load time, bytes on disk and the memory a save adds, per strategy (prints numbers).

    python bench/checkpoint_io.py [--model gpt_125m] [--nproc 2] [--strategies ddp,fsdp,zero1,zero2,zero3]
                                  [--no-checksums]

Per strategy: one training step (so Adam state exists), then a save and a load of the full
portable state (model + Adam moments, fp32). "save peak +MB" is how far the rank's peak RSS
rose above its RSS before the save (Linux VmHWM, reset before the save): it should follow the
rank's own share of the state, never the full model. "verify s": rank 0 verifying every file of
the step dir (what a resume does before the ranks start). --no-checksums: the same save and load
with the hashing and the verification replaced by nothing, to measure what they cost.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # spawned ranks import this module as bench.checkpoint_io


def rss_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def without_checksums() -> None:
    """The files written and read as with checksums, less the hashing and the verification."""
    from trainer.checkpoint import format as checkpoint_format

    class NoHash:
        def update(self, data) -> None:
            pass

        def hexdigest(self) -> str:
            return ""

    checkpoint_format.xxhash = type("xxhash", (), {"xxh3_128": NoHash})
    checkpoint_format.verify_file = lambda *args: None


def measure(env, model: dict, strategy: str, root: str, checksums: bool) -> dict:
    import torch
    import torch.distributed as dist

    from trainer.checkpoint.format import read_manifest, verify_step_dir
    from trainer.checkpoint.manager import CheckpointManager
    from trainer.config import to_config
    from trainer.losses.objectives import token_loss_sum
    from trainer.strategies import build_strategy
    from trainer.strategies.base import optimizer_step
    from trainer.training.setup import setup_model

    cfg = to_config({"strategy": {"name": strategy}, "model": model,
                     "checkpoint": {"dir": f"{root}/{strategy}", "keep_last": 0}})
    if not checksums:
        without_checksums()
    s = build_strategy(cfg, env)
    net, _, _, _ = setup_model(cfg, s)
    x = torch.randint(0, cfg.model.vocab_size, (1, cfg.model.seq_len + 1))
    s.backward(token_loss_sum(net(x[:, :-1]), x[:, 1:]) / cfg.model.seq_len)
    optimizer_step(s, 1.0)
    manager = CheckpointManager(cfg.checkpoint, s, strategy)
    state = {"step": 1, "epoch": 0, "data": {"epoch": 0, "samples_consumed": 0}}

    dist.barrier()
    reset_peak_rss()
    before = rss_mb("VmRSS")
    t0 = time.perf_counter()
    path = manager.save(1, state)
    save_s = time.perf_counter() - t0
    save_peak_mb = rss_mb("VmHWM") - before
    dist.barrier()
    t0 = time.perf_counter()
    manager.load(path)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    if s.is_main and checksums:
        verify_step_dir(path, read_manifest(path))
    verify_s = time.perf_counter() - t0
    own = sum(p.tensor.numel() * 4 for p in s.state_dict().values()) / 1e6
    disk = sum(f.stat().st_size for f in path.iterdir()) / 1e6
    s.teardown()
    return {"save_s": save_s, "load_s": load_s, "verify_s": verify_s, "disk_mb": disk, "save_peak_mb": save_peak_mb,
            "own_share_mb": own}


def main() -> None:
    from omegaconf import OmegaConf

    from bench.checkpoint_io import measure as measure_fn  # by module name, for the spawned ranks
    from trainer import distributed
    from trainer.config import to_config
    from trainer.plan import count_params
    from trainer.training.run import in_group

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt_125m")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--strategies", default="ddp,fsdp,zero1,zero2,zero3")
    parser.add_argument("--no-checksums", action="store_true", help="save and load without hashing or verifying")
    args = parser.parse_args()
    model = OmegaConf.to_container(OmegaConf.load(REPO / "conf/model" / f"{args.model}.yaml"))
    n_params = count_params(to_config({"model": model}))
    full_mb = 3 * 4 * n_params / 1e6  # fp32 params + 2 Adam moments
    print(f"model={args.model} ({n_params / 1e6:.0f}M params, full portable state {full_mb:.0f} MB) "
          f"ranks={args.nproc}{'' if args.no_checksums else ' checksums'}")
    print(f"{'strategy':<10}{'save s':>8}{'load s':>8}{'verify s':>10}{'disk MB':>9}{'own share MB':>14}"
          f"{'save peak +MB':>15}{'peak/full':>11}")
    results = {}
    with tempfile.TemporaryDirectory() as root:
        for strategy in args.strategies.split(","):
            ranks = distributed.launch_local(args.nproc, in_group, measure_fn, model, strategy, root,
                                             not args.no_checksums)
            r = {k: max(rank[k] for rank in ranks.values()) for k in ranks[0]}
            results[strategy] = r
            print(f"{strategy:<10}{r['save_s']:>8.2f}{r['load_s']:>8.2f}{r['verify_s']:>10.2f}{r['disk_mb']:>9.0f}"
                  f"{r['own_share_mb']:>14.0f}"
                  f"{r['save_peak_mb']:>15.0f}{r['save_peak_mb'] / full_mb:>11.2f}", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
