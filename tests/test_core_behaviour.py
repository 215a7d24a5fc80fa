"""`micro_step` (no gradient sync before the final one), activation checkpointing, FSDP units, precision and offload options."""
from __future__ import annotations

import json

import pytest
import torch
from torch.distributed.tensor.debug import CommDebugMode

from tests.harness import case, on_ranks, records, train_cases
from trainer.config import to_config
from trainer.distributed import all_reduced
from trainer.strategies.base import optimizer_step

GRADIENT_COLLECTIVES = ("allreduce", "reduce_scatter", "reduce_")


def build(env, overrides: dict):
    from trainer.distributed import seed_everything
    from trainer.strategies import build_strategy
    from trainer.training.setup import setup_model

    cfg = to_config(overrides)
    seed_everything(0)
    strategy = build_strategy(cfg, env)
    model, _, blocks, _ = setup_model(cfg, strategy)
    return strategy, model, blocks


def loss_of(model, x):
    """The trainer's loss of next-token targets x[1:] (the loop's normalisation, one micro-batch)."""
    from trainer.losses.objectives import token_loss_sum
    from trainer.models import logits_of

    return token_loss_sum(logits_of(model(x[:, :-1])), x[:, 1:]) / x[:, 1:].numel()


def gradient_collectives_per_micro_step(env, strategy_name: str) -> list[int]:
    strategy, model, _ = build(env, case(strategy_name))
    counts = []
    for i in range(4):
        x = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(i))
        with CommDebugMode() as comm:
            with strategy.micro_step(final=i == 3):
                strategy.backward(loss_of(model, x) / 4)
        counts.append(sum(n for op, n in comm.get_comm_counts().items()
                          if any(name in str(op) for name in GRADIENT_COLLECTIVES)))
    optimizer_step(strategy, 1.0)
    strategy.teardown()
    return counts


def behaviours(env) -> dict:
    """Every strategy's gradient collectives per micro-step and block forwards per step (without
    and with activation checkpointing), and FSDP's units: one launch serves the tests below."""
    return {"collectives": {s: gradient_collectives_per_micro_step(env, s) for s in MICRO_STEP_STRATEGIES},
            "block_forwards": {s: block_forwards_per_step(env, s) for s in CHECKPOINTING_STRATEGIES},
            "fsdp_units": fsdp_units(env)}


MICRO_STEP_STRATEGIES = ["ddp", "fsdp", "zero1", "zero2", "zero3"]
CHECKPOINTING_STRATEGIES = ["ddp", "fsdp", "zero3"]


@pytest.fixture(scope="module")
def observed():
    return on_ranks(2, behaviours)


@pytest.mark.parametrize("strategy", MICRO_STEP_STRATEGIES)
def test_micro_steps_issue_no_gradient_collective_before_the_final_micro_step(observed, strategy):
    for rank, per_rank in observed.items():
        per_step = per_rank["collectives"][strategy]
        assert per_step[:3] == [0, 0, 0], f"rank {rank}: gradient collectives on non-final micro-steps {per_step}"
        assert per_step[3] > 0, f"rank {rank}: the final micro-step must reduce gradients {per_step}"


def block_forwards_per_step(env, strategy_name: str) -> dict[bool, int]:
    """Block forward calls in one training step, without and with activation checkpointing."""
    calls = {}
    for checkpointing in (False, True):
        strategy, model, blocks = build(env, case(strategy_name, train__activation_checkpointing=checkpointing))
        seen = []
        for block in blocks:
            # A pre-hook: recomputation stops early, once the saved tensors are rebuilt.
            block.register_forward_pre_hook(lambda *_, seen=seen: seen.append(1))
        x = torch.randint(0, 256, (2, 65))
        strategy.backward(loss_of(model, x))
        optimizer_step(strategy, 1.0)
        strategy.teardown()
        calls[checkpointing] = len(seen)
    return calls


