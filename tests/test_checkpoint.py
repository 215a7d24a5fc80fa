"""Portable checkpoints — resume under any strategy at any world size, atomic saves."""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.harness import (
    LOSS_RTOL,
    assert_refused,
    assert_resumes,
    case,
    full_state,
    on_ranks,
    records,
    resuming,
    run_cli,
    saving,
    train_cases,
)
from trainer.checkpoint.format import PieceReader, read_manifest
from trainer.checkpoint.resume import WRITER_LOCK
from trainer.config import to_config

STRATEGIES = ["ddp", "fsdp", "zero1", "zero2", "zero3"]
# (source strategy, source world size) -> (target strategy, target world size)
CROSS = [("fsdp", 2, "zero3", 2), ("zero3", 2, "fsdp", 1), ("zero2", 2, "ddp", 1), ("ddp", 1, "zero3", 2),
         ("zero1", 2, "fsdp", 2), ("fsdp", 2, "zero1", 2)]


def at_world(cfg: dict, world: int) -> dict:
    """The same global batch (8) at any world size."""
    cfg["train"]["micro_batch_size"] = 8 // world
    return cfg


def straight(strategy: str, world: int, root) -> dict:
    return at_world(saving(case(strategy, steps=12), root / f"{strategy}@{world}", 6), world)


def resumed(source: str, strategy: str, world: int, root) -> dict:
    return at_world(resuming(case(strategy, steps=12), root / source, 6), world)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    out = root / "runs"
    on_ranks(1, train_cases, {"ddp@1": straight("ddp", 1, root)}, str(out))
    two = {f"{s}@2": straight(s, 2, root) for s in STRATEGIES}
    two.update({f"{s}@2->{s}@2": resumed(f"{s}@2", s, 2, root) for s in STRATEGIES})
    two.update({f"{a}@{n}->{b}@{m}": resumed(f"{a}@{n}", b, m, root) for a, n, b, m in CROSS if m == 2})
    on_ranks(2, train_cases, two, str(out))
    one = {f"{a}@{n}->{b}@{m}": resumed(f"{a}@{n}", b, m, root) for a, n, b, m in CROSS if m == 1}
    on_ranks(1, train_cases, one, str(out))
    return root, {d.name: records(d) for d in out.iterdir()}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_resume_continues_exactly_under_the_same_strategy(runs, strategy):
    _, r = runs
    assert_resumes(r[f"{strategy}@2->{strategy}@2"], r[f"{strategy}@2"], at=6, what=strategy)  # bitwise


@pytest.mark.parametrize("source,n,target,m", CROSS)
def test_resume_under_another_strategy_and_world_size(runs, source, n, target, m):
    _, r = runs
    assert_resumes(r[f"{source}@{n}->{target}@{m}"], r[f"{target}@2"], at=6, what=f"{source}@{n}->{target}@{m}",
                   rtol=LOSS_RTOL)


def test_writes_only_complete_step_dirs_and_latest(runs):
    root, _ = runs
    ckpt = root / "zero3@2"
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_00000006", "step_00000012"]
    assert (ckpt / "latest").read_text().strip() == "step_00000012"
    manifest = read_manifest(ckpt / "step_00000006")
    assert (manifest["step"], manifest["strategy"], manifest["world_size"]) == (6, "zero3", 2)
    assert {k: manifest["trainer"]["data"][k] for k in ("epoch", "samples_consumed")} == {"epoch": 0,
                                                                                       "samples_consumed": 48}
    assert sorted(manifest["files"]) == ["rank_00000.safetensors", "rank_00001.safetensors"]
    # Each rank wrote its own half, not a gathered whole model.
    sizes = [(ckpt / "step_00000006" / f).stat().st_size for f in manifest["files"]]
    assert max(sizes) < 0.6 * sum(sizes)


def reload_and_save(env, source: str, strategy: str, dest: str) -> None:
    """Load a checkpoint under `strategy` and save it again at once, untouched."""
    from tests.test_core_behaviour import build
    from trainer.checkpoint.manager import CheckpointManager

    cfg = case(strategy, checkpoint__dir=dest)
    strategy_obj, _, _ = build(env, cfg)
    manager = CheckpointManager(to_config(cfg).checkpoint, strategy_obj, strategy)
    state = manager.load(Path(source))
    manager.save(state["step"], state)
    strategy_obj.teardown()


