"""Mixture-of-experts models: LoRA on the experts, active-parameter FLOPs, export back to
the Hub's per-expert layout. Models from trainer/demo.py's MOE_FAMILIES (4 experts, 2 per token)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.harness import (
    assert_close,
    assert_resumes,
    case,
    on_ranks,
    records,
    resuming,
    saving,
    train_cases,
    with_overrides,
)
from tests.test_lora import trainer_logits
from trainer.checkpoint.format import read_manifest, read_step_dir
from trainer.config import to_config
from trainer.demo import MOE_FAMILIES, make_model_dir

SEQ, VOCAB = 32, 512
LORA = {"name": "lora", "r": 2, "alpha": 4.0}


def moe_case(path: Path, strategy: str, world: int, steps: int = 4, peft: dict | None = None, **overrides) -> dict:
    """Global batch 8 at any world size, fp32, every step logged; eager attention (gpt-oss's sinks)."""
    overrides = {"data__name": "synthetic", "data__num_samples": 256, "optim__lr": 1e-2,
                 "train__micro_batch_size": 8 // world, **overrides}
    cfg = with_overrides(case(strategy, steps=steps), **overrides)
    cfg["model"] = {"name": "hf", "kind": "hf", "path": str(path), "seq_len": SEQ, "vocab_size": VOCAB,
                    "attn_implementation": "eager"}
    if peft:
        cfg["peft"] = dict(peft)
    return cfg


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in records(run_dir)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """Each family's config-only folder; gpt-oss with weights too (its checkpoints store experts fused)."""
    root = tmp_path_factory.mktemp("moe")
    found = {family: make_model_dir(root / family, family, weights=False) for family in MOE_FAMILIES}
    found["gpt_oss+weights"] = make_model_dir(root / "gpt_oss_weights", "gpt_oss", weights=True, seed=3)
    return found


def meta(folder: Path, peft: dict | None = None):
    from trainer.models import meta_model

    cfg = to_config(moe_case(folder, "ddp", 1, peft=peft))
    return cfg, meta_model(cfg.model, cfg.peft)


# --- which layers adapt ------------------------------------------------------------------------

@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_all_linear_adapts_attention_and_experts_never_the_router_or_the_output_layer(folders, family):
    from peft.tuners.lora import LoraLayer

    _, model = meta(folders[family], LORA)
    adapted = {name for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    wrapped = {getattr(m, "parameter_name", None) for m in model.modules() if isinstance(m, LoraLayer)}
    assert {"gate_up_proj", "down_proj"} <= wrapped, wrapped  # both stacked expert matrices, every layer
    layers = model.config.num_hidden_layers
    experts = [n for n in adapted if n.endswith("mlp.experts")]
    assert len(experts) == layers - model.config.to_dict().get("first_k_dense_replace", 0), experts
    assert any(n.endswith("self_attn.o_proj") for n in adapted)
    routing = ("mlp.gate", "mlp.router", "shared_expert_gate", "lm_head")
    assert not [n for n in adapted if n.endswith(routing)], sorted(adapted)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)


def test_dropout_on_experts_is_refused_in_one_line(folders):
    from trainer.errors import ConfigError

    with pytest.raises(ConfigError, match="peft.dropout=0.1: .*experts.gate_up_proj"):
        meta(folders["mixtral"], {**LORA, "dropout": 0.1})


def test_dpo_from_an_adapter_on_experts_is_refused_without_a_precomputed_reference(tmp_path):
    """objective=dpo's reference from peft.init adds the starting adapters to linear layers' outputs,
    which an expert adapter is not: refused before any work, unless the reference is precomputed."""
    import json

    from safetensors.torch import save_file

    from trainer.checks import check_objective
    from trainer.errors import ConfigError

    def dpo(folder: Path, precompute_ref: bool):
        return to_config({"objective": {"name": "dpo", "precompute_ref": precompute_ref},
                          "data": {"name": "preference", "path": str(tmp_path / "pairs.jsonl")},
                          "peft": {**LORA, "init": str(folder)}})

    for name, experts in (("experts", ["experts.down_proj"]), ("linear", None)):
        (tmp_path / name).mkdir()
        settings = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"],
                    **({"target_parameters": experts} if experts else {})}
        (tmp_path / name / "adapter_config.json").write_text(json.dumps(settings))
        save_file({}, str(tmp_path / name / "adapter_model.safetensors"))
    with pytest.raises(ConfigError, match=r"objective.precompute_ref: false: .*experts.down_proj.*precompute_ref=true"):
        check_objective(dpo(tmp_path / "experts", False))
    check_objective(dpo(tmp_path / "experts", True))
    check_objective(dpo(tmp_path / "linear", False))


# --- active parameters -------------------------------------------------------------------------

def routed_by_hand(family: str) -> tuple[int, int]:
    """Per MoE layer: the routed experts' parameters and the experts a token uses, from the config."""
    spec = MOE_FAMILIES[family]
    hidden, top_k = spec["hidden_size"], spec["num_experts_per_tok"]
    experts = spec.get("num_experts") or spec.get("num_local_experts") or spec["n_routed_experts"]
    width = spec.get("moe_intermediate_size") or spec["intermediate_size"]
    per_expert = 3 * hidden * width  # gate, up, down
    if family == "gpt_oss":  # biases on the fused gate/up (2 x width) and on down (hidden)
        per_expert += 2 * width + hidden
    return experts * per_expert, top_k * per_expert


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_flops_count_the_parameters_a_token_activates_and_params_count_all(folders, family):
    from trainer.models import model_facts

    cfg, model = meta(folders[family])
    facts = model_facts(cfg.model, None, cfg.peft)
    total = sum(p.numel() for p in model.parameters())
    routed, used = routed_by_hand(family)
    moe_layers = MOE_FAMILIES[family]["num_hidden_layers"] - MOE_FAMILIES[family].get("first_k_dense_replace", 0)
    assert facts.params == total
    assert facts.active == total - moe_layers * (routed - used)
    lookups = VOCAB * MOE_FAMILIES[family]["hidden_size"]  # the input embedding (untied): no multiplication
    attention = 12 * facts.n_layers * facts.d_model * SEQ
    assert facts.flops_per_token == 6 * (facts.active - lookups) + attention


# --- the planner ---------------------------------------------------------------------------------

@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_the_planner_counts_activations_and_times_the_active_parameters(folders, family):
    """make_plan on the meta device: the experts' grouped matmul traced in fp32 (torch's meta function
    asks for bf16), the step time from the active parameters; with LoRA on the experts too (peft folds
    the delta into the stacked weight under an autocast of the weight's device: meta)."""
    from trainer.plan import make_plan

    cfg, model = meta(folders[family])
    plan = make_plan(cfg, 1, 10 ** 12)
    assert plan.activations.per_token_per_layer > 0 and plan.activations.logits_per_token > 0
    ddp = next(o for o in plan.options if o.name == "ddp" and not o.activation_checkpointing and not o.offload)
    routed, used = routed_by_hand(family)
    spec = MOE_FAMILIES[family]
    active = sum(p.numel() for p in model.parameters()) - (spec["num_hidden_layers"] - spec.get("first_k_dense_replace", 0)) \
        * (routed - used)
    per_token = 6 * (active - VOCAB * spec["hidden_size"]) + 12 * spec["num_hidden_layers"] * spec["hidden_size"] * SEQ
    tokens = cfg.train.micro_batch_size * SEQ  # 1 rank: no communication, the step is its compute
    assert ddp.step_s == pytest.approx(per_token * tokens / cfg.plan.flops_per_s, rel=1e-12)
    lora, _ = meta(folders[family], LORA)
    adapted = make_plan(lora, 1, 10 ** 12)
    assert adapted.trainable < plan.trainable and adapted.activations.per_token > 0


def test_the_start_line_says_all_parameters_and_the_active_ones(folders):
    from trainer.layout import Degrees, Layout
    from trainer.models import model_facts
    from trainer.models.active_params import short_count
    from trainer.training.report import describe

    class Env:
        world_size, device = 1, torch.device("cpu")

    class Strategy:
        layout = Layout(Degrees(1), rank=0)  # one rank: no group is made

        def start_settings(self):
            return {"offload": "none"}

    cfg, model = meta(folders["mixtral"])
    line = describe(cfg, Env(), Strategy(), 4, model_facts(cfg.model, cfg.strategy.wrap, cfg.peft))
    routed, used = routed_by_hand("mixtral")
    total = sum(p.numel() for p in model.parameters())
    assert f"({short_count(total)} parameters, {short_count(total - 2 * (routed - used))} active)" in line, line
    assert short_count(30_532_122_624) == "30.5B" and short_count(3_300_000_000) == "3.3B"


# --- export to the Hub's layout ----------------------------------------------------------------

EXPORTED = ("mixtral", "qwen2_moe", "gpt_oss")


@pytest.fixture(scope="module")
def trained(folders, tmp_path_factory) -> Path:
    """2 full-parameter steps of each exported family at 1 rank, saved."""
    root = tmp_path_factory.mktemp("moe_trained")
    cases = {family: saving(moe_case(folders[family], "ddp", 1, steps=2), root / f"ckpt_{family}", 2)
             for family in EXPORTED}
    on_ranks(1, train_cases, cases, str(root))
    return root


def hub_keys(folder: Path) -> set[str]:
    from safetensors import safe_open

    keys = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            keys |= set(f.keys())
    return keys


@pytest.mark.parametrize("family", EXPORTED)
def test_export_and_convert_write_the_hubs_per_expert_layout_with_our_logits(trained, family, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.convert import main as convert
    from trainer.export import main as export

    step = trained / f"ckpt_{family}" / "step_00000002"
    export([str(step), str(tmp_path / "export")])
    convert([str(step), str(tmp_path / "convert"), "--to", "hf"])
    config = AutoConfig.from_pretrained(str(tmp_path / "export"))
    config._attn_implementation = "eager"
    ours = AutoModelForCausalLM.from_config(config)  # the trainer's model: fused experts, its own names
    ours.load_state_dict(read_step_dir(step, moments=False).weights, strict=True)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ours.eval()(ids).logits
    for out in ("export", "convert"):
        folder = tmp_path / out
        loaded = AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="eager").eval()
        with torch.no_grad():
            assert torch.allclose(loaded(ids).logits, expected, atol=1e-5), (family, out)
        loaded.save_pretrained(str(tmp_path / f"{out}_resaved"))
        keys = hub_keys(folder)
        assert keys == hub_keys(tmp_path / f"{out}_resaved"), sorted(keys ^ hub_keys(tmp_path / f"{out}_resaved"))
        if family == "mixtral":  # the original names: one tensor per expert
            assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in keys, sorted(keys)
        if family != "gpt_oss":
            assert not [k for k in keys if "gate_up_proj" in k], sorted(keys)
        else:  # stored fused on the Hub
            assert "model.layers.0.mlp.experts.gate_up_proj" in keys, sorted(keys)


# --- LoRA on experts under every strategy, and its PEFT folder ---------------------------------

LORA_FAMILY = "gpt_oss+weights"  # pretrained, its experts [E, in, out] with biases, stored fused on the Hub
STRATEGIES = ("ddp", "fsdp", "zero3")
IDS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))


