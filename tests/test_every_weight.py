"""Every weight right: what a pretrained folder may hold, fresh initialisation with
transformers' own spread, frozen parameters and persistent buffers under every strategy, uneven
shards, signals at the edges of a step, resumes that are exact (dropout, new ranks), and a
tokenised-data cache that outlasts the collective timeout, a killed writer and shared nodes."""
from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time

import pytest
import torch

from tests.harness import (
    LOSS_RTOL,
    assert_resumes,
    case,
    on_ranks,
    records,
    refusal,
    resuming,
    run_cli,
    saving,
    train_and_resume,
    train_cases,
    with_overrides,
)
from trainer.config import to_config
from trainer.strategies.base import optimizer_step

FRESH_INIT_FAMILIES = {
    # 12 layers: GPT-2's residual projections are scaled by 1/sqrt(2 x 12) from their parent module.
    "gpt2": dict(n_layer=12, n_embd=64, n_head=4, vocab_size=256, n_positions=64, bos_token_id=0, eos_token_id=0),
    "llama": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=256),
    "gpt_neox": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                     vocab_size=256),
}


@pytest.mark.parametrize("family", list(FRESH_INIT_FAMILIES))
def test_fresh_init_has_the_spread_of_transformers_from_config(family):
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.models.weights import InitWeights, allocate, fill, params_on_meta

    config = AutoConfig.for_model(family, **FRESH_INIT_FAMILIES[family])
    torch.manual_seed(0)
    theirs = dict(AutoModelForCausalLM.from_config(config).named_parameters())
    with params_on_meta():
        ours = AutoModelForCausalLM._model_mapping[type(config)](config)
    allocate(ours, torch.device("cpu"))
    fill(ours, InitWeights(ours, seed=0))
    for name, p in ours.named_parameters():
        mine, ref = p.detach(), theirs[name].detach()
        if ref.std() == 0:  # a constant (norm weights, biases): the same constant
            assert torch.equal(mine, ref), name
        else:
            assert mine.std() / ref.std() == pytest.approx(1, abs=0.1), (name, mine.std(), ref.std())
            assert abs(mine.mean() - ref.mean()) < 0.3 * ref.std(), name


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from trainer.demo import make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("weights") / "qwen2", "qwen2", weights=True, seed=1)


def variant(model_dir, tmp_path, change_tensors=None, change_config=None):
    """A copy of the pretrained folder with its tensors and/or config.json changed."""
    from safetensors.torch import load_file, save_file

    out = tmp_path / "variant"
    shutil.copytree(model_dir, out)
    if change_tensors:
        tensors = load_file(out / "model.safetensors")
        change_tensors(tensors)
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    if change_config:
        config = json.loads((out / "config.json").read_text())
        change_config(config)
        (out / "config.json").write_text(json.dumps(config))
    return out


def refused(path, tmp_path) -> str:
    return refusal(tmp_path / "run", "model=hf", f"model.path={path}", "data=synthetic")