@pytest.mark.parametrize("strategy", CHECKPOINTING_STRATEGIES)
def test_activation_checkpointing_recomputes_every_block(observed, strategy):
    calls = observed[0]["block_forwards"][strategy]
    assert calls[False] == 2  # tiny: 2 blocks, one forward each
    assert calls[True] == 2 * calls[False]  # each block's forward runs again in backward


def fsdp_units(env) -> tuple[int, int, bool]:
    from torch.distributed.fsdp import FSDPModule

    strategy, model, blocks = build(env, case("fsdp"))
    units = sum(isinstance(b, FSDPModule) for b in blocks), len(blocks), isinstance(model, FSDPModule)
    strategy.teardown()
    return units


def test_every_block_is_its_own_fsdp_unit(observed):
    assert observed[0]["fsdp_units"] == (2, 2, True)


OPTION_CASES = {
    "fsdp_bf16": case("fsdp", train__precision="bf16"),
    "ddp_bf16": case("ddp", train__precision="bf16"),
    "zero3_bf16": case("zero3", train__precision="bf16"),
    "ddp_fp16": case("ddp", train__precision="fp16"),
    "fsdp_fp16": case("fsdp", train__precision="fp16"),
    "fsdp_offload": case("fsdp", strategy__offload_params=True, strategy__offload_optimizer=True),
    "zero3_offload": case("zero3", strategy__offload_params=True, strategy__offload_optimizer=True),
    "zero1_offload": case("zero1", strategy__offload_optimizer=True),
    "zero2_offload_accum": case("zero2", strategy__offload_optimizer=True, train__grad_accum_steps=2),
}


# fp32 offload moves where the optimizer steps, not what it computes: the same losses and
# gradient norms as the run without offload at the same global batch.
OFFLOAD_REFERENCE = {"fsdp_offload": "fp32", "zero3_offload": "fp32", "zero1_offload": "fp32",
                     "zero2_offload_accum": "fp32_accum"}


@pytest.fixture(scope="module")
def option_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("options")
    reference = {"fp32": case("ddp"), "fp32_accum": case("ddp", train__grad_accum_steps=2)}
    on_ranks(2, train_cases, {**reference, **OPTION_CASES}, str(out))
    return {name: records(out / name) for name in [*reference, *OPTION_CASES]}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OPTION_CASES))
def test_precision_and_offload_options_train(option_runs, name):
    losses = [r["loss"] for r in option_runs[name]]
    reference = [r["loss"] for r in option_runs["fp32"]]
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0] - 0.5, f"{name} does not learn: {losses}"
    # Lower precision moves the curve a little; fp32 offload must not move it (below).
    assert abs(losses[-1] - reference[-1]) < 0.15 * reference[-1], (losses, reference)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OFFLOAD_REFERENCE))
def test_fp32_offload_gives_the_losses_and_gradient_norms_of_the_run_without_it(option_runs, name):
    run, reference = option_runs[name], option_runs[OFFLOAD_REFERENCE[name]]
    assert [r["loss"] for r in run] == pytest.approx([r["loss"] for r in reference], rel=2e-6, abs=0)
    assert [r["grad_norm"] for r in run] == pytest.approx([r["grad_norm"] for r in reference], rel=1e-5, abs=0)


# -- what an option sets up, seen in this process (a group of one): quick, and each check fails
# where the option is ignored (the runs above show that the options train, not that they act) --

def ds_user_config(path) -> str:
    """A user's ds_config: "auto" where ours fills in, and settings of its own."""
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                                "gradient_clipping": "auto",
                                "zero_optimization": {"stage": "auto", "reduce_bucket_size": 100000},
                                "bf16": {"enabled": "auto"}, "steps_per_print": 1000}))
    return str(path)


