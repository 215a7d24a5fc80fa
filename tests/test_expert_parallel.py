"""Expert parallelism (`strategy.ep=N`, models/experts.py). Each rank of an expert group
holds 1 / N of every MoE layer's experts and tokens travel to them; the losses equal one rank's at the
same global batch within 1e-6 (fp32, the router's loss on, clipping active), at ep=2 on 2 and 4 ranks
and ep=4 on 4, crossed with accumulation and activation checkpointing, compile, packed chat rows,
dpo, LoRA beside the experts, strategy.sp=2 and bf16, on every routed family, on fsdp, zero1, zero2
and zero3; a batch routed to one expert gives the same numbers and no hang, with LoRA on the experts
too (whose adapters split with them: here, and trained in tests/test_expert_lora.py); checkpoints
move between expert degrees, strategies and world sizes; refusals come before any work, in one line."""
from __future__ import annotations

import pytest
import torch

from tests.harness import assert_close, case, losses, on_ranks, records, resuming, saving, train_cases, with_overrides
from tests.test_router_loss import COEF, aux, chat_case, dpo_case, text_data
from trainer.demo import VOCAB, make_model_dir
from trainer.errors import ConfigError

STEPS = 4
CLIP = 0.5  # below the tiny models' gradient norms (0.8-1.0): clipping is active, so the norm must be right
FAMILIES = ("mixtral", "olmoe", "qwen2_moe", "deepseek_v3", "gpt_oss")  # qwen3_moe: every other case
RTOL = 1e-6
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]  # LoRA beside split experts (on them: test_expert_lora.py)
BF16_RTOL = 2e-3  # bf16 ep=2 against one rank in bf16: each expert's matmul over other rows, rounded


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("experts")
    on = dict(output_router_logits=True, router_aux_loss_coef=COEF)
    made = {family: make_model_dir(root / family, family, weights=False, **on) for family in ("qwen3_moe", *FAMILIES)
            if family != "deepseek_v3"}
    made["deepseek_v3"] = make_model_dir(root / "deepseek_v3", "deepseek_v3", weights=False)  # no router loss
    return {**made, "root": root}


def moe_case(path, strategy: str, micro: int, accum: int = 1, steps: int = STEPS, **overrides) -> dict:
    """Synthetic rows of 32 tokens, global batch 4 (micro x accum x data-parallel ranks)."""
    cfg = with_overrides(case(strategy, steps=steps), train__micro_batch_size=micro, train__grad_accum_steps=accum,
                         train__grad_clip=CLIP, data__name="synthetic", data__num_samples=256, optim__lr=1e-2,
                         **overrides)
    return {**cfg, "model": {"name": "hf", "kind": "hf", "path": str(path), "seq_len": 32, "vocab_size": VOCAB,
                             **cfg.get("model", {})}}


