"""The planner at strategy.tp (docs/planning.md, Tensor parallelism), on fsdp and on zero1/2/3 (AutoTP): its
bytes per rank against a tp=2 run's, what it splits and moves as the model's plan says, its table, and
strategy=auto's choice."""
from __future__ import annotations

import pytest
import torch

from tests.harness import CollectiveBytes, auto_resolved, case, on_ranks, records, train_cases
from tests.test_plan import RUNTIME_MODEL
from trainer.config import to_config
from trainer.demo import VOCAB
from trainer.plan import make_plan
from trainer.plan.activations import planned
from trainer.strategies.base import optimizer_step

GB = 1e9
TP_WORLD = 4  # dp=2 x tp=2: split by the tensor group, then sharded by FSDP2 over the data-parallel ranks


# peft=lora on the built-in model's blocks: qkv packed (its lora_B split by rows), proj and down rowwise (their
# lora_A by columns), up colwise (its lora_B by rows); the output layer frozen, split by rows as without LoRA
LORA = {"peft__name": "lora", "peft__r": 4, "peft__target_modules": ["qkv", "proj", "up", "down"]}
TP_CASES = {"tp2": {}, "tp2_lora": LORA}


def tensor_parallel_case(tp: int, name: str = "tp2") -> dict:
    return case("fsdp", steps=2, train__micro_batch_size=2, strategy__tp=tp, **RUNTIME_MODEL, **TP_CASES[name])


