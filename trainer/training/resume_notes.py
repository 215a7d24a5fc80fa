"""What resuming a checkpoint changes against the run that saved it, said in one line each when a
run resumes (the checkpoint's TrainerState against this run's settings)."""
from __future__ import annotations

from pathlib import Path

from trainer.checkpoint.format import TrainerState
from trainer.checkpoint.resume import data_changes
from trainer.config import Config, OptimConfig
from trainer.training.schedule import lr_at


def distinct(a: float, b: float) -> tuple[str, str]:
    """a and b with the fewest significant digits (3 at least) that tell them apart."""
    digits = next((d for d in range(3, 18) if f"{a:.{d}g}" != f"{b:.{d}g}"), 17)
    return f"{a:.{digits}g}", f"{b:.{digits}g}"


def resume_notes(state: TrainerState | dict, cfg: Config, global_batch: int, total_steps: int,
                 run_dir: Path) -> list[str]:
    """What a resume changes against the run that saved the checkpoint (its trainer state, or the
    manifest's dict of it), one line each."""
    state = state if isinstance(state, TrainerState) else TrainerState.from_dict(state)
    notes, step, o = [], state.step, cfg.optim
    if changed := data_changes(state.data, cfg):
        notes.append(f"the checkpoint was trained on other data ({'; '.join(changed)}): this run starts its data at their "
                     f"beginning, not at the checkpoint's position (epoch {state.data['epoch']}, "
                     f"{state.data['samples_consumed']} samples in), which means nothing in other data")
    if state.global_batch is not None and state.global_batch != global_batch:
        notes.append(f"the checkpoint was trained at global batch {state.global_batch} and this run's is "
                     f"{global_batch}: the data order from here on, and so the losses, differ from those of the "
                     "run that saved it (the learning rate is not rescaled)")
    saved_end, end = state.schedule_steps, o.schedule_steps or total_steps
    if saved_end and saved_end != end:
        before = lr_at(step, saved_end, OptimConfig(**{**vars(o), "schedule_steps": saved_end}))
        after, trains = lr_at(step, total_steps, o), ""
        if after != before:  # inside the warmup they are the same
            now, then = distinct(after, before)
            trains = f"step {step + 1} trains at {now} instead of {then}; "
        notes.append(f"the learning-rate schedule now ends at step {end}, not {saved_end}: {trains}"
                     f"optim.schedule_steps={saved_end} keeps the old end")
    if state.run_dir and Path(state.run_dir) != run_dir:
        notes.append(f"the steps before {step + 1} are in {state.run_dir}/metrics.jsonl")
    if not cfg.checkpoint.dir:
        notes.append("no checkpoint.dir: nothing of this run is saved (checkpoint.resume only reads)")
    return notes
