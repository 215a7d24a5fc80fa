"""What other launchers add to our command line, turned into plain Hydra overrides.

- The deepspeed launcher appends `--local_rank=N`, which Hydra would reject: it becomes
  LOCAL_RANK (the launcher sets RANK/WORLD_SIZE/MASTER_* itself).
- `accelerate launch` with a DeepSpeed or FSDP config exports its choice as ACCELERATE_*/FSDP_*
  variables: followed when the command line does not choose, an error when it disagrees.
"""
from __future__ import annotations

import os
import re

from trainer.errors import ConfigError

LOCAL_RANK_ARG = re.compile(r"^--local[_-]rank(?:=(\d+))?$")
FSDP_SHARDING = {"1": "FULL_SHARD", "2": "SHARD_GRAD_OP", "3": "NO_SHARD", "4": "HYBRID_SHARD"}


def take_local_rank(argv: list[str], environ=os.environ) -> list[str]:
    """argv without the deepspeed launcher's `--local_rank=N` / `--local_rank N`."""
    out, i = [], 0
    while i < len(argv):
        match = LOCAL_RANK_ARG.match(argv[i])
        if not match:
            out.append(argv[i])
            i += 1
            continue
        value = match.group(1)
        if value is None and i + 1 < len(argv):
            value, i = argv[i + 1], i + 1
        environ.setdefault("LOCAL_RANK", value)
        i += 1
    return out


def accelerate_choice(environ=os.environ) -> dict[str, str]:
    """The overrides an accelerate config asks for (empty outside `accelerate launch`)."""
    choice = {}
    if environ.get("ACCELERATE_USE_DEEPSPEED") == "true":
        choice["strategy"] = f"zero{environ.get('ACCELERATE_DEEPSPEED_ZERO_STAGE', '2')}"
        if environ.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "none") == "cpu":
            choice["strategy.offload_optimizer"] = "true"
        if environ.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "none") == "cpu":
            choice["strategy.offload_params"] = "true"
    elif environ.get("ACCELERATE_USE_FSDP") == "true":
        choice["strategy"] = "fsdp"
        sharding = environ.get("FSDP_SHARDING_STRATEGY")
        if sharding:
            choice["strategy.sharding"] = FSDP_SHARDING.get(sharding, sharding.upper())
        if environ.get("FSDP_OFFLOAD_PARAMS") == "true":
            choice["strategy.offload_params"] = "true"
    precision = environ.get("ACCELERATE_MIXED_PRECISION")
    if precision in ("bf16", "fp16"):
        choice["train.precision"] = precision
    return choice


def with_accelerate_choice(argv: list[str], environ=os.environ) -> list[str]:
    given = dict(arg.split("=", 1) for arg in argv if "=" in arg and not arg.startswith("-"))
    added = []
    for key, value in accelerate_choice(environ).items():
        if key not in given:
            added.append(f"{key}={value}")
        elif given[key] != value:
            raise ConfigError(f"{key}: the command line says {key}={given[key]} but the accelerate config says "
                              f"{value}; drop one of them")
    return argv + added
