"""The loggers (jsonl, TensorBoard, W&B offline, MLflow) read back with each tool's own reader: every
record, the config and the summary; a run stopped by too many bad steps closes every one as failed,
with every event written; metrics.jsonl is written whatever loggers the config lists."""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest

from tests.harness import assert_refused, mlflow_runs, records, run_cli
from trainer.config import to_config


def wandb_records(run_file: Path) -> list:
    """The records of a W&B offline run file (LevelDB-style log of W&B's protobuf records)."""
    from wandb.proto import wandb_internal_pb2

    data, out, pending, pos, block = run_file.read_bytes(), [], b"", 7, 32768
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    run = tmp_path_factory.mktemp("loggers")
    result = run_cli("nproc=2", "strategy=fsdp", "logger=[jsonl,tensorboard,wandb,mlflow]", "train.max_steps=6",
                     "train.log_every=2", "data.val_fraction=0.1", "eval.every_steps=3", f"hydra.run.dir={run}",
                     env={"WANDB_API_KEY": "", "HOME": str(run)})  # no key, no ~/.netrc: offline
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in rows if "epoch" in r}
    vals = {r["step"]: r for r in rows if r.get("split") == "val"}
    return run, steps, vals, rows[-1]


@pytest.mark.slow  # make test stays under 8 minutes: the rest of what it covers is in the quick suite
def test_tensorboard_has_the_records_the_config_and_the_summary(logged):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, steps, vals, end = logged
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert {e.step: e.value for e in events.Scalars("train/loss")} == pytest.approx(
        {s: r["loss"] for s, r in steps.items()}, rel=1e-6)  # float32 in the event file
    assert [e.step for e in events.Scalars("val/loss")] == sorted(vals) == [3, 6]
    assert [e.step for e in events.Scalars("mem/params")] == sorted(steps)
    assert "strategy.name: fsdp" in events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    hparams = EventAccumulator(str(run / "tensorboard"))  # add_hparams writes a file of its own there
    hparams.Reload()
    assert hparams.PluginTagToContent("hparams")


@pytest.mark.slow  # make test stays under 8 minutes: the rest of what it covers is in the quick suite
def test_mlflow_has_the_records_the_params_and_the_summary(logged):
    run, steps, vals, end = logged
    client, [found] = mlflow_runs(run)
    assert found.data.params["strategy.name"] == "fsdp" and found.data.params["train.max_steps"] == "6"
    history = {m.step: m.value for m in client.get_metric_history(found.info.run_id, "train/loss")}
    assert history == pytest.approx({s: r["loss"] for s, r in steps.items()})
    assert [m.step for m in client.get_metric_history(found.info.run_id, "val/ppl")] == [3, 6]
    assert found.data.metrics["final/val_loss"] == pytest.approx(end["val_loss"])
    assert found.info.status == "FINISHED"


@pytest.mark.slow  # make test stays under 8 minutes: the rest of what it covers is in the quick suite
def test_wandb_offline_files_have_the_records_the_config_and_the_summary(logged):
    run, steps, vals, end = logged
    [run_file] = run.glob("wandb/offline-run-*/run-*.wandb")
    assert f"W&B ran offline: its files are in {run_file.parent}; upload them with: wandb sync {run_file.parent}" \
        in (run / "trainer.log").read_text()
    records_ = wandb_records(run_file)
    history = {}
    for r in records_:
        if r.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            history[items["_step"]] = items
    assert {s: h["train/loss"] for s, h in history.items() if "train/loss" in h} == pytest.approx(
        {s: r["loss"] for s, r in steps.items()})
    assert {s for s, h in history.items() if "val/loss" in h} == {3, 6}
    [header] = [r.run for r in records_ if r.WhichOneof("record_type") == "run"]
    config = {i.key: json.loads(i.value_json) for i in header.config.update}
    assert config["strategy.name"] == "fsdp" and config["train.max_steps"] == 6
    summaries = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.summary.update}
                 for r in records_ if r.WhichOneof("record_type") == "summary"]
    assert any(s.get("final/val_loss") == pytest.approx(end["val_loss"]) for s in summaries)
    assert wandb_exit_code(run_file) == 0


def wandb_exit_code(run_file: Path) -> int:
    """The exit code a W&B offline run file ends with (`run.finish(exit_code=...)`)."""
    [exit_record] = [r.exit for r in wandb_records(run_file) if r.WhichOneof("record_type") == "exit"]
    return exit_record.exit_code


@pytest.mark.slow  # make test stays under 8 minutes: the rest of what it covers is in the quick suite
def test_a_run_stopped_by_too_many_bad_steps_closes_every_logger_as_failed(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = run_cli("model=custom", "model._target_=tests.faulty.build", "+model.nan_steps=[4,5]", "+model.rank=0",
                     "strategy.wrap=[ToyBlock]", "train.max_bad_steps=2", "train.max_steps=8", "train.log_every=1",
                     "data.num_workers=0", "logger=[jsonl,tensorboard,wandb,mlflow]", f"hydra.run.dir={tmp_path}",
                     env={"WANDB_API_KEY": "", "HOME": str(tmp_path)})  # no key, no ~/.netrc: offline
    assert_refused(result, "step 5: 2 steps in a row with a non-finite loss")
    logged = [r["step"] for r in records(tmp_path)]
    assert logged == [1, 2, 3, 4]  # step 5 stopped the run before its record
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    for tag in ("train/loss", "train/grad_norm", "mem/params"):  # every event, none left in a buffer
        assert [e.step for e in events.Scalars(tag)] == logged, tag
    _, [found] = mlflow_runs(tmp_path)
    assert found.info.status == "FAILED" and found.info.end_time
    [run_file] = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    assert wandb_exit_code(run_file) == 2  # the run's own exit code


@pytest.mark.slow  # make test stays under 8 minutes: the rest of what it covers is in the quick suite
def test_jsonl_ends_with_the_summary(logged):
    _, steps, vals, end = logged
    assert end == {"event": "end", "step": 6, "loss": steps[6]["loss"], "tokens": steps[6]["tokens"],
                   "val_loss": vals[6]["loss"]}
    assert all(r["ppl"] == pytest.approx(math.exp(r["loss"])) for r in vals.values())


def test_metrics_jsonl_is_written_whatever_the_loggers_listed(tmp_path, monkeypatch):
    """logger=tensorboard replaces the default list: the run's record is written all the same."""
    from hydra import compose, initialize_config_module

    from trainer import distributed
    from trainer.config import CONFIG_MODULE, register_configs
    from trainer.training.loggers import RunLog

    register_configs()
    monkeypatch.setattr(distributed, "broadcast_object", lambda obj, src=0: obj)  # one process, no group
    with initialize_config_module(config_module=CONFIG_MODULE, version_base=None):
        cfg = to_config(compose(config_name="config", overrides=["logger=tensorboard"]))
    assert cfg.logger.jsonl is None and cfg.logger.tensorboard is not None
    with RunLog(cfg, tmp_path, is_main=True) as run_log:
        run_log.log({"step": 1, "loss": 2.5})
        run_log.finish({"step": 1, "loss": 2.5})
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        {"step": 1, "loss": 2.5}, {"event": "end", "step": 1, "loss": 2.5}]
    assert any((tmp_path / "tensorboard").iterdir())