@pytest.fixture(scope="module")
def runs(folders, tmp_path_factory):
    out = tmp_path_factory.mktemp("expert_runs")
    qwen, data = folders["qwen3_moe"], text_data(folders["root"])
    ckpt = {name: out / f"ckpt_{name}" for name in ("one", "ep2", "ep4", "zero2_ep4", "zero3_ep2")}
    ones = {"one": saving(moe_case(qwen, "fsdp", 4), ckpt["one"], 2),
            "one_bf16": moe_case(qwen, "fsdp", 4, train__precision="bf16"),
            "one_chat": chat_case(qwen, data, "ddp", 2),
            "one_dpo": dpo_case(qwen, data, "ddp", 4),
            "one_lora": moe_case(qwen, "fsdp", 4, peft__name="lora", peft__target_modules=ATTENTION),
            **{f"one_{f}": moe_case(folders[f], "fsdp", 4, steps=2) for f in FAMILIES}}
    on_ranks(1, train_cases, ones, str(out))
    twos = {"ep2": saving(moe_case(qwen, "fsdp", 2, strategy__ep=2), ckpt["ep2"], 2),
            "ep2_accum_ac": moe_case(qwen, "fsdp", 1, 2, strategy__ep=2, train__activation_checkpointing=True),
            "ep2_compile": moe_case(qwen, "fsdp", 2, strategy__ep=2, train__compile=True),
            "ep2_sp2": moe_case(qwen, "fsdp", 4, strategy__ep=2, strategy__sp=2),  # dp=1: every row, half its tokens
            "ep2_grad_op": moe_case(qwen, "fsdp", 2, strategy__ep=2, strategy__sharding="SHARD_GRAD_OP"),
            "ep2_bf16": moe_case(qwen, "fsdp", 2, strategy__ep=2, train__precision="bf16"),
            "ep2_chat": chat_case(qwen, data, "fsdp", 1, strategy__ep=2),
            "ep2_dpo": dpo_case(qwen, data, "fsdp", 1, 2, strategy__ep=2),
            "ep2_lora": moe_case(qwen, "fsdp", 2, strategy__ep=2, peft__name="lora", peft__target_modules=ATTENTION),
            "ep2_from_one": resuming(moe_case(qwen, "fsdp", 2, strategy__ep=2), ckpt["one"], 2),
            "zero2_ep2": moe_case(qwen, "zero2", 1, 2, strategy__ep=2),  # accumulation: one coalesced reduction
            "zero1_ep2": moe_case(qwen, "zero1", 2, strategy__ep=2),
            "zero3_ep2": saving(moe_case(qwen, "zero3", 1, 2, strategy__ep=2, train__activation_checkpointing=True),
                                ckpt["zero3_ep2"], 2),
            "zero3_ep2_from_ep2": resuming(moe_case(qwen, "zero3", 2, strategy__ep=2), ckpt["ep2"], 2),
            "zero3_ep2_offload": moe_case(qwen, "zero3", 2, strategy__ep=2, strategy__offload_optimizer=True,
                                          strategy__offload_params=True),
            **{f"ep2_{f}": moe_case(folders[f], "fsdp", 2, steps=2, strategy__ep=2) for f in FAMILIES}}
    on_ranks(2, train_cases, twos, str(out))
    fours = {"ep2_4": moe_case(qwen, "fsdp", 1, strategy__ep=2),
             "ep4_4": saving(moe_case(qwen, "fsdp", 1, strategy__ep=4), ckpt["ep4"], 2),
             "ep4_from_ep2": resuming(moe_case(qwen, "fsdp", 1, strategy__ep=4), ckpt["ep2"], 2),
             "zero2_ep2_4": moe_case(qwen, "zero2", 1, strategy__ep=2),
             "zero2_ep4_4": saving(moe_case(qwen, "zero2", 1, strategy__ep=4), ckpt["zero2_ep4"], 2),
             "zero3_ep2_4": moe_case(qwen, "zero3", 1, strategy__ep=2),
             "zero3_ep4_4": moe_case(qwen, "zero3", 1, strategy__ep=4),
             "zero3_from_ep2": resuming(moe_case(qwen, "zero3", 1), ckpt["ep2"], 2),
             "zero2_ep4_from_ep2": resuming(moe_case(qwen, "zero2", 1, strategy__ep=4), ckpt["ep2"], 2)}
    on_ranks(4, train_cases, fours, str(out))
    on_ranks(1, train_cases, {"ddp_from_ep4": resuming(moe_case(qwen, "ddp", 4), ckpt["ep4"], 2),
                              "fsdp_from_zero2_ep4": resuming(moe_case(qwen, "fsdp", 4), ckpt["zero2_ep4"], 2),
                              "fsdp_from_zero3_ep2": resuming(moe_case(qwen, "fsdp", 4), ckpt["zero3_ep2"], 2)},
             str(out))
    return out


def assert_same_run(runs, name: str, baseline: str, rtol: float = RTOL, steps: int = STEPS) -> None:
    base, run = records(runs / baseline), records(runs / name)
    assert len(base) == steps and [r["step"] for r in run] == [r["step"] for r in base], (name, run)
    assert_close(losses(run), losses(base), name, rtol)
    if "aux_loss" in base[0]:
        assert all(a > 1.0 for a in aux(base)), "the router's loss is on: a real term"
        assert_close(aux(run), aux(base), f"{name}: aux_loss", rtol)
    assert_close([r["grad_norm"] for r in run], [r["grad_norm"] for r in base], f"{name}: grad_norm", rtol * 10)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ep2", "ep2_4", "ep4_4", "zero2_ep2", "zero1_ep2", "zero2_ep2_4", "zero2_ep4_4",
                                  "zero3_ep2", "zero3_ep2_4", "zero3_ep4_4", "zero3_ep2_offload",
                                  "ep2_accum_ac", "ep2_compile", "ep2_sp2", "ep2_grad_op"])