def trained_then_logits(env, cases: dict, out: str, step: str, cfg: dict, adapter: str,
                        ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`cases` trained in turn, then the logits of `ids` from checkpoint `step` (loaded as the trainer
    loads it), and from the model `cfg` starts with peft.init=`adapter`, in one launch."""
    from tests.test_core_behaviour import build

    train_cases(env, cases, out)
    strategy, model, _ = build(env, with_overrides(cfg, peft__init=adapter))
    with torch.no_grad():
        started = model(ids).logits
    strategy.teardown()
    return trainer_logits(env, step, cfg, ids), started


@pytest.fixture(scope="module")
def lora_runs(folders, tmp_path_factory) -> tuple[Path, torch.Tensor]:
    """Two launches (about 2 minutes here): 3 LoRA steps at 2 ranks under ddp, fsdp and zero3, each saving
    steps 2 and 3, and zero3 resumed from its step 2; zero3's step 3 exported as a PEFT folder; then at 1
    rank (ddp) the same 3 steps, zero3's step 2 resumed, and the trainer's logits of zero3's step 3 and of
    a model started from the PEFT folder (peft.init). Global batch 8 throughout."""
    from trainer.export import main as export

    root = tmp_path_factory.mktemp("moe_lora")
    folder = folders[LORA_FAMILY]
    two = {f"{s}@2": saving(moe_case(folder, s, 2, steps=3, peft=LORA), root / f"ckpt_{s}", 2) for s in STRATEGIES}
    two["zero3@2-resumed"] = resuming(moe_case(folder, "zero3", 2, steps=3, peft=LORA), root / "ckpt_zero3", 2)
    on_ranks(2, train_cases, two, str(root))
    one = {"ddp@1": moe_case(folder, "ddp", 1, steps=3, peft=LORA),
           "ddp@1-from-zero3@2": resuming(moe_case(folder, "ddp", 1, steps=3, peft=LORA), root / "ckpt_zero3", 2)}
    step = root / "ckpt_zero3" / "step_00000003"
    export([str(step), str(root / "adapter")])
    logits = on_ranks(1, trained_then_logits, one, str(root), str(step), moe_case(folder, "ddp", 1, peft=LORA),
                      str(root / "adapter"), IDS)[0]
    return root, logits


EXPERT_ADAPTERS = [f"model.layers.{layer}.mlp.experts.{inner}lora_{part}.default.weight"
                   for layer in (0, 1) for inner in ("", "base_layer.") for part in "AB"]  # down_proj, gate_up_proj


@pytest.mark.slow  # the lora_runs fixture's two launches: about 2 minutes on 2 shared CPU cores
def test_lora_on_experts_trains_alike_on_every_strategy_and_saves_the_expert_adapters(lora_runs):
    root, _ = lora_runs
    base = losses(root / "ddp@1")  # 3 steps of random synthetic batches: not always falling
    for strategy in STRATEGIES:
        assert_close(losses(root / f"{strategy}@2"), base, strategy, rtol=1e-6)
        step = root / f"ckpt_{strategy}" / "step_00000003"
        saved = read_step_dir(step, moments=False).weights
        assert sorted(n for n in saved if ".mlp.experts." in n) == sorted(EXPERT_ADAPTERS), (strategy, sorted(saved))
        for name in EXPERT_ADAPTERS:  # every expert adapter trained (B starts at zero, A at peft's init)
            assert saved[name].abs().sum() > 0, (strategy, name)
        assert read_manifest(step)["source"]["lora"]["target_parameters"] == ["experts.down_proj", "experts.gate_up_proj"]


@pytest.mark.slow  # uses lora_runs
def test_lora_on_experts_resumes_on_the_same_and_another_strategy(lora_runs):
    root, _ = lora_runs
    straight = records(root / "zero3@2")
    assert_resumes(records(root / "zero3@2-resumed"), straight, 2, "zero3@2")  # bitwise
    assert_resumes(records(root / "ddp@1-from-zero3@2"), straight, 2, "ddp@1", rtol=1e-6)


@pytest.mark.slow  # uses lora_runs
def test_lora_on_experts_exports_a_peft_folder_that_peft_loads_with_our_logits(lora_runs, folders, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from trainer.export import main as export

    root, (expected, started) = lora_runs
    step = root / "ckpt_zero3" / "step_00000003"
    export([str(step), str(tmp_path / "merged"), "--merge"])
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(str(folders[LORA_FAMILY]), attn_implementation="eager").eval()
        before = plain(IDS).logits
        adapted = PeftModel.from_pretrained(plain, str(root / "adapter")).eval()
        own = {n: w for n, w in read_step_dir(step, moments=False).weights.items() if ".lora_" in n}
        peft_state = {n.replace(".default.", "."): p for n, p in adapted.base_model.model.named_parameters()
                      if ".lora_" in n}
        assert len(own) == len(peft_state) > len(EXPERT_ADAPTERS)
        for name, value in own.items():  # every adapter, under peft's own name
            assert torch.equal(peft_state[name.replace(".default.", ".")], value), name
        logits = adapted(IDS).logits
        merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), attn_implementation="eager").eval()
        merged_logits = merged(IDS).logits
    assert torch.allclose(logits, expected, atol=1e-5), (logits - expected).abs().max()
    assert torch.allclose(merged_logits, expected, atol=1e-5), (merged_logits - expected).abs().max()
    assert not torch.allclose(expected, before, atol=1e-4)  # the adapters changed the model
    assert torch.allclose(started, expected, atol=1e-6), (started - expected).abs().max()  # peft.init=the folder