def test_a_key_the_model_does_not_take_is_named(model_dir, tmp_path):
    def extra(tensors):
        tensors["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(4, 4)

    message = refused(variant(model_dir, tmp_path, extra), tmp_path)
    assert "neither a parameter nor a persistent buffer" in message and "model.layers.0.mlp.extra_proj.weight" \
        in message, message


@pytest.mark.parametrize("how", ["scale_inv", "int8", "quantization_config"])
def test_quantised_weights_are_refused(model_dir, tmp_path, how):
    name = "model.layers.0.mlp.down_proj.weight"

    def fp8_scales(tensors):
        tensors[name.replace("weight", "weight_scale_inv")] = torch.ones(1)

    def int8(tensors):
        tensors[name] = tensors[name].to(torch.int8)

    def config(c):
        c["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3"}

    changes = {"scale_inv": (fp8_scales, None), "int8": (int8, None), "quantization_config": (None, config)}[how]
    message = refused(variant(model_dir, tmp_path, *changes), tmp_path)
    assert "quantis" in message and "float weights only" in message, message


def test_the_unchanged_folder_is_accepted(model_dir, tmp_path):
    with pytest.raises(AssertionError, match="not refused"):
        refused(model_dir, tmp_path)


FROZEN_STRATEGIES = ["ddp", "fsdp", "zero2", "zero3"]
# (source, source world size) -> (target, target world size)
FROZEN_CROSS = [("ddp", 2, "zero3", 2), ("zero3", 2, "fsdp", 1), ("fsdp", 2, "zero2", 2), ("zero2", 2, "ddp", 1)]
TOY = {"vocab": 64, "dim": 16, "layers": 2}


def toy_case(strategy: str, world: int, **overrides) -> dict:
    """The toy model with its embedding frozen and running statistics in buffers, 6 steps,
    global batch 8 at any world size."""
    cfg = with_overrides(case(strategy, steps=6), data__name="synthetic", data__num_samples=256,
                         strategy__wrap=["ToyBlock"], train__micro_batch_size=8 // world, **overrides)
    cfg["model"] = {"name": "toy", "kind": "custom", "_target_": "tests.toys.build", **TOY, "frozen": ["embed"],
                    "stats": True, "vocab_size": 64, "seq_len": 32}
    return cfg


@pytest.fixture(scope="module")
def toy_runs(tmp_path_factory):
    """Each strategy at 2 ranks, saving at steps 3 and 6; resumed from step 3 under another."""
    root = tmp_path_factory.mktemp("toys")
    straight = {f"{s}@2": saving(toy_case(s, 2), root / f"{s}@2", 3) for s in FROZEN_STRATEGIES}
    on_ranks(2, train_cases, straight, str(root / "runs"))
    for world in (1, 2):
        on_ranks(world, train_cases, {
            f"{a}->{b}@{m}": saving(resuming(toy_case(b, m), root / f"{a}@2", 3), root / f"{a}->{b}@{m}", 3)
            for a, _, b, m in FROZEN_CROSS if m == world}, str(root / "runs"))
    return root


def start_values():
    from tests.toys import build
    from trainer.config import TrainConfig
    from trainer.models.weights import InitWeights, allocate, fill, params_on_meta

    with params_on_meta():
        model = build(**TOY, stats=True)
    allocate(model, torch.device("cpu"))
    fill(model, InitWeights(model, seed=TrainConfig().seed))
    return model


@pytest.mark.slow  # make test stays under 8 minutes: the rest of what it covers is in the quick suite
def test_frozen_parameters_save_resume_anywhere_and_never_change(toy_runs):
    from trainer.checkpoint.format import PieceReader, read_manifest

    model = start_values()
    for strategy in FROZEN_STRATEGIES:
        for step in ("step_00000003", "step_00000006"):
            path = toy_runs / f"{strategy}@2" / step
            manifest = read_manifest(path)
            reader = PieceReader(path, manifest)
            assert torch.equal(reader.read_full("model.embed.weight"), model.embed.weight), (strategy, step)
            assert not any(k.startswith("optim.embed.") for k in manifest["tensors"]), strategy  # no moments
            assert "optim.head.weight.exp_avg" in manifest["tensors"]
            assert not torch.equal(reader.read_full("model.head.weight"), model.head.weight)  # that one trains
    for source, _, target, world in FROZEN_CROSS:
        assert_resumes(records(toy_runs / "runs" / f"{source}->{target}@{world}"),
                       records(toy_runs / "runs" / f"{target}@2"), at=3, what=f"{source}->{target}@{world}",
                       rtol=LOSS_RTOL)


def buffers_at(path) -> dict[str, torch.Tensor]:
    from trainer.checkpoint.format import PieceReader, read_manifest

    manifest = read_manifest(path)
    return {name: PieceReader(path, manifest).read_full(f"buffer.{name}") for name in manifest["buffers"]}


@pytest.mark.slow  # make test stays under 8 minutes: the rest of what it covers is in the quick suite
def test_persistent_buffers_are_saved_restored_under_another_strategy_and_exported(toy_runs, tmp_path):
    from safetensors.torch import load_file

    from trainer.checkpoint.export import export

    names = {"stats.mean", "stats.count"}
    for strategy in FROZEN_STRATEGIES:
        saved = buffers_at(toy_runs / f"{strategy}@2" / "step_00000006")
        assert set(saved) == names and saved["stats.count"].item() == 6, strategy
        assert saved["stats.mean"].abs().min() > 0, strategy  # moved from its start (zeros)
    # Same world size, so rank 0 (whose buffers are saved) sees the same batches: the statistics
    # after step 6 of a run resumed at 3 are those of the run that never stopped only if step 3's
    # were restored (else 3 steps of momentum 0.1 from zeros, and a count of 3).
    for source, _, target, world in FROZEN_CROSS:
        if world == 2:
            resumed = buffers_at(toy_runs / f"{source}->{target}@2" / "step_00000006")
            straight = buffers_at(toy_runs / f"{target}@2" / "step_00000006")
            for name in names:
                assert torch.allclose(resumed[name], straight[name], rtol=1e-5, atol=1e-7), (source, target, name)
    export(toy_runs / "zero3@2" / "step_00000006", tmp_path / "toy.safetensors")
    exported = load_file(tmp_path / "toy.safetensors")
    assert exported["stats.count"].dtype == torch.int64 and exported["stats.count"] == 6
    assert torch.equal(exported["stats.mean"], buffers_at(toy_runs / "zero3@2" / "step_00000006")["stats.mean"])


def dropout_case(**overrides) -> dict:
    cfg = toy_case("ddp", 1, **overrides)
    cfg["model"].update(frozen=[], stats=False, dropout=0.2)
    return cfg


@pytest.mark.slow  # make test stays under 8 minutes: the rest of what it covers is in the quick suite
def test_a_model_with_dropout_resumes_bit_exact(tmp_path):
    # A resume makes a new loader iterator, which must not draw from the RNG dropout draws from.
    straight, resumed = train_and_resume(1, dropout_case(), tmp_path, at=3)
    assert_resumes(resumed, straight, at=3)  # bitwise


def test_ranks_beyond_the_saved_world_size_get_rng_states_of_their_own():
    from trainer.checkpoint.manager import rng_state_of_new_rank

    rank0 = torch.get_rng_state()
    states = [rng_state_of_new_rank(rank0, rank) for rank in (2, 3)]
    draws = []
    for state in [rank0, *states]:
        torch.set_rng_state(state)
        draws.append(torch.rand(4))
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[1], draws[2])
    assert torch.equal(rng_state_of_new_rank(rank0, 2), states[0])  # the same on every resume


def test_the_cosine_reaches_its_floor_at_the_last_step():
    from trainer.config import OptimConfig
    from trainer.training.schedule import lr_at

    o = OptimConfig(lr=1e-3, warmup_steps=2, min_lr_ratio=0.1)
    lrs = [lr_at(step, 10, o) for step in range(10)]
    assert lrs[1] == o.lr and lrs[-1] == pytest.approx(o.lr * o.min_lr_ratio, rel=1e-12)
    assert all(a > b for a, b in zip(lrs[2:], lrs[3:]))  # from the end of warmup down


def test_mfu_divides_by_the_peak_of_the_precision_that_runs(monkeypatch):
    from trainer.distributed import PEAK_BF16_FLOPS, peak_flops

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    gpu = torch.device("cuda", 0)
    assert peak_flops(gpu, "bf16") == peak_flops(gpu, "fp16") == PEAK_BF16_FLOPS["H200"]
    assert peak_flops(gpu, "fp32") is None  # TF32 or not is a setting: no mfu rather than a wrong one
    assert peak_flops(torch.device("cpu"), "bf16") is None


@pytest.mark.slow
def test_persistent_buffers_are_read_from_a_pretrained_folder(tmp_path):
    """Gemma4's `layer_scalar` (a persistent buffer that scales each layer's output), saved with
    values other than its start value: the model the trainer builds gives transformers' logits."""
    from tests.toys import save_gemma4_with_scaled_buffers
    from trainer.config import ModelConfig, ModelKind
    from trainer.models import build_model, initial_weights, logits_of
    from trainer.models.weights import allocate, fill, params_on_meta

    theirs = save_gemma4_with_scaled_buffers(tmp_path / "gemma4")
    cfg = ModelConfig(name="hf", kind=ModelKind.hf, path=str(tmp_path / "gemma4"), seq_len=16, vocab_size=128)
    ours = build_model(cfg, params_on_meta())
    weights = initial_weights(cfg, ours, seed=0)
    allocate(ours, torch.device("cpu"))
    fill(ours, weights)
    assert [layer.layer_scalar.item() for layer in ours.model.layers] == [0.5, 0.25]
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        assert torch.equal(logits_of(ours.eval()(ids)), logits_of(theirs.eval()(ids)))


TOY_CLI = ("model=custom", "model._target_=tests.toys.build", "strategy.wrap=[ToyBlock]", "data=synthetic",
           "data.num_samples=256", "model.seq_len=32", "data.num_workers=0", "train.log_every=1")


def event_lines(run_dir) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "event" in r]