def test_expert_parallel_runs_give_one_ranks_losses_and_norms(runs, name):
    assert_same_run(runs, name, "one")
    assert records(runs / "one")[0]["grad_norm"] > CLIP  # clipped: a wrong norm would change the losses


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_every_routed_family_gives_one_ranks_losses_at_ep2(runs, family):
    assert_same_run(runs, f"ep2_{family}", f"one_{family}", steps=2)


@pytest.mark.slow
@pytest.mark.parametrize("name, baseline, rtol", [("ep2_chat", "one_chat", RTOL), ("ep2_dpo", "one_dpo", 3e-6),
                                                  ("ep2_lora", "one_lora", RTOL),
                                                  ("ep2_bf16", "one_bf16", BF16_RTOL)])
def test_packed_chat_dpo_lora_and_bf16_at_ep2_give_one_ranks_losses(runs, name, baseline, rtol):
    base, run = records(runs / baseline), records(runs / name)
    assert len(run) == len(base) == STEPS
    assert_close(losses(run), losses(base), name, rtol)


@pytest.mark.slow
@pytest.mark.parametrize("name, checkpoint", [("ep2_from_one", "1 rank, fsdp"), ("ep4_from_ep2", "ep=2, 2 ranks"),
                                              ("zero3_from_ep2", "ep=2, 2 ranks"), ("ddp_from_ep4", "ep=4, 4 ranks"),
                                              ("zero2_ep4_from_ep2", "fsdp ep=2, 2 ranks"),
                                              ("fsdp_from_zero2_ep4", "zero2 ep=4, 4 ranks"),
                                              ("zero3_ep2_from_ep2", "fsdp ep=2, 2 ranks"),
                                              ("fsdp_from_zero3_ep2", "zero3 ep=2, 2 ranks")])
def test_checkpoints_move_between_expert_degrees_strategies_and_world_sizes(runs, name, checkpoint):
    base, resumed = records(runs / "one"), records(runs / name)
    assert [r["step"] for r in resumed] == [3, 4], (name, checkpoint)
    assert_close(losses(resumed), losses(base)[2:], f"{name} from {checkpoint}", RTOL)


@pytest.mark.slow
def test_export_of_an_expert_parallel_checkpoint_is_the_hub_layout_of_one_ranks_weights(runs, tmp_path):
    """ep=2's step 2 exported: the keys save_pretrained writes, every expert in its place (one rank's
    step 2, exported the same way, within 1e-5), and from_pretrained gives the same logits."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from trainer.export import main

    for run in ("ep2", "one"):
        main([str(runs / f"ckpt_{run}" / "step_00000002"), str(tmp_path / run)])
    split, whole = (load_file(str(tmp_path / run / "model.safetensors")) for run in ("ep2", "one"))
    assert split.keys() == whole.keys() and any(".experts.3." in key for key in split)  # one tensor per expert
    for key, value in whole.items():  # 2 Adam steps from losses equal to 7e-8: measured 1.5e-6 at most; an
        # expert in another's place would differ by the scale of the weights (init std 0.02)
        assert torch.allclose(split[key], value, rtol=0, atol=1e-5), key
    ids = torch.arange(32).remainder(VOCAB)[None]
    logits = [AutoModelForCausalLM.from_pretrained(str(tmp_path / run)).eval()(ids).logits for run in ("ep2", "one")]
    assert torch.allclose(logits[0], logits[1], rtol=1e-5, atol=1e-5)


# -- the dispatch, on its own: every token to one expert -----------------------------------------------

def one_expert_for_all(env) -> dict:
    """At ep=2 on 2 ranks: every token of both ranks chooses expert 0 (held by rank 0) twice over, so
    rank 1's experts receive nothing; outputs and gradients against the whole module on one rank."""
    import torch.distributed as dist
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from trainer.layout import Degrees, Layout
    from trainer.models.experts import shard_experts

    config = AutoConfig.for_model("qwen3_moe", hidden_size=8, moe_intermediate_size=4, num_experts=4)
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    whole = Qwen3MoeExperts(config)
    for p in whole.parameters():
        torch.nn.init.normal_(p)
    layout = Layout(Degrees(env.world_size, ep=2), env.rank)
    with torch.device("meta"):
        split = Qwen3MoeExperts(config)
    shard_experts(torch.nn.ModuleList([split]), layout.experts)
    rows = slice(2 * env.rank, 2 * env.rank + 2)
    for name, _ in list(split.named_parameters()):
        setattr(split, name, torch.nn.Parameter(getattr(whole, name).detach()[rows].clone()))
    hidden = torch.randn(6, 8, generator=torch.Generator().manual_seed(env.rank), requires_grad=True)
    index = torch.zeros(6, 2, dtype=torch.long)
    index[:, 1] = 1  # and expert 1, also rank 0's
    weights = torch.rand(6, 2, generator=torch.Generator().manual_seed(10 + env.rank))
    out = split(hidden, index, weights)
    out.square().sum().backward()
    expected_hidden = hidden.detach().clone().requires_grad_()
    expected = whole(expected_hidden, index, weights)
    expected.square().sum().backward()
    for p in whole.parameters():  # the gradient of both ranks' losses
        dist.all_reduce(p.grad)
    return {"out": (out.detach(), expected.detach()), "input_grad": (hidden.grad, expected_hidden.grad),
            **{name: (p.grad, getattr(whole, name).grad[rows]) for name, p in split.named_parameters()}}