def reload_and_save_each(env, moves: list[tuple[str, str, str]]) -> None:
    for source, strategy, dest in moves:
        reload_and_save(env, source, strategy, dest)


@pytest.fixture(scope="module")
def moved(runs):
    """Each move of CROSS: the source's step 6 loaded under the target and saved again at once, in
    one launch per target world size."""
    root, _ = runs
    for world in sorted({m for *_, m in CROSS}):
        on_ranks(world, reload_and_save_each, [(str(root / f"{a}@{n}" / "step_00000006"), b, str(root / f"moved-{a}{n}-{b}{m}"))
                                               for a, n, b, m in CROSS if m == world])
    return root


@pytest.mark.parametrize("source,n,target,m", CROSS)
def test_optimizer_state_per_parameter_name_survives_the_move(moved, source, n, target, m):
    src = moved / f"{source}@{n}" / "step_00000006"
    dest = moved / f"moved-{source}{n}-{target}{m}"
    before, after = PieceReader(src, read_manifest(src)), PieceReader(dest / "step_00000006",
                                                                     read_manifest(dest / "step_00000006"))
    for key in ("optim.blocks.1.attn.qkv.weight.exp_avg", "optim.blocks.0.mlp.up.bias.exp_avg_sq",
                "model.tok_emb.weight", "optim.step"):
        assert torch.equal(before.read_full(key), after.read_full(key)), key
    assert before.read_full("optim.blocks.1.attn.qkv.weight.exp_avg").abs().sum() > 0


def fingerprint_of(path):
    """The checkpoints' bytes, file by file (the writer's lock file, which every run takes, aside)."""
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.rglob("*"))
            if f.is_file() and f.name != WRITER_LOCK}


def save_with_a_failing_rank(env, ckpt_dir: str) -> str:
    import trainer.checkpoint.manager as checkpoint
    from tests.test_core_behaviour import build
    from trainer.checkpoint.resume import resolve_resume
    from trainer.errors import CheckpointError

    cfg = case("ddp", checkpoint__dir=ckpt_dir, checkpoint__max_failed_saves=1)  # the first failure stops
    strategy, _, _ = build(env, cfg)
    manager = checkpoint.CheckpointManager(to_config(cfg).checkpoint, strategy, "ddp")
    state = manager.load(resolve_resume(to_config(cfg).checkpoint))
    if env.rank == 1:
        def broken(*args, **kwargs):
            raise OSError("disk full (injected)")
        checkpoint.write_tensors = broken
    try:
        manager.save(state["step"] + 1, state)
    except CheckpointError as e:
        return str(e)
    return "saved"


def test_a_failed_save_leaves_the_previous_checkpoint_and_latest_intact(runs, tmp_path):
    root, _ = runs
    ckpt = tmp_path / "ckpt"
    shutil.copytree(root / "ddp@2", ckpt)
    before = fingerprint_of(ckpt)
    messages = on_ranks(2, save_with_a_failing_rank, str(ckpt))
    assert all("disk full (injected)" in m and "rank 1" in m for m in messages.values()), messages
    assert fingerprint_of(ckpt) == before, "nothing written, nothing removed"


@pytest.fixture(scope="module")
def tiny_checkpoint(runs):
    root, _ = runs
    return root / "ddp@1"


@pytest.mark.parametrize("setup,overrides,fragments", [
    ("missing", ["checkpoint.resume=/nonexistent/step_00000001"], ["/nonexistent/step_00000001", "does not exist"]),
    ("no_manifest", [], ["has no manifest.json"]),
    ("version", [], ["format 99", "format 1"]),
    ("other_model", ["model=small"], ["another model", "29 shapes differ, 48 missing",
                                      "blocks.0.attn.qkv.weight: checkpoint [192, 64], model [1152, 384]"]),
    ("fresh_over_existing", ["checkpoint.resume=none"], ["already holds checkpoints", "resume=auto"]),
])
def test_unusable_checkpoints_fail_clearly_and_touch_nothing(tiny_checkpoint, tmp_path, setup, overrides, fragments):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, ckpt)
    step = ckpt / "step_00000012"
    resume = [f"checkpoint.resume={step}"]
    if setup == "no_manifest":
        (step / "manifest.json").unlink()
    elif setup == "version":
        manifest = json.loads((step / "manifest.json").read_text())
        (step / "manifest.json").write_text(json.dumps({**manifest, "format": 99}))
    elif setup in ("other_model", "fresh_over_existing"):
        resume = [f"checkpoint.dir={ckpt}"]
    before = fingerprint_of(ckpt)
    result = run_cli(*resume, *overrides, "train.max_steps=14", f"hydra.run.dir={tmp_path / 'run'}")
    assert_refused(result, *fragments, details=setup == "other_model")
    assert fingerprint_of(ckpt) == before


