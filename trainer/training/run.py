"""A rank's life: join the group, train, leave. `worker` is the CLI's; `in_group` + `train_configs`
serve tests and benchmarks that train several configs in one process group."""
from __future__ import annotations

import atexit
import os
import sys
import time
from pathlib import Path

from trainer import distributed
from trainer.checkpoint.resume import resolve_resume
from trainer.config import Config, OnOom, to_config
from trainer.errors import ERROR_EXIT_CODE, OUT_OF_MEMORY_EXIT_CODE, ConfigError, RunError
from trainer.oom import OutOfMemory, adaptation_left, append, failure_line
from trainer.training.faults import Stopped

PEER_FIRST_S = 1.0  # > the elastic launcher's monitor_interval (0.1 s, distributed.launch_local)


def worker(cfg_dict: dict, run_dir: str, adapting_launcher: bool = False, in_process: bool = False) -> dict | None:
    """One rank's life; its summary. adapting_launcher: started by the trainer's own launcher, which
    restarts the ranks to adapt to an out-of-memory within train.max_adaptations (trainer/__main__.py).
    in_process: the one rank of a process that no launcher started, which restarts it so too: None
    where it ran out of memory with an adaptation left (said, recorded, out of its group)."""
    from trainer.training.loop import train

    env = distributed.init(cfg_dict["collective_timeout_s"])
    try:
        run_dir = Path(distributed.broadcast_object(run_dir))
        cfg = to_config(cfg_dict)
        if distributed.launched_externally():  # rank 0's run dir, its answer for every rank
            distributed.on_main(lambda: check_run_dir(run_dir, resolve_resume(cfg.checkpoint)))
        summary = train(cfg, env, run_dir)
    except Stopped as stopped:  # saved and recorded: leave with the signal's exit code, quietly
        leave(stopped.exit_code)
    except OutOfMemory as oom:  # this rank alone: its peers fail in their next collective
        leave_out_of_memory(oom.failure, cfg, run_dir, adapting_launcher or in_process, in_process)
        return None
    except RunError as e:  # the same on every rank: said once, in one line
        if env.is_main:
            print(f"trainer: error: {e}", file=sys.stderr)
        leave(ERROR_EXIT_CODE)
    except BaseException:
        # A peer may be dead or hung (a collective failed): leave now, with the traceback for the
        # launcher, rather than wait for it at a barrier for another collective_timeout_s. A moment
        # later than a peer that died or left on its own (out of memory): the launcher names the
        # rank whose exit it sees first, and this one failed because of that peer.
        distributed.shutdown(peers_alive=False)
        time.sleep(PEER_FIRST_S)
        raise
    distributed.shutdown()
    return summary


def launched_worker(cfg_dict: dict, run_dir: str) -> dict:
    """`worker` in a rank process of the local launcher (nproc=N). Its summary returned (the
    launcher reads it before the process exits), the rank leaves without the interpreter's
    teardown: 0.9 s of every run's end here, and where gloo can abort (FACTS.md)."""
    summary = worker(cfg_dict, run_dir, adapting_launcher=True)
    atexit.register(exit_now, 0)  # registered last, run first: the other exit handlers are skipped
    return summary


def exit_now(exit_code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    distributed.stop_rank_server()  # atexit's handlers do not run
    os._exit(exit_code)


def check_run_dir(run_dir: Path, resume_from: Path | None) -> None:
    """A run dir holds one run: a new run refuses one with another run's metrics.jsonl. A run that
    resumes, or a group restarted by torch's elastic agent, appends to its own."""
    if (run_dir / "metrics.jsonl").exists() and not resume_from and not distributed.restart_count():
        raise ConfigError(f"hydra.run.dir: {run_dir} already holds another run's metrics.jsonl; give another "
                          "hydra.run.dir (a run that resumes from a checkpoint appends to its own)")


def leave_out_of_memory(failure: dict, cfg: Config, run_dir: Path, adapting_launcher: bool,
                        in_process: bool = False) -> None:
    """Recorded in the run dir (for the restart, and the planner), said by this rank in one line,
    gone without a barrier: its peers are waiting for it in a collective. The trainer's own launcher
    restarts the ranks for every adaptation the line says; another launcher, while it has restarts left.
    in_process: the process stays where an adaptation is left, for the restart it makes."""
    append(run_dir, failure)
    restart = adapting_launcher or distributed.restart_count() < int(os.environ.get("TORCHELASTIC_MAX_RESTARTS") or 0)
    print(f"trainer: error: {failure_line(failure, cfg, restart)}", file=sys.stderr)
    distributed.shutdown(peers_alive=False)
    if not (in_process and adaptation_left(failure, cfg)):
        exit_now(ERROR_EXIT_CODE if cfg.train.on_oom is OnOom.fail else OUT_OF_MEMORY_EXIT_CODE)


def leave(exit_code: int) -> None:
    distributed.shutdown()
    exit_now(exit_code)  # no interpreter teardown, where gloo can abort (FACTS.md)


def in_group(fn, *args):
    """fn(env, *args) inside a process group that lives exactly as long as the call."""
    env = distributed.init()
    try:
        return fn(env, *args)
    finally:
        distributed.shutdown()


def train_configs(env, configs: dict[str, dict], out_dir: str) -> None:
    """Train each config (plain dicts, as Hydra would give) in turn, into out_dir/<name>/."""
    from trainer.training.loop import train

    for name, cfg in configs.items():
        run_dir = Path(out_dir) / name
        run_dir.mkdir(parents=True, exist_ok=True)
        train(to_config(cfg), env, run_dir)
