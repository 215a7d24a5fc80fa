"""Where a run's records go (docs/design.md, Loggers): `logger=jsonl|tensorboard|wandb|mlflow`, or a list.

Every logger gets the same things, from rank 0 only: the resolved config (as hyperparameters),
each logged step, each evaluation, events (resumed, ...) and a final summary. jsonl writes
them as they are (metrics.jsonl, docs/design.md, Step records), for every run, whatever else is listed: it is the
run's record, which the stop line, the run-dir guard, `python -m trainer.metrics` and the sweep
table read. The others get the numbers, named `train/loss`, `train/lr`, `mem/params`,
`val/loss`, ..., at the record's step.
"""
from __future__ import annotations

import dataclasses
import enum
import json
import logging
import os
import time
from pathlib import Path

from trainer.config import Config, LoggerConfig
from trainer.errors import ERROR_EXIT_CODE, ConfigError, RunError
from trainer.log import log
from trainer.training.faults import Stopped


def flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat(value, f"{name}."))
        else:
            out[name] = value.value if isinstance(value, enum.Enum) else value
    return out


def hyperparameters(cfg: Config) -> dict:
    """The resolved config, flattened: `strategy.name`, `optim.lr`, ..."""
    return {k: v if isinstance(v, (int, float, str, bool)) or v is None else str(v)
            for k, v in flat(dataclasses.asdict(cfg)).items()}


def numbers(record: dict) -> dict[str, float]:
    """A step or evaluation record as named numbers: train/..., mem/..., val/..."""
    if record.get("split") == "val":
        return {f"val/{k}": v for k, v in record.items() if k not in ("step", "split") and v is not None}
    out = {}
    for key, value in flat(record).items():
        if key == "step" or value is None or isinstance(value, str):
            continue
        out[key.replace(".", "/") if key.startswith("mem.") else f"train/{key}"] = float(value)
    return out


def final_numbers(summary: dict) -> dict[str, float]:
    return {f"final/{k}": float(v) for k, v in summary.items() if isinstance(v, (int, float)) and k != "step"}


def exit_code_of(error: BaseException | None) -> int:
    """The exit code a run leaves with after `error` (trainer/errors.py): 0 done, 128+N stopped by
    signal N, 2 a RunError said in one line, 1 anything else."""
    if error is None:
        return 0
    if isinstance(error, Stopped):
        return error.exit_code
    return ERROR_EXIT_CODE if isinstance(error, RunError) else 1


METRICS_FILE = "metrics.jsonl"