def test_auto_resume_picks_the_newest_complete_checkpoint_and_keep_last_prunes(tiny_checkpoint, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, ckpt)
    (ckpt / ".tmp-step_00000018").mkdir()  # a save that died: ignored, then cleaned up
    result = run_cli(f"checkpoint.dir={ckpt}", "checkpoint.every_steps=2", "checkpoint.keep_last=2",
                     "train.max_steps=16", "train.micro_batch_size=8", "optim.warmup_steps=2", "train.log_every=1",
                     f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"resumed from {ckpt / 'step_00000012'} at step 12" in result.stdout
    assert sorted(p.name for p in ckpt.iterdir()) == [".writer.lock", "latest", "step_00000014", "step_00000016"]
    assert [r["step"] for r in records(tmp_path / "run")] == [13, 14, 15, 16]


def test_export_loads_into_the_plain_model_and_reproduces_its_outputs(runs, tmp_path):
    root, _ = runs
    step = root / "zero3@2" / "step_00000012"
    out = tmp_path / "model.safetensors"
    export = subprocess.run([sys.executable, "-m", "trainer.export", str(step), str(out)], capture_output=True,
                            text=True)
    assert export.returncode == 0, export.stderr
    # The trained weights as a strategy holds them (loaded into DDP: the same kernels as the plain model).
    expected = on_ranks(1, logits_under_strategy, str(step))[0]
    script = (
        "import sys, torch; from safetensors.torch import load_file; from trainer.models.builtin import ModelShape, Transformer\n"
        "m = Transformer(ModelShape(256, 64, 64, 2, 4, 256)); m.load_state_dict(load_file(sys.argv[1]))\n"
        "x = torch.arange(64).remainder(256).view(1, 64); torch.save(m(x).detach(), sys.argv[2])\n")
    fresh = subprocess.run([sys.executable, "-c", script, str(out), str(tmp_path / "logits.pt")],
                           capture_output=True, text=True)
    assert fresh.returncode == 0, fresh.stderr
    assert torch.equal(torch.load(tmp_path / "logits.pt"), expected)


def logits_under_strategy(env, step: str):
    from tests.test_core_behaviour import build
    from trainer.checkpoint.manager import CheckpointManager

    strategy, model, _ = build(env, case("ddp"))
    CheckpointManager(to_config(case("ddp")).checkpoint, strategy, "ddp").load(Path(step))
    with torch.no_grad():
        logits = model(torch.arange(64).remainder(256).view(1, 64))
    strategy.teardown()
    return logits.cpu()


def full_weights(env, step: str):
    from tests.test_core_behaviour import build
    from trainer.checkpoint.manager import CheckpointManager

    strategy, _, _ = build(env, case("zero3"))
    CheckpointManager(to_config(case("zero3")).checkpoint, strategy, "zero3").load(Path(step))
    weights = full_state(strategy)
    strategy.teardown()
    return weights


@pytest.mark.slow  # the quick suite checks export against the plain model (above)
def test_the_ranks_pieces_joined_are_the_exported_weights(runs):
    from safetensors.torch import load_file

    from trainer.checkpoint.export import export

    root, _ = runs
    step = root / "fsdp@2" / "step_00000012"
    weights = on_ranks(2, full_weights, str(step))
    assert weights[1] is None
    exported = root / "fsdp.safetensors"
    export(step, exported)
    expected = load_file(str(exported))
    assert weights[0].keys() == expected.keys()
    assert all(torch.equal(weights[0][k], expected[k]) for k in expected)
