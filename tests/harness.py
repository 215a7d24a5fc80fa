"""Run functions on real gloo process groups of N local ranks, and the trainer CLI."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trainer import distributed
from trainer.errors import ERROR_EXIT_CODE
from trainer.training.run import in_group
from trainer.training.run import train_configs as train_cases  # noqa: F401 (used by the tests)

REPO = Path(__file__).resolve().parent.parent
# DeepSpeed's accelerator, for processes the tests start: the CPU where there is no GPU; on a
# GPU box the trainer chooses (train.device) and DeepSpeed follows.
CPU_ONLY = {} if torch.cuda.is_available() else {"DS_ACCELERATOR": "cpu"}
# What the tests' ranks import, once per test process (distributed.start_rank_server) instead of in each rank
RANK_MODULES = ["trainer.training.loop", "transformers.modeling_utils", "trainer.strategies.deepspeed"]


def on_ranks(nproc: int, fn, *args):
    """fn(env, *args) on `nproc` ranks of one gloo group, launched as `nproc=N` does (the elastic
    launcher does not suffer the gloo exit crash of FACTS.md). Returns {rank: fn's result}."""
    distributed.start_rank_server(RANK_MODULES)
    return distributed.launch_local(nproc, in_group, fn, *args)


def records(run_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, (Path(run_dir) / "metrics.jsonl").read_text().splitlines())
            if "event" not in r]


