"""`trainer [overrides]` == `python -m trainer [overrides]`: a Hydra app.

Started by a launcher (torchrun, accelerate, deepspeed, srun) each process is one rank; started
alone with nproc=N it spawns N local ranks with torch's elastic launcher.
"""
from __future__ import annotations

import gc
import logging
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import IO

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from trainer import distributed
from trainer.checkpoint.format import check_base, check_fingerprint, read_manifest
from trainer.checkpoint.resume import check_writable, hold_checkpoint_dir, resolve_resume
from trainer.checks import check_overrides, check_settings
from trainer.config import CONFIG_MODULE, Config, ModelKind, OnOom, PeftName, StrategyName, register_configs, to_config
from trainer.errors import (
    ERROR_EXIT_CODE,
    OUT_OF_MEMORY_EXIT_CODE,
    CheckpointError,
    ConfigError,
    RunError,
    signal_exit_code,
)
from trainer.hub import resolve_names
from trainer.launchers import take_local_rank, with_accelerate_choice
from trainer.log import QuietRankExits, log, refuse, setup_logging
from trainer.models import meta_model, param_shapes, resolve_model
from trainer.plan.auto import resolve_auto
from trainer.sweep import check_sweep
from trainer.training.faults import STOP_SIGNALS
from trainer.training.run import check_run_dir, exit_now, launched_worker, worker


def check_before_work(cfg: Config, world_size: int, run_dir: Path | None) -> IO | None:
    """Everything that can be wrong with the settings, found before a rank is started (the same
    on every rank of a launcher; the run dir, rank 0's alone, is then checked by `worker`). Returns
    the hold on checkpoint.dir, which the caller keeps for the run's life (the launching process,
    or rank 0 of a launcher: see hold_checkpoint_dir)."""
    held = None
    model, weights = check_settings(cfg, world_size)
    if cfg.checkpoint.dir and distributed.launcher_rank() == 0:  # one try: ranks that all try race to remove it
        check_writable(Path(cfg.checkpoint.dir))
        held = hold_checkpoint_dir(Path(cfg.checkpoint.dir))
    resume_from = resolve_resume(cfg.checkpoint)
    if resume_from:
        manifest = read_manifest(resume_from)
        check_fingerprint(manifest, param_shapes(model), resume_from)
        check_base(manifest.get("base"), weights.fingerprint, resume_from)
    if run_dir is not None:
        check_run_dir(run_dir, resume_from)
    return held


def take_foreign_resume(cfg: Config, run_dir: Path) -> str:
    """checkpoint.resume=DIR of another format (torch DCP, DeepSpeed, DeepSpeed universal, a Hugging
    Face folder): converted once, before any rank starts, into a step dir of ours in the run dir,
    which the ranks then resume from like any other; the resume setting that does that."""
    from trainer.checkpoint.convert import detect, read
    from trainer.checkpoint.format import write_step_dir

    resume = cfg.checkpoint.resume
    if resume in ("auto", "none") or not Path(resume).is_dir():
        return resume
    try:
        kind = detect(Path(resume))
    except CheckpointError:  # a step dir of ours without its manifest, say: read_manifest tells what is wrong
        return resume
    if kind == "trainer":
        return resume
    if distributed.launched_externally():
        raise ConfigError(f"checkpoint.resume: {resume} is a {kind} checkpoint; under a launcher each rank would "
                          f"convert it: convert it once first (python -m trainer.convert {resume} DIR --to trainer) "
                          "and resume from DIR")
    started = time.perf_counter()
    portable = read(Path(resume))
    portable.fit(param_shapes(meta_model(cfg.model, cfg.peft)))
    out = write_step_dir(portable, run_dir / f"converted-{kind}")
    held = sum(t.numel() * 4 for t in portable.tensors())
    log.info(f"checkpoint.resume: the {kind} checkpoint {resume} converted to {out} in "
             f"{time.perf_counter() - started:.1f} s, read whole in this process ({held / 1e9:.2f} GB of fp32 weights "
             f"and moments): {len(portable.weights)} weights, Adam moments of {len(portable.moments)}, step "
             f"{portable.step}" + (f"; it lacks {', '.join(portable.lacks)}" if portable.lacks else ""))
    return str(out)