@pytest.fixture(scope="module")
def tensor_parallel_bytes(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan_tp")
    on_ranks(TP_WORLD, train_cases, {name: tensor_parallel_case(2, name) for name in TP_CASES}, str(out))
    return {name: records(out / name)[-1]["mem"] for name in TP_CASES}


@pytest.mark.slow
@pytest.mark.parametrize("name", TP_CASES)
def test_runtime_bytes_agree_with_the_plan_at_tp2(tensor_parallel_bytes, name):
    """tp2_lora: the frozen base split as its layers, then sharded over the data-parallel ranks, with no
    gradients or optimizer state; the adapters split as with_adapters splits them; the norms whole (no
    sequence-parallel norms with LoRA)."""
    cfg = to_config(tensor_parallel_case(2, name))
    plan = make_plan(cfg, TP_WORLD, gpu_memory_bytes=int(80 * GB))
    options = {o.tp: o.per_gpu_bytes for o in plan.options
               if o.name == "fsdp" and not o.activation_checkpointing and not o.offload}
    # mem.activations is what autograd keeps (the plan's column adds the output layer's backward beside it)
    kept = {tp: planned(cfg, False, False, tp=tp).bytes(cfg.model.seq_len, cfg.train.micro_batch_size) for tp in (1, 2)}
    expected, got = {**options[2], "activations": kept[2]}, tensor_parallel_bytes[name]
    for key in ("params", "grads", "optim", "activations"):
        print(f"fsdp {name}@{TP_WORLD} {key}: runtime {got[key]} plan {expected[key]} = {got[key] / expected[key]:.4f}")
        assert got[key] == pytest.approx(expected[key], rel=0.10), (key, got[key], expected[key])
    # what tp changes, seen in the run: fewer activation bytes than one rank holding every head
    assert got["activations"] < kept[1]


def zero_tensor_parallel_case(stage: str) -> dict:
    return case(stage, steps=2, train__micro_batch_size=2, strategy__tp=2, **RUNTIME_MODEL)


@pytest.fixture(scope="module")
def zero_tensor_parallel_bytes(tmp_path_factory):
    """zero2 and zero3 at tp=2 on 2 ranks (dp=1: ZeRO's partitions are a rank's whole slices)"""
    out = tmp_path_factory.mktemp("plan_zero_tp")
    stages = ("zero2", "zero3")
    on_ranks(2, train_cases, {stage: zero_tensor_parallel_case(stage) for stage in stages}, str(out))
    return {stage: records(out / stage)[-1]["mem"] for stage in stages}


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_runtime_bytes_agree_with_the_plan_at_zero_tp2(zero_tensor_parallel_bytes, stage):
    """AutoTP's split as the plan counts it: the embedding whole, the rest's split layers 1 / 2 a rank, the
    norms whole (no sequence parallelism), a rank's half of the logits."""
    cfg = to_config(zero_tensor_parallel_case(stage))
    plan = make_plan(cfg, 2, gpu_memory_bytes=int(80 * GB))
    option = next(o for o in plan.options
                  if (o.name, o.tp, o.activation_checkpointing, o.offload) == (stage, 2, False, False))
    kept = planned(cfg, False, False, tp=2).bytes(cfg.model.seq_len, cfg.train.micro_batch_size)
    expected, got = {**option.per_gpu_bytes, "activations": kept}, zero_tensor_parallel_bytes[stage]
    for key in ("params", "grads", "optim", "activations"):
        print(f"{stage} tp=2@2 {key}: runtime {got[key]} plan {expected[key]} = {got[key] / expected[key]:.4f}")
        assert got[key] == pytest.approx(expected[key], rel=0.10), (key, got[key], expected[key])


def traffic_case(strategy: str, sequence_parallel: bool, family: str | None = None, lora: bool = False) -> dict:
    """tiny (or the tiny Llama of `family`'s folder), 64 tokens a row, fp32, with or without
    strategy.tp_sequence_parallel (fsdp's); `lora`: LORA"""
    cfg = case(strategy, strategy__tp=2, train__micro_batch_size=2, strategy__tp_sequence_parallel=sequence_parallel,
               **(LORA if lora else {}))
    if family is None:
        return cfg
    return {**cfg, "model": {"name": "hf", "kind": "hf", "path": family, "seq_len": 64, "vocab_size": VOCAB}}


def tensor_traffic_per_step(env, strategy_name: str, sequence_parallel: bool, family: str | None = None,
                            lora: bool = False) -> dict:
    """The collectives' payload of a tp=2 run's second step (the first sets things up), at 2 ranks (dp=1:
    only the tensor group's)."""
    from tests.test_core_behaviour import build, loss_of

    strategy, model, _ = build(env, traffic_case(strategy_name, sequence_parallel, family, lora))
    x = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        counter = CollectiveBytes()
        with counter:
            with strategy.micro_step(final=True):
                with strategy.autocast():
                    loss = loss_of(model, x)
                strategy.backward(loss)
            optimizer_step(strategy, 1.0)
    strategy.teardown()
    return counter.bytes


@pytest.mark.slow
@pytest.mark.parametrize("strategy,sequence_parallel,family,lora",
                         [("fsdp", False, None, False), ("fsdp", True, None, False), ("zero2", False, None, False),
                          ("fsdp", True, "llama", False), ("fsdp", False, None, True)])
def test_the_planned_tensor_traffic_is_what_the_collectives_carry(strategy, sequence_parallel, family, lora, tmp_path):
    """With sequence parallelism a reduce-scatter and an all-gather of a tensor move, as rings, what one
    all-reduce of it does: the plan counts them as all-reduces. zero2 (AutoTP): its embedding whole, its
    lookups not all-reduced. A Llama's (separate q, k and v, gate and up) sequence-parallel: one reduce-scatter
    of attention's input gradient and one of the MLP's, its embeddings' sum an all-reduce and their split's
    gradient all-gathered. LoRA: the adapters' own (a rowwise layer's lora_A output, a colwise or packed
    layer's lora_B input gradient: 4 elements a token each) beside their layers', less the first block's qkv
    input gradient, which autograd never computes (its input, from the frozen embedding, needs none)."""
    if family is not None:
        from tests.test_tensor_parallel import model_dir

        family = model_dir(tmp_path, family)
    measured = on_ranks(2, tensor_traffic_per_step, strategy, sequence_parallel, family, lora)[0]
    plan = make_plan(to_config(traffic_case(strategy, sequence_parallel, family, lora)), 2, gpu_memory_bytes=int(80 * GB))
    option = next(o for o in plan.options if (o.name, o.tp, o.activation_checkpointing, o.offload) == (
        strategy, 2, False, False))
    # dp=1: neither FSDP2 nor ZeRO moves anything among data-parallel ranks
    assert option.comm_bytes["all_gather"] == option.comm_bytes["reduce_scatter"] == option.comm_bytes["all_reduce"] == 0
    # ZeRO-2 still all-reduces a rank's fp32 gradients (as many bytes as its fp32 parameters) over its data-parallel
    # group, here of one rank: a payload the counter sees that moves nothing
    alone = option.per_gpu_bytes["params"] if strategy == "zero2" else 0
    carried = measured["all_reduce"] - alone + (measured["reduce_scatter"] + measured["all_gather"]) / 2
    print(f"{strategy} {family} tp=2@2 sequence_parallel={sequence_parallel} lora={lora}: measured {measured} planned "
          f"{option.comm_bytes['tensor_all_reduce']}")
    # the counter, a dispatch mode, does not see the collectives DTensor issues inside its own dispatch:
    # loss_parallel's exchange (planned: 12 bytes a token, 1,536 here) and the gradient norm's
    assert carried == pytest.approx(option.comm_bytes["tensor_all_reduce"], rel=0.02, abs=256), measured


def test_the_plan_chooses_tensor_parallelism_only_where_nothing_without_it_fits():
    from trainer.plan.report import format_plan

    # tiny, 64 rows of 64 tokens a micro-batch at 2 ranks: the logits' backward dominates, and tp=2 halves it
    cfg = to_config({"train": {"micro_batch_size": 64}})
    tight = make_plan(cfg, 2, int(0.02 * GB))
    assert not any(o.fits for o in tight.options if o.tp == 1)  # offload with checkpointing: 25 MB
    # at tp=2 on 2 ranks (dp=1) no strategy moves anything among data-parallel ranks, and AutoTP's whole
    # embedding spares the all-reduce of its lookups: zero1, the first in the decision order, is the fastest
    assert (tight.choice.name, tight.choice.tp, tight.choice.activation_checkpointing) == ("zero1", 2, True)
    table = format_plan(tight).splitlines()
    assert table[1].split()[:3] == ["strategy", "ep", "tp"]
    assert next(line for line in table if "<- chosen" in line).split()[:4] == ["zero1", "1", "2", "yes"]
    # where an option without tp fits, it is chosen, though a tp option fits too
    roomy = make_plan(cfg, 2, int(0.06 * GB))
    assert roomy.choice.tp == 1 and any(o.fits for o in roomy.options if o.tp == 2)


def test_strategy_auto_takes_strategy_tp_and_tries_the_fused_loss_and_sequence_parallelism_before_it(caplog):
    overrides = ["strategy=auto", "strategy.tp=2", "train.micro_batch_size=64", "plan.gpu_memory_gb=0.02",
                 "plan.world_size=2"]
    _, resolved, said = auto_resolved(overrides, 2, caplog)
    # the plan above: only tp=2 fits; the fused loss alone does not, sp=2 (every activation halved) does, on ddp
    assert (resolved.strategy.name.value, resolved.strategy.tp, resolved.strategy.sp) == ("ddp", 1, 2)
    assert said == ("strategy=auto chose ddp + activation checkpointing; train.activation_checkpointing=true (was "
                    "false); strategy.tp=1 (was 2); strategy.sp=2 (was 1)"), said


def test_strategy_auto_takes_tensor_parallelism_for_lora_only_where_nothing_without_it_fits(caplog):
    """peft=lora on the tiny model, 64 rows of 63 tokens at 2 ranks (63: no strategy.sp=2): the plan's tp options
    are fsdp's alone (zero1/2/3 refuse LoRA at tp); at 18 MB only fsdp tp=2 with checkpointing fits (16.8 MB;
    without tp 24.4 MB at the least, 21.4 with the fused loss), at 30 MB an option without tp is chosen."""
    cfg = to_config({"peft": {"name": "lora"}, "model": {"seq_len": 63}, "train": {"micro_batch_size": 64}})
    roomy = make_plan(cfg, 2, int(0.03 * GB))
    assert {(o.name, o.activation_checkpointing, o.offload) for o in roomy.options if o.tp > 1} == {
        ("fsdp", False, False), ("fsdp", True, False)}
    assert roomy.choice.tp == 1 and any(o.fits for o in roomy.options if o.tp == 2)
    overrides = ["strategy=auto", "peft=lora", "model.seq_len=63", "train.micro_batch_size=64",
                 "plan.gpu_memory_gb=0.018", "plan.world_size=2"]
    _, resolved, said = auto_resolved(overrides, 2, caplog)
    assert (resolved.strategy.name.value, resolved.strategy.tp, resolved.strategy.sp, resolved.train.fused_loss) == (
        "fsdp", 2, 1, False)
    assert said == ("strategy=auto chose fsdp tp=2 + activation checkpointing; train.activation_checkpointing=true "
                    "(was false); strategy.tp=2 (was 1)"), said


@pytest.mark.slow
def test_a_70b_model_at_32k_tokens_on_8_gpus_does_not_fit_by_tensor_parallelism():
    # Llama-2-70B's shape on the built-in transformer (no grouped key-value heads: 78.6 B parameters),
    # bf16, one row of 32,768 tokens, 8 cards of 80 GB
    llama_70b = {"name": "llama2_70b", "vocab_size": 32000, "seq_len": 32768, "d_model": 8192, "n_layers": 80,
                 "n_heads": 64, "d_ff": 28672, "mlp": "swiglu", "norm": "rmsnorm", "bias": False}
    plan = make_plan(to_config({"model": llama_70b, "train": {"precision": "bf16", "micro_batch_size": 1}}), 8,
                     int(80 * GB))
    assert {o.tp for o in plan.options} == {1, 2, 4, 8}
    # only CPU offload fits: FSDP2 shards every parameter over the 8 ranks already (157 GB of state a rank
    # otherwise), tp only moves 1/8 from the data-parallel axis to the tensor one; what checkpointing keeps,
    # each block's input (32,768 x 8,192 in bf16, 80 blocks: 43 GB), tp divides with the norms
    # sequence-parallel (each rank keeps its 1/tp of the sequence), the logits' share beside it
    assert (plan.choice.name, plan.choice.tp, plan.choice.offload, plan.choice.activation_checkpointing) == (
        "fsdp", 1, True, True)
    fsdp = next(o for o in plan.options if (o.name, o.tp, o.offload, o.activation_checkpointing) == ("fsdp", 1, False,
                                                                                                     True))
    state = sum(fsdp.per_gpu_bytes[k] for k in ("params", "grads", "optim"))
    # nor on zero, whose norms stay whole (more activations), even with offload
    assert not any(o.fits for o in plan.options if o.tp > 1)
    split = [o for o in plan.options if o.tp > 1 and o.name == "fsdp"]
    assert all(not o.fits and sum(o.per_gpu_bytes[k] for k in ("params", "grads", "optim")) >= state > 80 * GB
               for o in split)
    assert all(43 * GB / o.tp < o.per_gpu_bytes["activations"] < 43 * GB for o in split if o.activation_checkpointing)


def test_out_of_memory_fallbacks_of_a_tensor_parallel_run_keep_its_tensor_degree():
    from trainer.plan import strategy_fallbacks
    from trainer.plan.auto import own_option

    # at tp=2 on 2 ranks: the later options at tp=2, each with checkpointing (the run's own strategy with it is no
    # change of strategy); sequence parallelism, which does not cross with tp, is not offered
    def fallbacks(strategy: dict) -> list[tuple]:
        cfg = to_config({"strategy": {**strategy, "tp": 2}, "train": {"micro_batch_size": 64}})
        return [(f["name"], f["offload_optimizer"], f["offload_params"], f["sp"])
                for f, _ in strategy_fallbacks(cfg, 2, missing=1)]

    later = [("zero3", False, False, 1), ("zero1", True, False, 1), ("zero2", True, False, 1), ("zero3", True, True, 1)]
    assert fallbacks({"name": "fsdp"}) == later
    # zero at tp=2 is planned too: FSDP2 after ZeRO-2, as without tp
    assert fallbacks({"name": "zero2"}) == [("fsdp", False, False, 1), *later]
    # LoRA at tp=2: its own option is planned (fsdp's), and none after it at tp=2 is another strategy (zero1/2/3
    # refuse LoRA at tp, fsdp does not offload at tp; fsdp with checkpointing is the run's own strategy)
    lora = to_config({"strategy": {"name": "fsdp", "tp": 2}, "peft": {"name": "lora"}, "train": {"micro_batch_size": 64}})
    own = own_option(make_plan(lora, 2, int(80 * GB)), lora)
    assert (own.name, own.tp, own.activation_checkpointing, own.offload) == ("fsdp", 2, False, False)
    assert strategy_fallbacks(lora, 2, missing=1) == []


def test_the_plan_counts_zero_at_each_tensor_degree_as_autotp_splits():
    """zero1/2/3 at tp=2 and 4 on 4 ranks, with and without checkpointing and offload, in the table; against
    fsdp's count with the norms whole: the embedding whole (a rank holds its other half, and its lookups are
    not all-reduced), the same activations; ZeRO's own traffic over the world / tp data-parallel ranks."""
    from trainer.plan.report import format_plan

    def options(sequence_parallel: bool) -> dict:
        cfg = to_config({"train": {"micro_batch_size": 8}, "strategy": {"tp_sequence_parallel": sequence_parallel}})
        return {(o.name, o.tp, o.activation_checkpointing, o.offload): o for o in make_plan(cfg, 4, int(80 * GB)).options}

    plan = options(False)
    assert {key for key in plan if key[1] > 1 and key[0] != "fsdp"} == {
        (stage, tp, checkpointing, offload) for stage in ("zero1", "zero2", "zero3") for tp in (2, 4)
        for checkpointing in (False, True) for offload in (False, True)}
    table = format_plan(make_plan(to_config({"train": {"micro_batch_size": 8}}), 4, int(80 * GB))).splitlines()
    assert ["zero3", "1", "4", "yes", "yes"] in [line.split()[:5] for line in table]
    tokens, d_model, vocab = 8 * 64, 64, 256  # the tiny model, 8 rows of 64 tokens, fp32
    for checkpointing in (False, True):
        zero2, fsdp = plan["zero2", 2, checkpointing, False], plan["fsdp", 2, checkpointing, False]
        # a rank's parameters (zero2 keeps them whole at dp=2; FSDP2 shards its over the 2 data-parallel ranks)
        assert zero2.per_gpu_bytes["params"] // 4 - 2 * fsdp.per_gpu_bytes["params"] // 4 == vocab * d_model // 2
        assert fsdp.comm_bytes["tensor_all_reduce"] - zero2.comm_bytes["tensor_all_reduce"] == 4 * tokens * d_model
        assert zero2.per_gpu_bytes["activations"] == fsdp.per_gpu_bytes["activations"]
        # with the norms sequence-parallel fsdp keeps fewer
        assert options(True)["fsdp", 2, checkpointing, False].per_gpu_bytes["activations"] < \
            zero2.per_gpu_bytes["activations"]
        # ZeRO-2 all-reduces a rank's gradients (fp32) among 2 data-parallel ranks, none among 1
        assert zero2.comm_bytes["all_reduce"] == zero2.per_gpu_bytes["params"]
        assert plan["zero2", 4, checkpointing, False].comm_bytes["all_reduce"] == 0
    # offload moves ZeRO-3's parameter and optimizer partitions to the host
    zero3, offloaded = plan["zero3", 2, False, False], plan["zero3", 2, False, True]
    assert offloaded.per_gpu_bytes["params"] == offloaded.per_gpu_bytes["optim"] == 0
    assert offloaded.host_bytes == zero3.per_gpu_bytes["params"] + zero3.per_gpu_bytes["optim"]