def one_expert_for_all_with_lora(env) -> dict:
    """The same, with LoRA on both stacked matrices (peft's nested ParamWrappers, lora_B not zero):
    rank 1's experts and their adapters receive nothing."""
    import torch.distributed as dist
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from trainer.layout import Degrees, Layout
    from trainer.models.experts import shard_experts

    config = AutoConfig.for_model("qwen3_moe", hidden_size=8, moe_intermediate_size=4, num_experts=4)
    config._experts_implementation = "eager"
    lora = LoraConfig(r=2, target_modules=[], target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    torch.manual_seed(0)
    whole = inject_adapter_in_model(lora, torch.nn.ModuleDict({"experts": Qwen3MoeExperts(config)}))
    for p in whole.parameters():
        torch.nn.init.normal_(p)
    layout = Layout(Degrees(env.world_size, ep=2), env.rank)
    with torch.device("meta"):
        split = inject_adapter_in_model(lora, torch.nn.ModuleDict({"experts": Qwen3MoeExperts(config)}))
    shard_experts(split, layout.experts)
    experts = slice(2 * env.rank, 2 * env.rank + 2)

    def mine(name: str, full: torch.Tensor) -> torch.Tensor:  # this rank's experts' part of a whole tensor
        if ".lora_A." in name:
            return full.view(4, 2, -1)[experts].reshape(-1, full.shape[1])
        if ".lora_B." in name:
            return full.view(full.shape[0], 2, 4)[:, :, experts].reshape(full.shape[0], -1)
        return full[experts]

    wholes = dict(whole.named_parameters())
    for name, p in list(split.named_parameters()):
        owner, _, attr = name.rpartition(".")
        setattr(split.get_submodule(owner), attr, torch.nn.Parameter(mine(name, wholes[name].detach()).clone(),
                                                                     requires_grad=p.requires_grad))
    hidden = torch.randn(6, 8, generator=torch.Generator().manual_seed(env.rank), requires_grad=True)
    index = torch.zeros(6, 2, dtype=torch.long)
    index[:, 1] = 1
    weights = torch.rand(6, 2, generator=torch.Generator().manual_seed(10 + env.rank))
    out = split["experts"](hidden, index, weights)
    out.square().sum().backward()
    expected_hidden = hidden.detach().clone().requires_grad_()
    expected = whole["experts"](expected_hidden, index, weights)
    expected.square().sum().backward()
    for p in whole.parameters():
        if p.requires_grad:  # the adapters; the experts' own matrices are frozen
            dist.all_reduce(p.grad)
    return {"out": (out.detach(), expected.detach()), "input_grad": (hidden.grad, expected_hidden.grad),
            **{name: (p.grad, mine(name, wholes[name].grad)) for name, p in split.named_parameters()
               if p.requires_grad}}


@pytest.mark.parametrize("lora", [False, True])
def test_every_token_to_one_expert_gives_the_whole_modules_numbers_and_no_hang(lora):
    results = on_ranks(2, one_expert_for_all_with_lora if lora else one_expert_for_all)
    for rank, result in results.items():
        for what, (got, expected) in result.items():
            assert got is not None, (rank, what)  # present, also where no token came
            assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6), (rank, what)
    # rank 1's experts got no token: zero gradients, present (the reduction over its ranks waits for them)
    grads = [name for name in results[0] if name not in ("out", "input_grad")]
    assert len(grads) == (4 if lora else 2), grads  # the adapters (lora_A, lora_B of both), or the matrices
    assert all(results[1][name][0].abs().max() == 0 for name in grads)
    assert all(results[0][name][0].abs().max() > 0 for name in grads)