def test_ctrl_c_saves_and_exits_130_like_sigterm(tmp_path):
    result = run_cli(*TOY_CLI, "+model.signal=SIGINT", "+model.signal_at_step=3", "train.max_steps=8",
                     f"checkpoint.dir={tmp_path / 'ckpt'}", f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 130, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "KeyboardInterrupt" not in result.stderr, result.stderr[-3000:]
    assert event_lines(tmp_path / "run")[-1] == {"event": "preempted", "step": 3, "signal": "SIGINT",
                                                 "checkpoint": str(tmp_path / "ckpt" / "step_00000003")}


@pytest.mark.slow
def test_a_signal_at_the_last_step_ends_the_run_as_planned(tmp_path):
    result = run_cli(*TOY_CLI, "+model.signal_at_step=4", "train.max_steps=4", f"checkpoint.dir={tmp_path / 'ckpt'}",
                     f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert [e["event"] for e in event_lines(tmp_path / "run")] == ["end"]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step_00000004"


@pytest.mark.slow
def test_a_signal_during_an_evaluation_and_save_stops_right_after_them(tmp_path):
    result = run_cli(*TOY_CLI, "+model.signal_in_eval=true", "data.val_fraction=0.25", "eval.every_steps=2",
                     "eval.max_batches=1", "train.max_steps=8", "checkpoint.every_steps=2",
                     f"checkpoint.dir={tmp_path / 'ckpt'}", f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 143, result.stderr[-3000:]
    assert event_lines(tmp_path / "run")[-1]["step"] == 2  # no extra step ...
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [".writer.lock", "latest", "step_00000002"]  # ... nor save


def uneven_case(strategy: str, world: int, **overrides) -> dict:
    """Dimensions that divide by neither 2 nor 3: a prime vocabulary (251), width 35 (5 heads of
    7), feed-forward 91; global batch 6 at any world size."""
    return with_overrides(case(strategy, steps=6), model__vocab_size=251, model__d_model=35, model__n_heads=5,
                          model__d_ff=91, model__seq_len=32, data__name="synthetic", data__num_samples=256,
                          train__micro_batch_size=6 // world, **overrides)


@pytest.mark.slow
def test_uneven_shards_at_3_ranks_train_as_1_rank_and_resume_at_2(tmp_path):
    ckpt = tmp_path / "zero3@3"
    on_ranks(1, train_cases, {"ddp@1": uneven_case("ddp", 1)}, str(tmp_path))
    on_ranks(3, train_cases, {"fsdp@3": uneven_case("fsdp", 3),
                              "zero3@3": uneven_case("zero3", 3, checkpoint__dir=str(ckpt), checkpoint__every_steps=3,
                                                     checkpoint__keep_last=0)}, str(tmp_path))
    on_ranks(2, train_cases, {"zero3@3->fsdp@2": uneven_case("fsdp", 2, checkpoint__resume=str(ckpt / "step_00000003"))},
             str(tmp_path))
    one = [r["loss"] for r in records(tmp_path / "ddp@1")]
    for run, first in (("fsdp@3", 0), ("zero3@3", 0), ("zero3@3->fsdp@2", 3)):
        assert [r["loss"] for r in records(tmp_path / run)] == pytest.approx(one[first:], rel=2e-6), run


def hf_data_config(hf_assets, cache) -> dict:
    cfg = case("ddp", data__name="hf", data__path=str(hf_assets.jsonl), data__tokenizer=str(hf_assets.tokenizer),
               data__cache_dir=str(cache))
    cfg["model"] = {"name": "hf", "kind": "hf", "path": str(hf_assets.config_only["qwen2"]), "seq_len": 32,
                    "vocab_size": 512}
    return cfg


def source_of(cfg: dict):
    from trainer.config import to_config
    from trainer.data.read import the_source, tokenized

    c = to_config(cfg)
    return tokenized(c, the_source(c), c.data.path, "data.path")


def slow_tokenising_rank_0_under_a_1_s_collective_timeout(env, cfg):
    """Rank 0 tokenises for longer than the collective timeout while rank 1 waits."""
    from datetime import timedelta

    import torch.distributed as dist

    from trainer.config import to_config
    from trainer.data import load_data
    from trainer.data.tokenized import TokenizedText

    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=1))
    tokenise = TokenizedText._tokenise

    def slowly(self):
        time.sleep(3)
        tokenise(self)

    TokenizedText._tokenise = slowly
    train, _ = load_data(to_config(cfg), env.local_rank)
    dist.barrier()
    return len(train)


@pytest.mark.slow
def test_ranks_wait_for_tokenising_outside_the_collective_timeout(hf_assets, tmp_path):
    lengths = on_ranks(2, slow_tokenising_rank_0_under_a_1_s_collective_timeout,
                       hf_data_config(hf_assets, tmp_path / "cache"))
    assert lengths[0] == lengths[1] > 0


def test_the_cache_key_is_the_tokenizer_not_the_folder_around_it(hf_assets, tmp_path):
    folder = tmp_path / "tok"
    shutil.copytree(hf_assets.tokenizer, folder)
    cfg = hf_data_config(hf_assets, tmp_path / "cache")
    cfg["data"]["tokenizer"] = str(folder)
    key = source_of(cfg).dir.name
    (folder / "model.safetensors").write_bytes(b"weights trained further")
    assert source_of(cfg).dir.name == key
    (folder / "tokenizer.json").write_text((folder / "tokenizer.json").read_text() + " ")  # other content
    assert source_of(cfg).dir.name != key


def test_a_partial_cache_is_continued_and_gives_the_same_entry(hf_assets, tmp_path, monkeypatch, caplog):
    from trainer.data import tokenized

    monkeypatch.setattr(tokenized, "BATCH_DOCUMENTS", 100)
    load = tokenized.load_tokenizer
    calls = []

    def dies_in_the_fourth_batch(*args):
        tokenizer = load(*args)

        def call(texts, **kwargs):
            calls.append(len(texts))
            if len(calls) == 4:
                raise KeyboardInterrupt  # the writer is killed
            return type(tokenizer).__call__(tokenizer, texts, **kwargs)
        return type("Dying", (), {"__call__": staticmethod(call), "eos_token_id": tokenizer.eos_token_id,
                                  "pad_token_id": tokenizer.pad_token_id, "__len__": lambda self: len(tokenizer)})()

    source = source_of(hf_data_config(hf_assets, tmp_path / "cache"))
    monkeypatch.setattr(tokenized, "load_tokenizer", dies_in_the_fourth_batch)
    with pytest.raises(KeyboardInterrupt):
        source.prepare()
    assert not source.ready and json.loads((source._tmp / "progress.json").read_text())["documents"] == 300
    monkeypatch.setattr(tokenized, "load_tokenizer", load)
    with caplog.at_level(logging.INFO, logger="trainer"):
        source.prepare()
    assert "continuing after 300" in caplog.text
    fresh = source_of(hf_data_config(hf_assets, tmp_path / "fresh"))
    fresh.prepare()
    for name in ("ids.bin", "doc_starts.npy", "meta.json"):
        assert (source.dir / name).read_bytes() == (fresh.dir / name).read_bytes() or name == "meta.json", name
    assert not list(source.dir.parent.glob(".*")), "no temporary dir, no lock left"


def tokenise_and_say(cfg, tokenised_by):
    from trainer.data.tokenized import TokenizedText

    tokenise = TokenizedText._tokenise

    def noted(self):
        with open(tokenised_by, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(1)  # long enough for the other process to find the lock taken
        tokenise(self)

    TokenizedText._tokenise = noted
    source = source_of(cfg)
    source.prepare()
    return source.ready


@pytest.mark.slow
def test_two_nodes_sharing_a_cache_dir_tokenise_once(hf_assets, tmp_path):
    import multiprocessing

    cfg = hf_data_config(hf_assets, tmp_path / "cache")
    # spawn: a fork of this many-threaded process can deadlock in the child (seen: a futex, forever)
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        ready = pool.starmap(tokenise_and_say, [(cfg, tmp_path / "tokenised_by")] * 2)
    assert ready == [True, True]
    assert len((tmp_path / "tokenised_by").read_text().splitlines()) == 1


STRATEGIES = ["ddp", "fsdp", "zero1", "zero2", "zero3"]


@pytest.mark.slow
def test_under_bf16_every_strategy_starts_from_the_same_fp32_masters(tmp_path):
    # lr 0, one step: what each saves is where it started. DeepSpeed clones its masters from the
    # bf16 parameters unless they are set again from the fp32 values.
    from trainer.checkpoint.format import PieceReader, read_manifest
    from trainer.models.builtin import Transformer, shape_of
    from trainer.models.weights import InitWeights, allocate, fill, params_on_meta

    configs = {s: with_overrides(case(s, steps=1), train__precision="bf16", optim__lr=0.0,
                                 checkpoint__dir=str(tmp_path / s)) for s in STRATEGIES}
    on_ranks(2, train_cases, configs, str(tmp_path / "runs"))
    cfg = to_config(configs["ddp"])
    with params_on_meta():
        model = Transformer(shape_of(cfg.model))
    allocate(model, torch.device("cpu"))
    fill(model, InitWeights(model, cfg.train.seed))
    start = dict(model.named_parameters())
    for s in STRATEGIES:
        path = tmp_path / s / "step_00000001"
        reader = PieceReader(path, read_manifest(path))
        for name, value in start.items():
            assert torch.equal(reader.read_full(f"model.{name}"), value.detach()), (s, name)


def skip_case(strategy: str, **overrides) -> dict:
    """The toy model with a fault on rank 1 at step 3, 5 steps, synthetic data."""
    cfg = with_overrides(case(strategy, steps=5), data__name="synthetic", data__num_samples=256,
                         strategy__wrap=["ToyBlock"], **overrides)
    cfg["model"] = {"name": "faulty", "kind": "custom", "_target_": "tests.faulty.build", "vocab": 64, "dim": 16,
                    "layers": 2, "rank": 1, "vocab_size": 64, "seq_len": 32}
    return cfg


@pytest.fixture(scope="module")
def skipped_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("skips")
    no_check = root / "ds_no_overflow_check.json"
    no_check.write_text(json.dumps({"bf16": {"check_grad_overflow": False}}))
    configs = {f"inf:{s}": skip_case(s) for s in ("ddp", "fsdp", "zero2", "zero3")}
    for name in configs:  # an infinite loss with finite gradients
        configs[name]["model"]["inf_steps"] = [3]
    configs.update({f"nan-bf16:{s}": skip_case(s, train__precision="bf16", **(
        {"strategy__deepspeed_config": str(no_check)} if s.startswith("zero") else {}))
        for s in ("ddp", "fsdp", "zero2", "zero3")})
    for name in configs:
        if name.startswith("nan"):  # NaN gradients, and a ds_config whose own check is off
            configs[name]["model"]["nan_steps"] = [3]
    on_ranks(2, train_cases, configs, str(root))
    return {name: records(root / name) for name in configs}


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["inf", "nan-bf16"])
def test_a_skipped_step_is_skipped_on_every_backend(skipped_runs, fault):
    runs = {name.split(":")[1]: rows for name, rows in skipped_runs.items() if name.startswith(fault)}
    for strategy, rows in runs.items():
        assert [r["skipped"] for r in rows] == [0, 0, 1, 1, 1], strategy
        assert all(math.isfinite(r["loss"]) for r in rows[3:]), strategy
    # Skipped alike: the steps after it agree across backends (bf16: as closely as bf16 runs agree).
    rel = 2e-6 if fault == "inf" else 2e-2
    for strategy, rows in runs.items():
        assert [r["loss"] for r in rows[3:]] == pytest.approx([r["loss"] for r in runs["ddp"][3:]], rel=rel), strategy


def reduced_bytes(env) -> dict:
    """Bytes the gradient collectives carry in one bf16 step, per strategy and strategy.reduce_dtype."""
    from tests.harness import CollectiveBytes
    from tests.test_core_behaviour import build, loss_of

    out = {}
    for strategy_name in ("ddp", "fsdp", "zero2", "zero3"):
        for dtype in ("fp32", "bf16"):
            strategy, model, _ = build(env, case(strategy_name, train__precision="bf16",
                                                 strategy__reduce_dtype=dtype))
            x = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(0))
            counter = CollectiveBytes()
            with counter:
                with strategy.autocast():
                    loss = loss_of(model, x)
                strategy.backward(loss)
                optimizer_step(strategy, 1.0)
            strategy.teardown()
            out[(strategy_name, dtype)] = counter.bytes
    return out


@pytest.mark.slow
def test_gradients_are_reduced_in_the_reduce_dtype_on_every_backend():
    from trainer.config import GradReduce, Precision, ReduceDtype, StrategyName
    from trainer.models import model_facts
    from trainer.plan import step_traffic
    from trainer.strategies.ds_config import ZERO3_PERSISTENCE_THRESHOLD

    measured = on_ranks(2, reduced_bytes)[0]
    facts = model_facts(to_config(case("ddp")).model, None)
    for (strategy, dtype), carried in measured.items():
        planned = step_traffic(StrategyName(strategy), facts.params, facts.elements_below(ZERO3_PERSISTENCE_THRESHOLD), 2, Precision.bf16, 1,
                               GradReduce.step, offload=False, reduce_dtype=ReduceDtype(dtype))
        kind = "all_reduce" if strategy in ("ddp", "zero2") else "reduce_scatter"
        assert carried[kind] == pytest.approx(planned[kind], rel=0.02, abs=64), (strategy, dtype, carried, planned)
    for strategy in ("ddp", "fsdp", "zero2", "zero3"):
        fp32, bf16 = measured[(strategy, "fp32")], measured[(strategy, "bf16")]
        kind = "all_reduce" if strategy in ("ddp", "zero2") else "reduce_scatter"
        assert fp32[kind] == pytest.approx(2 * bf16[kind], rel=0.02), (strategy, fp32, bf16)


@pytest.mark.parametrize("precision,reduce_dtype", [("fp32", "bf16"), ("bf16", "fp16"), ("fp16", "bf16")])
def test_gradients_reduce_in_fp32_or_the_training_dtype(precision, reduce_dtype):
    from trainer.checks import validate
    from trainer.errors import ConfigError

    with pytest.raises(ConfigError, match=f"strategy.reduce_dtype: fp32, or the training dtype "
                                          f"\\(train.precision={precision}\\); got {reduce_dtype}"):
        validate(to_config({"train": {"precision": precision}, "strategy": {"reduce_dtype": reduce_dtype}}))
    validate(to_config({"train": {"precision": precision}, "strategy": {"reduce_dtype": precision}}))