def setup_cases(ds_config: str) -> dict[str, dict]:
    cases = {f"{s}_compile": case(s, train__compile=True) for s in ("ddp", "fsdp", "zero3")}
    cases.update({f"{s}_{p}": case(s, train__precision=p) for s, p in (
        ("ddp", "bf16"), ("ddp", "fp16"), ("fsdp", "bf16"), ("fsdp", "fp16"), ("zero2", "bf16"), ("zero3", "bf16"))})
    cases.update({"fsdp_offload": case("fsdp", strategy__offload_params=True, strategy__offload_optimizer=True),
                  "zero3_offload": case("zero3", strategy__offload_params=True, strategy__offload_optimizer=True),
                  "zero1_offload": case("zero1", strategy__offload_optimizer=True)})
    cases["zero2_ds_config"] = case("zero2", strategy__deepspeed_config=ds_config, train__micro_batch_size=3,
                                    train__grad_clip=0.5, train__precision="bf16")
    return cases


def set_up(env, cases: dict[str, dict]) -> dict[str, dict]:
    """Per case, what `setup_model` built: compiled blocks, the dtypes of every Linear in a forward
    under the strategy's autocast, the loss scaler, the offload machinery, DeepSpeed's own config."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    out = {}
    for name, cfg in cases.items():
        strategy, model, blocks = build(env, cfg)
        seen = {"compiled": [getattr(b, "_compiled_call_impl", None) is not None for b in blocks],
                "loss_scale": strategy.precision.scale_state() is not None}
        if not to_config(cfg).train.compile:  # compiling takes a minute here: test_compile.py's runs do
            linears, dtypes = [m for m in strategy.module.modules() if isinstance(m, torch.nn.Linear)], set()
            hooks = [m.register_forward_hook(lambda m, args, y, dtypes=dtypes: dtypes.add((args[0].dtype, m.weight.dtype, y.dtype)))
                     for m in linears]
            with torch.no_grad(), strategy.autocast():
                model(torch.randint(0, 256, (2, 64)))
            for hook in hooks:
                hook.remove()
            seen["linear_dtypes"] = dtypes  # (input, weight as used, output) of each Linear
            seen["params"] = {str(getattr(p, "ds_tensor", p).dtype) for p in strategy.module.parameters()}
        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        seen["fsdp_cpu_offload"] = [isinstance(m._get_fsdp_state()._fsdp_param_group.offload_policy, CPUOffloadPolicy)
                                    for m in units]
        engine = model if hasattr(model, "zero_optimization_stage") else None  # DeepSpeed's
        if engine is not None:
            zero = engine.optimizer
            seen["deepspeed"] = {
                "optimizer": type(zero.optimizer).__name__, "bf16": engine.bfloat16_enabled(),
                "fp16": engine.fp16_enabled(), "stage": engine.zero_optimization_stage(),
                "offload_optimizer": getattr(engine.zero_offload_optimizer(), "device", None),
                "offload_param": getattr(engine.zero_offload_param(), "device", None),
                # the ZeRO optimizer's own switches: ZeRO-1/2 `cpu_offload`, ZeRO-3 `offload_*`
                "zero_offloads": [bool(getattr(zero, a, False)) for a in
                                  ("cpu_offload", "offload_optimizer", "offload_param")],
                "micro_batch": engine.train_micro_batch_size_per_gpu(),
                "accumulation": engine.gradient_accumulation_steps(), "batch": engine.train_batch_size(),
                "clipping": engine.gradient_clipping(), "steps_per_print": engine.steps_per_print(),
                "reduce_bucket_size": engine._config.zero_config.reduce_bucket_size,
                "prefetch_bucket_size": engine._config.zero_config.prefetch_bucket_size,
                "communication_data_type": engine.communication_data_type}
        strategy.teardown()
        out[name] = seen
    return out


@pytest.fixture(scope="module")
def setups(tmp_path_factory):
    from trainer.training.run import in_group

    return in_group(set_up, setup_cases(ds_user_config(tmp_path_factory.mktemp("ds") / "ds.json")))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero3"])
def test_compile_compiles_every_block_before_the_strategy_wraps_it(setups, strategy):
    compiled = setups[f"{strategy}_compile"]["compiled"]
    assert compiled == [True, True], compiled  # tiny: 2 blocks, each with torch.compile's call
    assert setups[f"{strategy}_bf16"]["compiled"] == [False, False]


LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.mark.parametrize("name", ["ddp_bf16", "ddp_fp16", "fsdp_bf16", "fsdp_fp16", "zero2_bf16", "zero3_bf16"])
def test_low_precision_computes_in_its_dtype(setups, name):
    strategy, precision = name.split("_")
    low, seen = LOW[precision], setups[name]
    outputs = {y for _, _, y in seen["linear_dtypes"]}
    weights = {w for _, w, _ in seen["linear_dtypes"]}
    assert outputs == {low}, seen["linear_dtypes"]  # every matmul, the LM head's included
    if strategy == "ddp":  # fp32 parameters, cast by autocast inside each op
        assert weights == {torch.float32} and seen["params"] == {"torch.float32"}
    elif strategy == "fsdp":  # fp32 shards (the masters), gathered in the low dtype for compute
        assert weights == {low} and seen["params"] == {"torch.float32"}
    else:  # DeepSpeed holds its parameters in bf16 (fp32 masters in the optimizer)
        assert weights == {low} and seen["params"] == {"torch.bfloat16"}
        assert seen["deepspeed"]["bf16"] and not seen["deepspeed"]["fp16"]
    assert seen["loss_scale"] is (precision == "fp16")  # fp16 has a loss scaler, bf16 none


def test_fsdp_offload_puts_every_unit_under_a_cpu_offload_policy(setups):
    assert setups["fsdp_offload"]["fsdp_cpu_offload"] == [True, True, True]  # 2 blocks and the root
    assert setups["fsdp_bf16"]["fsdp_cpu_offload"] == [False, False, False]


@pytest.mark.parametrize("name", ["zero3_offload", "zero1_offload"])
def test_deepspeed_offload_steps_with_cpu_adam_and_engine_offload_settings(setups, name):
    ds = setups[name]["deepspeed"]
    assert ds["optimizer"] == "DeepSpeedCPUAdam"
    assert ds["offload_optimizer"] == "cpu"
    if name == "zero3_offload":
        assert ds["offload_param"] == "cpu" and ds["zero_offloads"] == [False, True, True]
    else:
        assert ds["offload_param"] is None and ds["zero_offloads"] == [True, False, False]
    plain = setups["zero3_bf16"]["deepspeed"]
    assert plain["optimizer"] == "AdamW" and plain["offload_optimizer"] is None and not any(plain["zero_offloads"])


def test_a_users_deepspeed_config_reaches_the_engine_with_auto_values_filled(setups):
    ds = setups["zero2_ds_config"]["deepspeed"]
    # "auto": ours (micro-batch 3 at world size 1, clip 0.5, stage 2, bf16)
    assert (ds["micro_batch"], ds["accumulation"], ds["batch"], ds["clipping"]) == (3, 1, 3, 0.5)
    assert ds["stage"] == 2 and ds["bf16"]
    # its own settings, where ours differ (a reduce bucket sized by the model; no printing)
    assert ds["reduce_bucket_size"] == 100000 and ds["steps_per_print"] == 1000
    assert setups["zero2_bf16"]["deepspeed"]["reduce_bucket_size"] != 100000
    # what it leaves out: ours (gradients reduced in fp32 under bf16)
    assert ds["communication_data_type"] == torch.float32


def test_deepspeeds_buckets_are_sized_by_the_model_as_the_hf_trainers_auto(setups):
    """The reduce bucket d_model^2, ZeRO-3's prefetch 0.9 x d_model^2 (tiny: d_model 64), not
    DeepSpeed's fixed 5e8 and 5e7 elements (on the peers bench, ZeRO-3's default prefetch gathered the
    30M model whole: 7 % more peak memory a rank)."""
    zero3 = setups["zero3_bf16"]["deepspeed"]
    assert (zero3["reduce_bucket_size"], zero3["prefetch_bucket_size"]) == (64 * 64, int(0.9 * 64 * 64))
    assert setups["zero2_bf16"]["deepspeed"]["reduce_bucket_size"] == 64 * 64


# -- strategy.reduce_dtype=bf16 against fp32 reduce, in bf16 training: the option acts (the losses
# move a little), and every rank still holds the same weights (each applies the same reduced gradients) --

REDUCE_STEPS = 4
# Measured (4 steps, lr 3e-3): bf16 reduce moves the losses by 7e-7 to 8e-6 relative; equal ones
# would mean the option is ignored, far ones that it does more than round the gradients.
REDUCE_RTOL = 1e-4
# One launch per group; the DeepSpeed engines take longer to build (marked slow below).
REDUCE_GROUPS = (("ddp", "fsdp"), ("zero1", "zero2", "zero3"))


def trained_per_reduce_dtype(env, strategies: list[str]) -> dict:
    """Per (strategy, reduce dtype): the loss of each of REDUCE_STEPS bf16 steps (the mean over
    ranks, each on batches of its own), then this rank's logits on one fixed batch, which its
    weights alone decide."""
    from trainer.models import logits_of

    probe = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1000))
    out = {}
    for name in strategies:
        for dtype in ("fp32", "bf16"):
            strategy, model, _ = build(env, case(name, train__precision="bf16", strategy__reduce_dtype=dtype))
            losses = []
            for step in range(REDUCE_STEPS):
                seed = step * env.world_size + env.rank
                x = torch.randint(0, 256, (4, 65), generator=torch.Generator().manual_seed(seed))
                with strategy.micro_step(final=True):
                    with strategy.autocast():
                        loss = loss_of(model, x)
                    strategy.backward(loss)
                optimizer_step(strategy, 1.0)
                losses.append(all_reduced(loss.detach().float()).item() / env.world_size)
            with torch.no_grad(), strategy.autocast():
                logits = logits_of(model(probe)).float()
            strategy.teardown()
            out[(name, dtype)] = {"losses": losses, "logits": logits}
    return out


@pytest.fixture(scope="module")
def reduce_dtype_runs():
    """strategy -> {rank: trained_per_reduce_dtype's result}: its group launched on first use."""
    done = {}

    def runs(strategy: str) -> dict:
        group = next(g for g in REDUCE_GROUPS if strategy in g)
        if group not in done:
            done[group] = on_ranks(2, trained_per_reduce_dtype, list(group))
        return done[group]

    return runs


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", *(pytest.param(s, marks=pytest.mark.slow)
                                                       for s in REDUCE_GROUPS[1])])
def test_bf16_reduce_moves_the_losses_a_little_and_keeps_every_rank_in_step(reduce_dtype_runs, strategy):
    per_rank = reduce_dtype_runs(strategy)
    fp32, bf16 = (per_rank[0][(strategy, dtype)]["losses"] for dtype in ("fp32", "bf16"))
    assert bf16[0] == fp32[0], (bf16, fp32)  # the same start: nothing reduced yet
    if strategy == "zero1":
        # ZeRO-1 keeps its gradients in bf16 before and after the reduction (docs/strategies.md): at 2
        # ranks a two-term sum is rounded to bf16 once either way, so fp32 traffic changes no number.
        assert bf16 == fp32, (bf16, fp32)
    else:
        assert bf16[1:] != fp32[1:], f"{strategy}: reduce_dtype=bf16 gives the fp32-reduce losses exactly: ignored?"
        assert bf16 == pytest.approx(fp32, rel=REDUCE_RTOL), (bf16, fp32)
    for dtype in ("fp32", "bf16"):
        logits = [per_rank[rank][(strategy, dtype)]["logits"] for rank in (0, 1)]
        assert torch.equal(*logits), f"{strategy} reduce_dtype={dtype}: the ranks' weights differ"