# -- refusals, before any work -------------------------------------------------------------------------

def meta_model(folder):
    from trainer.config import ModelConfig
    from trainer.models import hf

    return hf.builder(ModelConfig(name="hf", kind="hf", path=str(folder)))()


@pytest.mark.parametrize("ep, world, strategy, said", [
    (2, 2, "ddp", "strategy.ep: ddp keeps every weight whole on every rank"),
    (2, 3, "fsdp", "strategy.ep: the world size 3 must be a multiple of strategy.ep=2"),
    (3, 3, "fsdp", "strategy.ep: qwen3_moe has 4 experts a layer, which strategy.ep=3 must divide"),
    (0, 2, "fsdp", "strategy.ep: must be >= 1"),
])
def test_a_setting_expert_parallelism_cannot_take_is_refused_in_one_line(folders, ep, world, strategy, said):
    from trainer.models.experts import check_expert_parallel

    with pytest.raises(ConfigError, match="^" + said.replace(".", r"\.")) as refused:
        check_expert_parallel(ep, world, meta_model(folders["qwen3_moe"]), strategy)
    assert "\n" not in str(refused.value)


def test_a_dense_model_is_refused_naming_its_family(tmp_path):
    from trainer.models.experts import check_expert_parallel

    dense = meta_model(make_model_dir(tmp_path / "qwen2", "qwen2", weights=False))
    with pytest.raises(ConfigError, match=r"^strategy\.ep: qwen2 is not a mixture of experts"):
        check_expert_parallel(2, 2, dense, "fsdp")
    check_expert_parallel(1, 2, dense, "ddp")  # ep=1: nothing to check


def test_lora_on_the_experts_splits_each_adapter_with_its_experts(folders):
    """At ep=2, rank 1 of its expert group: each experts module keeps experts 2 and 3, and its LoRA
    wrappers (outermost: the unit a backend shards) keep their rows of lora_A and their columns of
    lora_B, which the checkpoint records as a block of columns; tests/test_expert_lora.py trains them."""
    from trainer.config import ModelConfig, PeftConfig
    from trainer.models import meta_model as built
    from trainer.models.experts import ExpertGroup, ExpertRows, adapters_of, check_expert_parallel, shard_experts
    from trainer.models.weights import Block

    model = built(ModelConfig(name="hf", kind="hf", path=str(folders["qwen3_moe"])), PeftConfig(name="lora", r=4))
    check_expert_parallel(2, 2, model, "fsdp")
    whole = {n: tuple(p.shape) for n, p in model.named_parameters()}
    group = ExpertGroup(None, 2, 1)
    units = shard_experts(model, group)
    rows = ExpertRows(group)
    rows.add(units)
    assert all(unit is adapters_of(model, unit.base_layer.base_layer)[-1] for unit in units)
    for unit in units:
        assert unit.num_experts == unit.base_layer.num_experts == unit.base_layer.base_layer.num_experts == 2
        for name, p in unit.named_parameters():
            full = whole[next(n for n, q in model.named_parameters() if q is p)]
            assert rows.full_shape(p, tuple(p.shape)) == full, name
            lora_b = "lora_B" in name.split(".")
            assert rows.block(p) == (Block(2, 2, 4) if lora_b else None), name
            assert rows.start(p) == (0 if lora_b else p.numel()), name


def test_fsdp_sharding_across_nodes_with_experts_is_refused_in_one_line():
    from trainer.config import to_config
    from trainer.strategies import preflight

    cfg = to_config({"strategy": {"name": "fsdp", "ep": 2, "sharding": "HYBRID_SHARD"}})
    with pytest.raises(ConfigError, match=r"^strategy\.ep: with strategy\.sharding=HYBRID_SHARD"):
        preflight(cfg, 4)
    preflight(to_config({"strategy": {"name": "fsdp", "ep": 2, "sharding": "SHARD_GRAD_OP"}}), 4)
