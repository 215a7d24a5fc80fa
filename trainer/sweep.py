"""`trainer -m ...`: after the last job, one table comparing the jobs (a Hydra callback)."""
from __future__ import annotations

from pathlib import Path

import yaml
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from trainer.metrics import read_records


def job_summary(job_dir: Path) -> dict | None:
    metrics = job_dir / "metrics.jsonl"
    if not metrics.is_file():
        return None
    rows = read_records(metrics, events=True)
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
             f"{'grads MB':>8}  {'optim MB':>8}  (bytes per rank)"]
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