def remove_refused_run_dir(run_dir: Path) -> None:
    """A run refused before any work leaves no run dir behind: only Hydra's files were in it."""
    if run_dir.is_dir() and {p.name for p in run_dir.iterdir()} <= {".hydra", "trainer.log"}:
        shutil.rmtree(run_dir)
        if run_dir.parent.parent.name == "outputs" and not any(run_dir.parent.iterdir()):
            run_dir.parent.rmdir()  # outputs/<date>/ that held only this run


def resolve_settings(cfg: DictConfig, world_size: int) -> Config:
    """Fill in what the settings leave to the trainer (the model's vocabulary and context, the
    planner's choice for strategy=auto) in `cfg` itself, which the ranks receive; the typed copy.
    Hub names become folders of the Hugging Face cache first (downloaded there where missing)."""
    resolve_names(cfg)
    model = resolve_model(to_config(cfg).model)
    cfg.model.seq_len, cfg.model.vocab_size = model.seq_len, model.vocab_size
    if "attn_implementation" in cfg.model:  # model=hf: `auto` resolved, the same on every rank
        cfg.model.attn_implementation = model.attn_implementation
    if cfg.strategy.name == StrategyName.auto:
        resolve_auto(cfg, world_size)
    return to_config(cfg)


OmegaConf.register_new_resolver("trainer_run_dir", distributed.run_dir_resolver, replace=True)
register_configs()


@hydra.main(version_base=None, config_path=f"pkg://{CONFIG_MODULE}", config_name="config")
def app(cfg: DictConfig):
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    first = distributed.launcher_rank() == 0  # the launching process, or rank 0 of a launcher
    setup_logging(run_dir if first else None, first, cfg.log_level)
    world = int(distributed.launcher_env().get("WORLD_SIZE", cfg.nproc))
    try:
        distributed.use_device(cfg.train.device)  # before DeepSpeed is imported
        if launches_ranks(cfg):  # their imports made once, beside this process's checks
            distributed.start_rank_server(rank_modules(cfg))
        typed = resolve_settings(cfg, world)
        typed.checkpoint.resume = cfg.checkpoint.resume = take_foreign_resume(typed, run_dir)
        # checkpoint.dir's lock, held while `held` lives: until this run (nproc=N: all its ranks) ends
        held = check_before_work(typed, world, None if distributed.launched_externally() else run_dir)  # noqa: F841
    except RunError as e:
        if first:
            remove_refused_run_dir(run_dir)
        refuse(e)
    if first:  # what runs, resolved (strategy=auto's choice, the model's vocabulary and context)
        OmegaConf.save(cfg, run_dir / ".hydra" / "config.yaml")
    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    if launches_ranks(cfg):  # torch's launcher takes the stop signals over as it starts the ranks
        return objective(launch_ranks(typed, cfg_dict, run_dir))
    say_stops_during_startup(False)  # this process is the rank: the run's own handler takes over as it starts
    if distributed.launched_externally():
        return objective(worker(cfg_dict, str(run_dir)))
    return objective(train_here(cfg, typed, cfg_dict, run_dir))


def launches_ranks(cfg: DictConfig) -> bool:
    """nproc=N started alone: this process launches the ranks. Under a launcher it is one; one rank
    runs in this process (train_here), unless max_restarts asks for the elastic launcher's restarts."""
    return not distributed.launched_externally() and (cfg.nproc > 1 or bool(cfg.max_restarts))


def train_here(cfg: DictConfig, typed: Config, cfg_dict: dict, run_dir: Path) -> dict:
    """One process, no max_restarts: its rank trains in this process, which starts it quickest. Where it
    runs out of memory with an adaptation left (oom.adaptation_left), it is restarted as nproc=N's ranks
    are, in a fresh process under the local launcher: its next round, by the same Restarts."""
    summary = worker(cfg_dict, str(run_dir), in_process=True)
    if summary is not None:
        return summary
    gc.collect()  # the round's tensors (some held in cycles) freed, and what CUDA cached of them, if it started
    torch.cuda.empty_cache()
    restarts = Restarts(typed, run_dir)
    restarts({0: SimpleNamespace(pid=os.getpid(), exitcode=OUT_OF_MEMORY_EXIT_CODE)})  # said; yes, as the rank found
    distributed.start_rank_server(rank_modules(cfg))
    return launch_ranks(typed, cfg_dict, run_dir, restarts, rounds_before=1)