def mlflow_runs(run_dir: Path) -> tuple:
    """MLflow's client of a run dir's default local store (logger=mlflow: a SQLite file), and its runs."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{Path(run_dir).resolve() / 'mlflow.db'}")
    return client, client.search_runs([client.get_experiment_by_name("trainer").experiment_id])


# The crossings of features the tests run: the pairs listed where a test gives them (every value of
# each axis at least once, the pairs that once broke), or the full product with
# TRAINER_TEST_FULL_MATRIX=1 (`make test-matrix`): a cell the list leaves out adds launch time to
# every run and, on its own, found nothing the listed cells did not.
FULL_MATRIX = os.environ.get("TRAINER_TEST_FULL_MATRIX") == "1"


def crossings(axes: tuple[list, list], listed: list[tuple]) -> list[tuple]:
    """`listed` (each pair from the two axes), or every pair of the axes under FULL_MATRIX."""
    first, second = axes
    assert {a for a, _ in listed} == set(first) and {b for _, b in listed} == set(second), \
        f"every value of each axis at least once: {listed}"
    return [(a, b) for a in first for b in second] if FULL_MATRIX else list(listed)


# The parity tolerance of fp32 losses. Measured here (tiny model, 8 steps): the largest relative loss
# difference between backends, world sizes and accumulation splits was 3e-7 (ZeRO-3: another
# reduction order); DDP/FSDP/ZeRO-1/2 gave equal losses.
LOSS_RTOL = 2e-6


def losses(rows: list[dict]) -> list[float]:
    return [r["loss"] for r in rows]


def assert_close(actual: list[float], expected: list[float], what: str = "", rtol: float = LOSS_RTOL) -> None:
    """Two runs' values (losses, norms), step by step: as many, each within `rtol` (0: bitwise)."""
    assert len(actual) == len(expected) > 0, (what, actual, expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert abs(a - e) <= rtol * abs(e), f"{what}: value {i + 1}: {a} vs {e} (rtol {rtol})"


def saving(cfg: dict, ckpt: Path, every: int) -> dict:
    """`cfg` checkpointing into `ckpt` every `every` steps, keeping every checkpoint."""
    return with_overrides(cfg, checkpoint__dir=str(ckpt), checkpoint__every_steps=every, checkpoint__keep_last=0)


def resuming(cfg: dict, ckpt: Path, step: int) -> dict:
    """`cfg` resumed from the checkpoint of step `step` in `ckpt`."""
    return with_overrides(cfg, checkpoint__resume=str(Path(ckpt) / f"step_{step:08d}"))


def assert_resumes(resumed: list[dict], straight: list[dict], at: int, what: str = "", rtol: float = 0.0,
                   same_batch: bool = True) -> None:
    """A run resumed at step `at` logs the steps after it as `straight`, a run that never stopped,
    logged every step, did: the same steps and learning rates, the same losses (rtol 0: bitwise for
    the same strategy and world size, docs/design.md, Checkpoints) or within `rtol` (another backend), and,
    at the same global batch, the same token counts (targets and inputs). Evaluation lines are compared apart."""
    resumed, straight = ([r for r in rows if "split" not in r] for rows in (resumed, straight))
    tail = [r for r in straight if r["step"] > at]
    assert [r["step"] for r in resumed] == [r["step"] for r in tail] == list(range(at + 1, at + 1 + len(tail))), what
    assert [r["lr"] for r in resumed] == [r["lr"] for r in tail], what
    if same_batch:
        for count in ("tokens", "input_tokens"):
            assert [r[count] for r in resumed] == [r[count] for r in tail], (what, count)
    assert_close(losses(resumed), losses(tail), what, rtol)


def train_and_resume(nproc: int, cfg: dict, out: Path, at: int, resume_nproc: int | None = None) -> tuple[list, list]:
    """Train `cfg` on `nproc` ranks into out/straight, checkpointing at step `at` (and its end), then
    resume it from step `at` in a fresh launch (on `resume_nproc` ranks) into out/resumed.
    Returns both runs' records, evaluation lines included."""
    ckpt = Path(out) / "ckpt"
    on_ranks(nproc, train_cases, {"straight": saving(cfg, ckpt, at)}, str(out))
    on_ranks(resume_nproc or nproc, train_cases, {"resumed": resuming(cfg, ckpt, at)}, str(out))
    return records(Path(out) / "straight"), records(Path(out) / "resumed")


def with_overrides(base: dict, **overrides) -> dict:
    """A copy of a config dict with `group__leaf=value` overrides applied."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for key, value in overrides.items():
        group, leaf = key.split("__")
        out.setdefault(group, {})[leaf] = value
    return out


def case(strategy: str, steps: int = 8, **overrides) -> dict:
    """A config dict: the tiny model, fp32, every step logged, batches loaded in the rank's own
    process (the loader's worker processes are tested with the CLI runs of tests/test_your_data.py)."""
    base = {"strategy": {"name": strategy}, "train": {"max_steps": steps, "log_every": 1, "micro_batch_size": 4},
            "logger": {"jsonl": {}}, "data": {"num_workers": 0},
            "optim": {"warmup_steps": 2}}
    return with_overrides(base, **overrides)


def full_state(strategy, model_only: bool = True) -> dict | None:
    """The strategy's portable state, whole, on rank 0 (None elsewhere): its ranks' pieces joined.
    model_only: the weights by parameter name; else every key (model.NAME, optim.NAME.exp_avg, optim.step)."""
    import math

    import torch.distributed as dist

    from trainer.checkpoint.format import STEP_KEY, state_keys
    from trainer.models import param_shapes

    pieces = {k: (p.start, p.tensor.detach().float().cpu().clone(), p.block)
              for k, p in strategy.state_dict(model_only).items()}
    gathered = [None] * strategy.env.world_size if strategy.env.is_main else None
    dist.gather_object(pieces, gathered, dst=0)
    if not strategy.env.is_main:
        return None
    shapes = {key: shape for name, shape in param_shapes(strategy.module, strategy.full_shape).items()
              for key in state_keys(name).values()}
    shapes[STEP_KEY] = (1,)
    full: dict[str, torch.Tensor] = {}
    for rank_pieces in gathered:
        for key, (start, values, block) in rank_pieces.items():  # a block: columns, at their places
            at = block.positions(start, values.numel()) if block else slice(start, start + values.numel())
            full.setdefault(key, torch.empty(math.prod(shapes[key])))[at] = values
    return {(key.removeprefix("model.") if model_only else key): flat.view(shapes[key]) for key, flat in full.items()}


def run_cli(*overrides: str, launcher: list[str] | None = None, timeout: int = 600, env: dict | None = None,
            cwd: Path = REPO):
    cmd = (launcher or [sys.executable, "-m", "trainer"]) + list(overrides)
    full_env = {**os.environ, **CPU_ONLY, **(env or {})}
    if launcher is None and cwd == REPO and not any(o.startswith("hydra.run.dir=") for o in overrides):
        # A run dir of its own, not outputs/DATE/TIME of the repo: tests in parallel workers
        # (make test's `-n`) may start in the same second.
        full_env.setdefault("TRAINER_RUN_DIR", tempfile.mkdtemp(prefix="trainer-test-run-"))
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=full_env)


class CollectiveBytes(TorchDispatchMode):
    """Counts the payload of every c10d collective dispatched inside (DDP's reducer, FSDP2 and
    DeepSpeed alike, and DTensor's functional collectives: strategy.tp's): a tensor's full size per
    all-reduce, reduce-scatter, all-gather or broadcast."""

    KINDS = {"allreduce_": "all_reduce", "_reduce_scatter_base_": "reduce_scatter",
             "reduce_scatter_tensor_coalesced_": "reduce_scatter", "_allgather_base_": "all_gather",
             "allgather_into_tensor_coalesced_": "all_gather", "broadcast_": "broadcast"}
    FUNCTIONAL_KINDS = {"all_reduce": "all_reduce", "all_reduce_": "all_reduce",
                        "reduce_scatter_tensor": "reduce_scatter", "all_gather_into_tensor": "all_gather"}

    def __init__(self):
        super().__init__()
        self.bytes = {"all_reduce": 0, "reduce_scatter": 0, "all_gather": 0, "broadcast": 0, "other": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            sizes = []
            for value in args:  # inputs and outputs: the larger is the collective's full tensor
                tensors = [t for t in (value if isinstance(value, (list, tuple)) else [value])
                           for t in (t if isinstance(t, (list, tuple)) else [t]) if isinstance(t, torch.Tensor)]
                sizes.append(sum(t.numel() * t.element_size() for t in tensors))
            self.bytes[self.KINDS.get(func.__name__.split(".")[0], "other")] += max(sizes, default=0)
        elif func.namespace == "_c10d_functional" and func.__name__.split(".")[0] in self.FUNCTIONAL_KINDS:
            out = func(*args, **(kwargs or {}))  # the larger of its input and output is the full tensor
            self.bytes[self.FUNCTIONAL_KINDS[func.__name__.split(".")[0]]] += max(
                args[0].numel() * args[0].element_size(), out.numel() * out.element_size())
            return out
        return func(*args, **(kwargs or {}))


def auto_resolved(overrides: list[str], world_size: int, caplog) -> tuple:
    """strategy=auto's settings for the CLI `overrides` at `world_size` ranks (trainer.__main__'s
    resolve_settings, before any rank starts), and the line it said of its choice."""
    import logging

    from hydra import compose, initialize_config_module

    from trainer.__main__ import resolve_settings
    from trainer.config import CONFIG_MODULE

    with initialize_config_module(config_module=CONFIG_MODULE, version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    with caplog.at_level(logging.INFO, logger="trainer"):
        resolved = resolve_settings(cfg, world_size)
    said = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("strategy=auto chose"))
    return cfg, resolved, said


def refused_by(check, *args) -> str | None:
    """The one line a check before work refuses `args` with (its ConfigError), or None: it accepts
    them. So a test of what a check accepts asserts `is None` beside the case it refuses."""
    from trainer.errors import ConfigError

    try:
        check(*args)
    except ConfigError as refused:
        return str(refused)
    return None


def refusal(run_dir: Path, *overrides: str) -> str:
    """The error the CLI stops with before any rank starts, found in this process: the same
    overrides check, composition, resolution and checks as `trainer` (trainer/__main__.py), which
    prints it on one line and exits 2 (`assert_refused` checks that of a command's result)."""
    from hydra import compose, initialize_config_module

    from trainer.__main__ import check_before_work, resolve_settings
    from trainer.checks import check_overrides
    from trainer.config import CONFIG_MODULE
    from trainer.errors import ConfigError

    try:
        check_overrides(list(overrides))
        with initialize_config_module(config_module=CONFIG_MODULE, version_base=None):
            cfg = compose(config_name="config", overrides=list(overrides))
        check_before_work(resolve_settings(cfg, int(cfg.nproc)), int(cfg.nproc), run_dir)
    except ConfigError as e:
        assert "\n" not in str(e), f"not one line: {e}"  # the CLI prints it as `trainer: error: ...`
        return str(e)
    raise AssertionError(f"not refused: {overrides}")


def assert_refused(result: subprocess.CompletedProcess, *fragments: str, prog: str = "trainer",
                   details: bool = False) -> str:
    """A command that stopped on purpose (trainer.log.refuse, and the ranks alike): exit code 2 and
    one line `PROG: error: ...` holding every fragment, no traceback. `details`: an error that lists
    what it found (a checkpoint of another model: the parameters that differ) may follow its line
    with indented ones. Returns the error."""
    stderr = result.stderr
    assert result.returncode == ERROR_EXIT_CODE, f"exit code {result.returncode}:\n{stderr[-3000:]}"
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = stderr.strip().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(f"{prog}: error: ")]
    assert len(starts) == 1, stderr[-3000:]
    error = [lines[starts[0]]]
    for line in lines[starts[0] + 1:]:
        if not line.startswith("  "):  # a launcher's lines after the ranks left (none but the error's own are indented)
            break
        error.append(line)
    assert len(error) == 1 or details, stderr[-3000:]
    error = "\n".join(error)
    for fragment in fragments:
        assert fragment in error, f"{fragment!r} not in: {error}"
    return error


def assert_saved_the_fp32_start(configs: dict[str, dict], root: Path) -> None:
    """Each run of `configs` (the built-in model, lr 0, one step, its checkpoint in root / name) saved
    its parameters' fp32 starting values themselves, bit for bit."""
    from trainer.checkpoint.format import PieceReader, read_manifest
    from trainer.config import to_config
    from trainer.models.builtin import Transformer, shape_of
    from trainer.models.weights import InitWeights, allocate_params, fill, params_on_meta

    cfg = to_config(next(iter(configs.values())))
    with params_on_meta():
        model = Transformer(shape_of(cfg.model))
    allocate_params(model, torch.device("cpu"))
    fill(model, InitWeights(model, cfg.train.seed))
    for name in configs:
        path = Path(root) / name / "step_00000001"
        reader = PieceReader(path, read_manifest(path))
        for key, value in model.named_parameters():
            assert torch.equal(reader.read_full(f"model.{key}"), value.detach()), (name, key)
