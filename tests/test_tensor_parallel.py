"""Tensor parallelism (`strategy.tp`, on fsdp; docs/strategies.md, Tensor parallelism). Each layer of the
model's plan is split over a tensor group that reads the same rows, the output layer's logits split over
the vocabulary (loss_parallel): the losses and gradient norms equal one rank's at the same global batch
(fp32, clipping active; losses and validation losses within 1e-6, gradient norms within 1e-5) at tp=2 on
2 ranks for the built-in transformer (its packed qkv and SwiGLU projections; with accumulation and
activation checkpointing, and with SHARD_GRAD_OP, too; bf16 within 2e-3 of one rank's bf16), a Qwen3
(its per-head q_norm/k_norm) and a Llama with grouped-query attention, and at dp=2 x tp=2 on 4 ranks;
checkpoints move between tp=2 and one rank (fsdp, ddp, zero3) and dp=2 x tp=2, with Adam's state, and a
tp=2 checkpoint verifies (`trainer.verify`) and holds one rank's tensors; the settings it does not cross
with are refused before any work, in one line."""
from __future__ import annotations

import pytest

from tests.harness import (
    assert_close,
    assert_resumes,
    case,
    losses,
    on_ranks,
    records,
    refused_by,
    resuming,
    saving,
    train_cases,
    with_overrides,
)
from trainer.demo import VOCAB

STEPS = 4
CLIP = 0.5  # below the tiny models' gradient norms: clipping is active, so the norm must be right
RTOL = 1e-6
# the gradient norm: measured 6.3e-8 at step 1; at step 2, after Adam's first update (lr 1e-2 moves each element of
# a near-zero gradient by about lr, whatever its rounding), 4.9e-6 at most; test_expert_parallel.py allows the same
NORM_RTOL = 1e-5
BF16_RTOL = 2e-3  # bf16 at tp=2 against one rank in bf16 (test_expert_parallel.py's bound)
GQA = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=False)


def model_dir(root, family: str) -> str:
    """A tiny Qwen3 or Llama (grouped-query attention: 4 heads, 2 key-value heads; Qwen3's per-head q_norm
    and k_norm), config only: the model's own init gives its first weights."""
    from transformers import AutoConfig

    AutoConfig.for_model(family, **GQA).save_pretrained(str(root / family))
    return str(root / family)