def rank_modules(cfg: DictConfig) -> list[str]:
    """What the run's ranks import besides the trainer's loop, the slow ones: transformers' model
    code (model=hf: 2 s here), PEFT (LoRA), DeepSpeed (strategy=zero*: 1 s)."""
    modules = ["trainer.training.loop"]
    if cfg.model.get("kind") == ModelKind.hf:
        modules.append("transformers.modeling_utils")
    if cfg.get("peft") and cfg.peft.name == PeftName.lora:
        modules.append("peft")
    if cfg.strategy.name in (StrategyName.zero1, StrategyName.zero2, StrategyName.zero3):
        modules.append("trainer.strategies.deepspeed")
    return modules


def launch_ranks(cfg: Config, cfg_dict: dict, run_dir: Path, restarts: Restarts | None = None,
                 rounds_before: int = 0) -> dict:
    """nproc=N: the ranks under torch's elastic launcher. One rule for how it ends (trainer/errors.py):
    ranks that left with a code that says why (ERROR_EXIT_CODE: rank 0 printed the error; a stop
    signal's: they saved and stopped; OUT_OF_MEMORY_EXIT_CODE: the rank said so) are passed on as they
    are, the highest of their codes, without a traceback (the peers of a rank out of memory fail in
    their collective after it left); a stop also says where the ranks stopped. A rank that dies or
    fails otherwise stops the others (torch's launcher does) and is named in one line. rounds_before:
    the rounds the rank already ran in this process (train_here), whose Restarts go on counting."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    said_codes = {signal_exit_code(sig) for sig in STOP_SIGNALS} | {ERROR_EXIT_CODE, OUT_OF_MEMORY_EXIT_CODE}
    for name in ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api",
                 "torch.multiprocessing.spawn"):  # "Terminating process N via signal SIGTERM": the rank's peers
        logging.getLogger(name).addFilter(QuietRankExits(said_codes))
    adaptations = cfg.train.max_adaptations if cfg.train.on_oom is OnOom.adapt else 0
    try:
        return distributed.launch_local(cfg.nproc, launched_worker, cfg_dict, str(run_dir),
                                        max_restarts=cfg.max_restarts + adaptations,
                                        shutdown_timeout_s=cfg.shutdown_timeout_s,
                                        restart=restarts or Restarts(cfg, run_dir), rounds_before=rounds_before)[0]
    except SignalException as e:  # to this process: passed on to the ranks, which saved and stopped
        exit_code = signal_exit_code(e.sigval)
    except ChildFailedError as e:
        codes = {f.exitcode for f in e.failures.values()}
        # A rank that said why it left alone (out of memory): its peers failed in a collective after it
        if not codes <= said_codes and not codes & {ERROR_EXIT_CODE, OUT_OF_MEMORY_EXIT_CODE}:
            sys.exit(rank_failure(cfg, *e.get_first_failure()))
        exit_code = max(codes & said_codes)
    if exit_code not in (ERROR_EXIT_CODE, OUT_OF_MEMORY_EXIT_CODE):
        sys.stderr.write(f"trainer: stopped by a signal{unsaid_stop(run_dir)}; exit code {exit_code}\n")
    sys.exit(exit_code)


def unsaid_stop(run_dir: Path) -> str:
    """What the ranks did not say themselves: rank 0's `SIGTERM: all ranks stopped after step N; saved
    ...` line says where they stopped, once, beside their `preempted` record. Without it, the ranks
    were stopped before their stop handler was in place, while they started, or were killed before
    they could say it (the steps they recorded say how far they got)."""
    import json

    metrics = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    if any(r.get("event") == "preempted" for r in records):
        return ""
    steps = [r["step"] for r in records if "loss" in r and "event" not in r and "split" not in r]
    if not steps:
        return " while the ranks were starting, before their first step: nothing to save"
    return f" after step {steps[-1]}, before the ranks said where they stopped; see {metrics}"


def what_happened(rank: int, failure) -> str:
    """A rank that died (a signal: no traceback to show) or raised (torch's launcher logged its traceback)."""
    cause = (f"was killed by {failure.signal_name()}" if failure.exitcode < 0 else
             "ran out of memory (its line is above)" if failure.exitcode == OUT_OF_MEMORY_EXIT_CODE else
             f"failed with exit code {failure.exitcode} (its traceback is above)")
    return f"rank {rank} (pid {failure.pid}) {cause}"


def rank_failure(cfg: Config, rank: int, failure) -> str:
    """The line that ends a launch whose rank died or raised."""
    restarts = f" after max_restarts={cfg.max_restarts} restarts" if cfg.max_restarts else ""
    resume = (f"; the same command resumes from the newest checkpoint in {cfg.checkpoint.dir}"
              if cfg.checkpoint.dir else "")
    return f"trainer: error: {what_happened(rank, failure)}{restarts}; the other ranks were stopped{resume}"


class Restarts:
    """The two budgets of the ranks' restarts under this process's launcher, which gives torch's agent
    their sum: a round where a rank ran out of memory restarts the ranks to adapt while an adaptation
    is left (oom.adaptation_left, by which the rank's own line goes too); any other failure takes one
    of max_restarts. Each restart is said, for each rank that failed, before it."""

    def __init__(self, cfg: Config, run_dir: Path):
        self.cfg, self.run_dir, self.faults = cfg, run_dir, 0

    def __call__(self, failures: dict) -> bool:
        from trainer.oom import adaptation_left, read_oom_records

        if any(failure.exitcode == OUT_OF_MEMORY_EXIT_CODE for failure in failures.values()):
            recorded = [r for r in read_oom_records(self.run_dir) if r["event"] == "out_of_memory"][-1]
            if not adaptation_left(recorded, self.cfg):  # the rank said so: the job ends
                return False
            restart = (f"restarting to adapt (adaptation {recorded['plan']['adaptations'] + 1} of "
                       f"train.max_adaptations={self.cfg.train.max_adaptations})")
        elif self.faults < self.cfg.max_restarts:
            self.faults += 1
            restart = f"restart {self.faults} of {self.cfg.max_restarts}"
        else:
            return False
        resume = (f"resuming from the newest checkpoint in {self.cfg.checkpoint.dir}" if self.cfg.checkpoint.dir
                  else "starting over (no checkpoint.dir)")
        for rank, failure in sorted(failures.items()):
            sys.stderr.write(f"trainer: {what_happened(rank, failure)}; {restart}, {resume}\n")
        sys.stderr.flush()
        return True


def objective(summary: dict) -> float | None:
    """What a Hydra sweeper minimises (hydra/sweeper=optuna): the final val loss, else the final loss."""
    return summary.get("val_loss", summary.get("loss"))


def stopped_during_startup(signum: int, frame) -> None:
    """A stop signal while the launching process checks the settings and starts the ranks (until
    torch's launcher takes over, or the rank in this process): nothing has trained, so nothing to save;
    said, not a silent exit. Raised, not an exit from the handler: the signal may come while this
    process holds a lock that leaving takes again (starting the rank server holds its lock)."""
    exit_code = signal_exit_code(signum)
    sys.stderr.write(f"trainer: stopped by {signal.Signals(signum).name} during start-up, before any rank "
                     f"started training: nothing to save; exit code {exit_code}\n")
    sys.exit(exit_code)


def say_stops_during_startup(on: bool) -> None:
    """stopped_during_startup as the stop signals' handler, or Python's own again (SIGINT's raises
    KeyboardInterrupt; the others' is the system's, which ends the process)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, stopped_during_startup if on else
                      signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)


def main() -> None:
    if not distributed.launched_externally():  # a launcher's rank: its launcher says how it ended
        say_stops_during_startup(True)
    try:
        sys.argv[1:] = with_accelerate_choice(take_local_rank(sys.argv[1:]))
        check_overrides(sys.argv[1:])
        check_sweep(sys.argv[1:])  # trainer -m: every job's settings, before the first job
    except RunError as e:
        refuse(e)
    app()
    # Done (an error would have left with its exit code): no interpreter teardown, half a second of
    # torch's here after every command, and where gloo can abort after backward (FACTS.md): a rank of
    # an external launcher too. Logs are written through. (Under submitit, hydra/launcher=slurm, the
    # job process runs `app` alone and returns its value to submitit.)
    exit_now(0)


if __name__ == "__main__":
    main()
