"""`trainer -m ...`: every job's settings checked before the first job starts (`check_sweep`), and
after the last job, one table comparing the jobs (a Hydra callback)."""
from __future__ import annotations

import itertools
from pathlib import Path

import yaml
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, open_dict

from trainer.errors import ConfigError
from trainer.metrics import read_metrics

MULTIRUN_FLAGS = ("-m", "--multirun")
# Flags after which Hydra composes from configs other than ours: their jobs are checked as each starts.
OWN_CONFIG_FLAGS = ("-cd", "--config-dir", "-cp", "--config-path", "-cn", "--config-name")


def sweep_jobs(args: list[str]) -> list[list[str]]:
    """The overrides of each job of `trainer -m ARGS` under Hydra's basic sweeper (every
    combination of the swept values, in its order); none when ARGS is no such sweep: a single run,
    a sweeper that picks the values itself (hydra/sweeper=optuna_lr) or configs of the user's."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if not any(a in MULTIRUN_FLAGS for a in args) or any(a.startswith(OWN_CONFIG_FLAGS) for a in args):
        return []
    overrides = [a for a in args if not a.startswith("-") and "=" in a]
    if any(o.split("=", 1)[0].lstrip("+~") == "hydra/sweeper" and o.split("=", 1)[1] != "basic" for o in overrides):
        return []
    parsed = OverridesParser.create().parse_overrides(overrides)
    choices = [[f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] if o.is_discrete_sweep() else [text]
               for o, text in zip(parsed, overrides)]
    return [list(job) for job in itertools.product(*choices)]


def check_sweep(args: list[str]) -> None:
    """Each job of a sweep through the settings checks that a single run makes before any rank starts
    (`validate`, after Hydra's composition and the typed config), before the first job starts: a
    sweep does not train its first jobs to fail at a later one. The checks that read files (data, a
    model folder, a checkpoint) run as each job starts."""
    from hydra import compose, initialize_config_module

    from trainer.checks import validate
    from trainer.config import CONFIG_MODULE, to_config

    jobs = sweep_jobs(args)
    if len(jobs) < 2:
        return
    with initialize_config_module(config_module=CONFIG_MODULE, version_base=None):
        for number, job in enumerate(jobs):
            try:
                cfg = compose(config_name="config", overrides=job, return_hydra_config=True)
            except Exception:  # noqa: BLE001 (Hydra's own refusal, a missing plugin say: Hydra says it as it starts)
                return
            with open_dict(cfg):
                del cfg["hydra"]
            try:
                validate(to_config(cfg))
            except ConfigError as e:
                varied = [o for o in job if not all(o in other for other in jobs)]
                raise ConfigError(f"{e} (in job {number} of the sweep, {' '.join(varied)}; no job was started)") \
                    from None


def job_summary(job_dir: Path) -> dict | None:
    metrics = job_dir / "metrics.jsonl"
    if not metrics.is_file():
        return None
    rows = read_metrics(metrics, events=True)
    steps = [r for r in rows if "event" not in r]
    if not steps:
        return None
    last = steps[-1]
    overrides = yaml.safe_load((job_dir / ".hydra" / "overrides.yaml").read_text()) or []
    vals = [r["loss"] for r in rows if r.get("split") == "val"]
    return {"overrides": overrides, "finished": rows[-1].get("event") == "end", "loss": last["loss"],
            "val_loss": vals[-1] if vals else None,
            "tokens_per_s": last["tokens_per_s"], **{k: last["mem"][k] for k in ("params", "grads", "optim")}}


def summary_table(sweep_dir: Path) -> str:
    jobs = sorted((p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    rows = [(p.name, job_summary(p)) for p in jobs]
    shared = set.intersection(*(set(s["overrides"]) for _, s in rows if s)) if any(s for _, s in rows) else set()
    for _, s in rows:
        if s:  # name each job by what the sweep varies
            s["job"] = " ".join(o for o in s["overrides"] if o not in shared)
    width = max([len(s["job"]) for _, s in rows if s] + [4])
    lines = [f"{'#':>3}  {'job':<{width}}  {'loss':>8}  {'val loss':>8}  {'tokens/s':>9}  {'params MB':>9}  "
             f"{'grads MB':>8}  {'optim MB':>8}  (what rank 0 holds; 1 MB = 10^6 bytes)"]
    for num, s in rows:
        if s is None:
            lines.append(f"{num:>3}  no metrics (failed before its first logged step)")
            continue
        val = f"{s['val_loss']:>8.4f}" if s["val_loss"] is not None else f"{'-':>8}"
        lines.append(f"{num:>3}  {s['job']:<{width}}  {s['loss']:>8.4f}  {val}  {s['tokens_per_s']:>9.0f}  "
                     f"{s['params'] / 1e6:>9.2f}  {s['grads'] / 1e6:>8.2f}  {s['optim'] / 1e6:>8.2f}"
                     + ("" if s["finished"] else "  (unfinished)"))
    return "\n".join(lines)


class SweepSummary(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if sweep_dir.is_dir():
            print(f"\n[trainer] sweep summary ({sweep_dir}):\n{summary_table(sweep_dir)}", flush=True)