def tp_case(strategy: str, micro: int, model: str | None = None, **overrides) -> dict:
    """Global batch 8 (micro x data-parallel ranks), clipping active, validation after steps 2 and 4."""
    cfg = with_overrides(case(strategy, steps=STEPS), train__micro_batch_size=micro, train__grad_clip=CLIP,
                         optim__lr=1e-2, data__val_fraction=0.1, eval__every_steps=2, **overrides)
    if model is None:
        return cfg
    return {**cfg, "model": {"name": "hf", "kind": "hf", "path": model, "seq_len": 32, "vocab_size": VOCAB}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The quick suite's: the built-in model and Qwen3 at tp=2 against one rank, checkpoints both ways."""
    out = tmp_path_factory.mktemp("tensor_parallel")
    qwen = model_dir(out, "qwen3")
    ckpt = {name: out / f"ckpt_{name}" for name in ("one", "tp2")}
    on_ranks(1, train_cases, {"one": saving(tp_case("fsdp", 8), ckpt["one"], 2),
                              "one_qwen3": tp_case("fsdp", 8, qwen)}, str(out))
    on_ranks(2, train_cases, {"tp2": saving(tp_case("fsdp", 8, strategy__tp=2), ckpt["tp2"], 2),
                              "tp2_qwen3": tp_case("fsdp", 8, qwen, strategy__tp=2),
                              "tp2_from_one": resuming(tp_case("fsdp", 8, strategy__tp=2), ckpt["one"], 2)}, str(out))
    on_ranks(1, train_cases, {"ddp_from_tp2": resuming(tp_case("ddp", 8), ckpt["tp2"], 2),
                              "zero3_from_tp2": resuming(tp_case("zero3", 8), ckpt["tp2"], 2)}, str(out))
    return {**ckpt, "out": out, "qwen": qwen}


@pytest.fixture(scope="module")
def crossed(runs):
    """make test-all's: Llama, accumulation with activation checkpointing, SHARD_GRAD_OP and bf16 at tp=2."""
    out = runs["out"]
    llama = model_dir(out, "llama")
    on_ranks(1, train_cases, {"one_llama": tp_case("fsdp", 8, llama),
                              "one_bf16": tp_case("fsdp", 8, train__precision="bf16")}, str(out))
    on_ranks(2, train_cases, {"tp2_llama": tp_case("fsdp", 8, llama, strategy__tp=2),
                              "tp2_grad_op": tp_case("fsdp", 8, strategy__tp=2, strategy__sharding="SHARD_GRAD_OP"),
                              "tp2_bf16": tp_case("fsdp", 8, strategy__tp=2, train__precision="bf16"),
                              "tp2_accum_ac": tp_case("fsdp", 4, strategy__tp=2, train__grad_accum_steps=2,
                                                      train__activation_checkpointing=True)}, str(out))
    return out


@pytest.fixture(scope="module")
def fours(runs):
    """dp=2 x tp=2 on 4 ranks: two tensor groups, each reading its own rows."""
    out, qwen = runs["out"], runs["qwen"]
    on_ranks(4, train_cases, {"dp2_tp2": tp_case("fsdp", 4, strategy__tp=2),
                              "dp2_tp2_qwen3": tp_case("fsdp", 4, qwen, strategy__tp=2),
                              "dp2_tp2_from_tp2": resuming(tp_case("fsdp", 4, strategy__tp=2), runs["tp2"], 2)},
             str(out))
    return out


def assert_same_run(runs, name: str, baseline: str) -> None:
    base, run = ([r for r in records(runs / which) if "split" not in r] for which in (baseline, name))
    validation = [[r["loss"] for r in records(runs / which) if "split" in r] for which in (name, baseline)]
    assert len(validation[1]) == 2, "evaluated after steps 2 and 4"
    assert_close(*validation, f"{name}: val loss", RTOL)
    assert len(base) == STEPS and [r["step"] for r in run] == [r["step"] for r in base], (name, run)
    assert all(r["grad_norm"] > CLIP for r in base[:1]), "clipped: a wrong norm would change the losses"
    assert_close(losses(run), losses(base), name, RTOL)
    assert_close([r["grad_norm"] for r in run], [r["grad_norm"] for r in base], f"{name}: grad_norm", NORM_RTOL)
    assert [r["tokens"] for r in run] == [r["tokens"] for r in base], f"{name}: a tensor group counts its rows once"


@pytest.mark.parametrize("name, baseline", [("tp2", "one"), ("tp2_qwen3", "one_qwen3")])
def test_tp2_gives_one_ranks_losses_and_norms(runs, name, baseline):
    assert_same_run(runs["out"], name, baseline)


@pytest.mark.slow
@pytest.mark.parametrize("name, baseline", [("tp2_llama", "one_llama"), ("tp2_accum_ac", "one"),
                                            ("tp2_grad_op", "one")])
def test_tp2_crossed_gives_one_ranks_losses_and_norms(crossed, name, baseline):
    assert_same_run(crossed, name, baseline)


@pytest.mark.slow
def test_tp2_in_bf16_gives_one_ranks_losses_in_bf16(crossed):
    """FSDP2's bf16 compute over split weights: each rowwise layer's sum over the group is rounded apart."""
    base, run = ([r for r in records(crossed / which) if "split" not in r] for which in ("one_bf16", "tp2_bf16"))
    assert_close(losses(run), losses(base), "tp2_bf16", BF16_RTOL)


@pytest.mark.slow
@pytest.mark.parametrize("name, baseline", [("dp2_tp2", "one"), ("dp2_tp2_qwen3", "one_qwen3")])
def test_dp2_tp2_on_4_ranks_gives_one_ranks_losses_and_norms(fours, name, baseline):
    assert_same_run(fours, name, baseline)


@pytest.mark.parametrize("name, checkpoint", [("tp2_from_one", "one"), ("ddp_from_tp2", "tp2"),
                                              ("zero3_from_tp2", "tp2")])
def test_checkpoints_move_between_tp2_and_one_rank(runs, name, checkpoint):
    """The same global batch, Adam's moments and step restored: the steps after 2 as the run that saved."""
    out = runs["out"]
    assert_resumes(records(out / name), records(out / checkpoint), 2, name, RTOL)


@pytest.mark.slow
def test_a_tp2_checkpoint_resumes_at_dp2_tp2(fours):
    assert_resumes(records(fours / "dp2_tp2_from_tp2"), records(fours / "tp2"), 2, "dp2_tp2 from tp2", RTOL)


def test_a_tp2_checkpoint_verifies_and_holds_one_ranks_full_tensors(runs):
    """Every file intact (`trainer.verify`), every key covered whole by the ranks' pieces (rows, blocks of
    columns, packed parts), each within 1e-3 (relative, in norm) of one rank's after the same 2 steps,
    Adam's moments too."""
    from trainer.checkpoint.format import read_step_dir
    from trainer.verify import verify

    split, whole = (runs[run] / "step_00000002" for run in ("tp2", "one"))
    assert verify(split) == []
    split, whole = read_step_dir(split), read_step_dir(whole)
    assert split.weights.keys() == whole.weights.keys() and split.step == whole.step == 2
    for name, value in whole.weights.items():
        for what, a, b in [("weights", split.weights[name], value),
                           *((m, split.moments[name][m], whole.moments[name][m]) for m in whole.moments[name])]:
            # measured 4.7e-5 at most (Adam's first steps move an element of a near-zero gradient by up to lr
            # whatever its rounding); a part in another's place: of the order of 1
            assert (a - b).norm() <= 1e-3 * b.norm(), (name, what, float((a - b).norm() / b.norm()))


# -- refusals: before any work, in one line --------------------------------------------------------

REFUSED = {  # settings (strategy.*, or group__leaf) -> the start of the line
    "ddp": (dict(name="ddp"), "strategy.tp=2 needs strategy=fsdp"),
    "zero1": (dict(name="zero1"), "strategy.tp=2 needs strategy=fsdp"),
    "zero2": (dict(name="zero2"), "strategy.tp=2 needs strategy=fsdp"),
    "zero3": (dict(name="zero3"), "strategy.tp=2 needs strategy=fsdp"),
    "sp": (dict(sp=2), "strategy.tp=2 with strategy.sp=2"),
    "ep": (dict(ep=2), "strategy.tp=2 with strategy.ep=2"),
    "hsdp": (dict(sharding="HYBRID_SHARD"), "strategy.tp=2 with strategy.sharding=HYBRID_SHARD"),
    "no_shard": (dict(sharding="NO_SHARD"), "strategy.tp=2 with strategy.sharding=NO_SHARD"),
    "offload": (dict(offload_params=True, offload_optimizer=True), "strategy.tp=2 with offload"),
    "lora": (dict(peft__name="lora"), "strategy.tp=2 with peft=lora"),
    "compile": (dict(train__compile=True), "strategy.tp=2 with train.compile=true"),
    "fused_loss": (dict(train__fused_loss=True), "strategy.tp=2 with train.fused_loss=true"),
    "fp16": (dict(train__precision="fp16"), "strategy.tp=2 with train.precision=fp16"),
    "dpo": (dict(objective__name="dpo"), "strategy.tp=2 with objective=dpo"),
    "world": (dict(world=3), "strategy.tp: the world size 3 must be a multiple of strategy.tp=2"),
    "heads": (dict(tp=8, world=8), "strategy.tp=8: Transformer has 4 attention heads"),
    "zero": (dict(tp=0), "strategy.tp: must be >= 1"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_what_tensor_parallelism_does_not_take_is_refused_in_one_line(name):
    from trainer.checks import check_tensor_parallel
    from trainer.config import to_config
    from trainer.models import meta_model

    settings, said = REFUSED[name]
    world = settings.get("world", 4)
    strategy = {key: value for key, value in settings.items() if "__" not in key and key != "world"}
    cfg = to_config(with_overrides({"strategy": {"name": "fsdp", "tp": 2, **strategy}},
                                   **{key: value for key, value in settings.items() if "__" in key}))
    refused = refused_by(check_tensor_parallel, cfg, world, meta_model(cfg.model, cfg.peft))
    assert refused is not None and refused.startswith(said) and "\n" not in refused, refused


def test_a_family_without_a_plan_or_whose_heads_do_not_divide_is_refused_and_qwen3_is_not(tmp_path):
    from transformers import AutoConfig

    from trainer.config import ModelConfig
    from trainer.models import meta_model
    from trainer.models.tensor_plan import check_model_tensor_parallel

    def model(family, **config):
        AutoConfig.for_model(family, **config).save_pretrained(str(tmp_path / family))
        return meta_model(ModelConfig(name="hf", kind="hf", path=str(tmp_path / family), seq_len=32, vocab_size=VOCAB))

    gpt2 = model("gpt2", vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4)
    assert refused_by(check_model_tensor_parallel, 2, gpt2).startswith("strategy.tp=2: gpt2 has no tensor-parallel plan")
    qwen3 = model("qwen3", **GQA)
    assert refused_by(check_model_tensor_parallel, 2, qwen3) is None
    assert refused_by(check_model_tensor_parallel, 4, qwen3).startswith("strategy.tp=4: qwen3 has 2 key-value heads")
    moe = model("qwen3_moe", **{**GQA, "moe_intermediate_size": 16, "num_experts": 4})
    assert "splits the parameter model.layers.0.mlp.experts.gate_up_proj itself" in refused_by(
        check_model_tensor_parallel, 2, moe)


def test_a_custom_model_without_a_plan_is_refused():
    from torch import nn

    from trainer.models.tensor_plan import check_model_tensor_parallel

    assert refused_by(check_model_tensor_parallel, 2, nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8))).startswith(
        "strategy.tp=2: Sequential has no tensor-parallel plan: it declares no `_tp_plan`")


def test_a_tied_output_layer_and_an_embedding_with_a_padding_row_stay_whole(tmp_path):
    """Qwen2's lm_head is its embedding: both leave the plan, the rest of it stays. An embedding with a
    padding_idx leaves it too (its backward would skip another token's row on a rank)."""
    from transformers import AutoConfig

    from trainer.config import ModelConfig
    from trainer.demo import make_model_dir
    from trainer.models import meta_model
    from trainer.models.tensor_plan import planned_modules

    tied = meta_model(ModelConfig(name="hf", kind="hf", path=str(make_model_dir(tmp_path / "q", "qwen2", weights=False)),
                                  seq_len=32, vocab_size=VOCAB))
    names = [name for name, _, _ in planned_modules(tied)]
    assert "lm_head" not in names and "model.embed_tokens" not in names and "model.layers.0.self_attn.q_proj" in names
    AutoConfig.for_model("qwen3", **GQA, pad_token_id=0).save_pretrained(str(tmp_path / "padded"))
    padded = meta_model(ModelConfig(name="hf", kind="hf", path=str(tmp_path / "padded"), seq_len=32, vocab_size=VOCAB))
    names = [name for name, _, _ in planned_modules(padded)]
    assert "model.embed_tokens" not in names and "lm_head" in names


def test_the_command_line_refuses_tp_on_ddp_before_any_rank_starts(tmp_path):
    from tests.harness import refusal

    # strategy=auto with strategy.tp: the planner's (tests/test_plan_tensor_parallel.py)
    assert refusal(tmp_path, "nproc=2", "strategy.tp=2").startswith("strategy.tp=2 needs strategy=fsdp")