class JsonlLogger:
    def __init__(self, cfg, run_dir: Path, hparams: dict):
        self.file = (run_dir / METRICS_FILE).open("a")

    def log(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def finish(self, summary: dict) -> None:
        self.log({"event": "end", **summary})
        self.file.close()

    def close(self, exit_code: int) -> None:
        self.file.close()


class TensorBoardLogger:
    def __init__(self, cfg, run_dir: Path, hparams: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=cfg.dir or str(run_dir / "tensorboard"))
        self.hparams = hparams
        self.writer.add_text("config", "\n".join(f"    {k}: {v}" for k, v in hparams.items()))

    def log(self, record: dict) -> None:
        for name, value in numbers(record).items():
            self.writer.add_scalar(name, value, record["step"])

    def finish(self, summary: dict) -> None:
        self.writer.add_hparams({k: "None" if v is None else v for k, v in self.hparams.items()},
                                final_numbers(summary), run_name=".")
        self.writer.close()

    def close(self, exit_code: int) -> None:
        self.writer.close()  # writes out the events still buffered


class WandbLogger:
    """Offline (files in the run dir, `wandb sync` uploads them) unless a W&B key is set up."""

    def __init__(self, cfg, run_dir: Path, hparams: dict):
        import wandb

        online = bool(os.environ.get("WANDB_API_KEY")) or (Path.home() / ".netrc").is_file()
        self.mode = cfg.mode or ("online" if online else "offline")
        self.run = wandb.init(project=cfg.project, entity=cfg.entity, name=cfg.name, dir=str(run_dir),
                              mode=self.mode, config=hparams, settings=wandb.Settings(console="off", silent=True))

    def say_where(self) -> None:
        if self.mode == "offline":
            files = Path(self.run.dir).parent  # wandb/offline-run-<time>-<id>
            log.info(f"W&B ran offline: its files are in {files}; upload them with: wandb sync {files}")

    def log(self, record: dict) -> None:
        if "step" in record and "event" not in record:
            self.run.log(numbers(record), step=record["step"])

    def finish(self, summary: dict) -> None:
        self.run.summary.update(final_numbers(summary))
        self.run.finish()
        self.say_where()

    def close(self, exit_code: int) -> None:
        self.run.finish(exit_code=exit_code)  # not 0: W&B marks the run failed
        self.say_where()


class MLflowLogger:
    """Unless a tracking URI is given, a local store in the run dir: the SQLite file mlflow.db (MLflow
    3 keeps its file store, "in maintenance mode", behind an opt-in) and artifacts in mlartifacts/."""

    def __init__(self, cfg, run_dir: Path, hparams: dict):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        # MLflow sets its logger to INFO when imported: its store's "Creating initial MLflow database
        # tables" lines would be the only third-party chatter on the console.
        logging.getLogger("mlflow").setLevel(logging.WARNING)
        local = not cfg.tracking_uri
        self.client = MlflowClient(cfg.tracking_uri or f"sqlite:///{(run_dir / 'mlflow.db').resolve()}")
        experiment = self.client.get_experiment_by_name(cfg.experiment)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(
            cfg.experiment, artifact_location=(run_dir / "mlartifacts").resolve().as_uri() if local else None)
        self.run_id = self.client.create_run(experiment_id, run_name=cfg.run_name or run_dir.name).info.run_id
        params = [Param(k, str(v)[:6000]) for k, v in hparams.items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def _metrics(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def log(self, record: dict) -> None:
        if "step" in record and "event" not in record:
            self._metrics(numbers(record), record["step"])

    def finish(self, summary: dict) -> None:
        self._metrics(final_numbers(summary), summary["step"])
        self.client.set_terminated(self.run_id)

    def close(self, exit_code: int) -> None:
        status = "FINISHED" if exit_code == 0 else "KILLED" if exit_code > 128 else "FAILED"  # 128+N: signal N
        self.client.set_terminated(self.run_id, status=status)


LOGGERS = {"jsonl": JsonlLogger, "tensorboard": TensorBoardLogger, "wandb": WandbLogger, "mlflow": MLflowLogger}


class RunLog:
    """The run's loggers (none on ranks other than 0): one `log` and one `finish` for the loop.
    Called on every rank: a logger that cannot start on rank 0 stops every rank, with its error.
    A context manager: a run that leaves unfinished (a stop signal, an error) closes each logger
    with its status on the way out, before the rank's hard exit (trainer/training/run.py) would lose it."""

    def __init__(self, cfg: Config, run_dir: Path, is_main: bool):
        from trainer.distributed import broadcast_object

        chosen: LoggerConfig = cfg.logger
        self.loggers, error = [], None
        try:
            self.loggers = [LOGGERS[name](getattr(chosen, name), run_dir, hyperparameters(cfg))
                            for name in LOGGERS if is_main and (name == "jsonl" or getattr(chosen, name) is not None)]
        except Exception as e:  # shared, so that no rank waits for rank 0 in the next collective
            error = f"{type(e).__name__}: {e}"
        error = broadcast_object(error)
        if error:
            raise ConfigError(f"logger: {error}")

    def log(self, record: dict) -> None:
        for logger in self.loggers:
            logger.log(record)

    def finish(self, summary: dict) -> None:
        for logger in self.loggers:
            logger.finish(summary)
        self.loggers = []

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        """Each logger not finished is closed with the run's exit code; one that fails to close is
        a warning, so that the others close too and the run's own error is the one raised."""
        exit_code = exit_code_of(error)
        for logger in self.loggers:
            try:
                logger.close(exit_code)
            except Exception as e:
                log.warning(f"logger: closing {type(logger).__name__} failed: {type(e).__name__}: {e}")
        self.loggers = []
