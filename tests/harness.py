"""Run functions on real gloo process groups of N local ranks, and the trainer CLI."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from trainer import distributed

os.environ.setdefault("DS_ACCELERATOR", "cpu")
REPO = Path(__file__).resolve().parent.parent


def on_ranks(nproc: int, fn, *args):
    """fn(*args) on `nproc` ranks of one gloo group (torch's elastic launcher, as `nproc=N` uses:
    it does not suffer the gloo exit crash of FACTS.md). Returns {rank: fn's return value}."""
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="static", rdzv_endpoint=f"127.0.0.1:{distributed.free_port()}",
                          rdzv_configs={"rank": 0, "timeout": 120}, max_restarts=0, monitor_interval=0.1)
    return elastic_launch(config, _in_group)(fn, *args)


def _in_group(fn, *args):
    env = distributed.init()
    try:
        return fn(env, *args)
    finally:
        distributed.shutdown()


def train_cases(env, cases: dict[str, dict], out_dir: str) -> None:
    """Train each config (a plain dict of overrides) in turn in this process group."""
    from trainer.config import to_config
    from trainer.loop import train

    for name, case in cases.items():
        run_dir = Path(out_dir) / name
        run_dir.mkdir(parents=True, exist_ok=True)
        train(to_config(case), env, run_dir)


def records(run_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, (Path(run_dir) / "metrics.jsonl").read_text().splitlines())
            if "event" not in r]


def case(strategy: str, steps: int = 8, **overrides) -> dict:
    """A config dict: the tiny model, fp32, every step logged."""
    cfg = {"strategy": {"name": strategy}, "train": {"max_steps": steps, "log_every": 1, "micro_batch_size": 4},
           "optim": {"warmup_steps": 2}}
    for key, value in overrides.items():
        group, leaf = key.split("__")
        cfg.setdefault(group, {})[leaf] = value
    return cfg


def run_cli(*overrides: str, launcher: list[str] | None = None, timeout: int = 600, env: dict | None = None):
    cmd = (launcher or [sys.executable, "-m", "trainer"]) + list(overrides)
    full_env = {**os.environ, "DS_ACCELERATOR": "cpu", **(env or {})}
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=full_env)
