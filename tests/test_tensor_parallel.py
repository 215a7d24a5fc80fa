"""Tensor parallelism (`strategy.tp`, on fsdp and zero1/2/3; docs/strategies.md, Tensor parallelism). Each layer of the
model's plan is split over a tensor group that reads the same rows: the losses and gradient norms equal
one rank's at the same global batch (fp32, clipping active, Adam's epsilon 1e-3; losses, validation
losses and gradient norms within 1e-6). On fsdp the output layer's logits are split over the vocabulary
(loss_parallel), at tp=2 on 2 ranks for the built-in transformer (its packed qkv and SwiGLU projections;
with accumulation and activation checkpointing, and with SHARD_GRAD_OP, too; bf16 within 2e-3 of one
rank's bf16), a Qwen3 (its per-head q_norm/k_norm) and a Llama with grouped-query attention, and at
dp=2 x tp=2 on 4 ranks, the norms sequence-parallel (strategy.tp_sequence_parallel, on by default for the
built-in transformer and the Hugging Face families of Llama's layout, Qwen3 and Llama here: the residual stream
split over the sequence, so a rank keeps fewer activation bytes than without it, as the planner counts; also
on chat rows packed several conversations a row; the models have no dropout); checkpoints move between tp=2 and one rank (fsdp, ddp, zero3) and dp=2 x tp=2,
with Adam's state, and a tp=2 checkpoint verifies (`trainer.verify`) and holds one rank's tensors. LoRA's
adapters split as their layers (peft=lora, on fsdp): a Qwen3 at tp=2 (also with accumulation and activation
checkpointing) and dp=2 x tp=2, and the built-in model at tp=2, give one rank's losses and norms, and
checkpoints of the adapters alone move between tp=2 and one rank and export whole. On
zero1/2/3 (DeepSpeed's AutoTP over the same plan) the same runs give one rank's losses and norms, at tp=2
on 2 ranks and dp=2 x tp=2 on 4, and checkpoints move from one rank to zero3's tp=2 and from zero2's tp=2
to one rank, fsdp's tp=2 and zero3's dp=2 x tp=2, and zero runs at tp=1 and tp=2 follow each other in the same
processes; each rank's logits are its half of the vocabulary, their loss and its gradient the whole logits'
cross-entropy's. A rank reads from checkpoints and pretrained files its own part's bytes only. The settings it
does not cross with are refused before any work, in one line."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.harness import (
    assert_close,
    assert_resumes,
    assert_saved_the_fp32_start,
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
RTOL = 1e-6  # losses, validation losses and gradient norms
# Adam's epsilon: at its default 1e-8 the first update moves each element of a near-zero gradient by about
# lr x its sign, so a rounding that flips the sign of a gradient that is 0 in exact arithmetic moves the
# parameter by 2 lr; the next gradient norm then differed by up to 4.9e-6 from one rank's (1.7e-6 at tp=2,
# 0 with 1e-3, measured). 1e-3 leaves the rounding of the sums tp changes as the only difference.
ADAM_EPS = 1e-3
BF16_RTOL = 2e-3  # bf16 at tp=2 against one rank in bf16 (test_expert_parallel.py's bound)
GQA = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=False)
# peft=lora: alpha / r = 4, so that the adapters' first gradient norm (lora_B's alone) is above CLIP
LORA = dict(peft__name="lora", peft__r=4, peft__alpha=16.0)
# the built-in model with every linear layer adapted, its output layer too: qkv packed, proj and down
# rowwise, up colwise, lm_head colwise with split logits
BUILTIN_LORA = dict(LORA, peft__target_modules=["qkv", "proj", "up", "down", "lm_head"])


def model_dir(root, family: str, weights: bool = False) -> str:
    """A tiny Qwen3 or Llama (grouped-query attention: 4 heads, 2 key-value heads; Qwen3's per-head q_norm
    and k_norm), config only: the model's own init gives its first weights; `weights`: saved with them (a
    LoRA run's pretrained base, which its checkpoints leave out)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = root / (f"{family}_weights" if weights else family)
    config = AutoConfig.for_model(family, **GQA)
    if weights:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(str(path))
    else:
        config.save_pretrained(str(path))
    return str(path)


def tp_case(strategy: str, micro: int, model: str | None = None, **overrides) -> dict:
    """Global batch 8 (micro x data-parallel ranks), clipping active, validation after steps 2 and 4."""
    cfg = with_overrides(case(strategy, steps=STEPS), train__micro_batch_size=micro, train__grad_clip=CLIP,
                         optim__lr=1e-2, optim__eps=ADAM_EPS, data__val_fraction=0.1, eval__every_steps=2,
                         **overrides)
    if model is None:
        return cfg
    return {**cfg, "model": {"name": "hf", "kind": "hf", "path": model, "seq_len": 32, "vocab_size": VOCAB}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The quick suite's: the built-in model and Qwen3 at tp=2 against one rank, checkpoints both ways; LoRA
    on a Qwen3 from saved weights (all-linear) at tp=2 against one rank, its checkpoint to one rank."""
    out = tmp_path_factory.mktemp("tensor_parallel")
    qwen, qwen_weights = model_dir(out, "qwen3"), model_dir(out, "qwen3", weights=True)
    ckpt = {name: out / f"ckpt_{name}" for name in ("one", "tp2", "one_lora", "tp2_lora")}
    on_ranks(1, train_cases, {"one": saving(tp_case("fsdp", 8), ckpt["one"], 2),
                              "one_qwen3": tp_case("fsdp", 8, qwen),
                              "one_lora": saving(tp_case("fsdp", 8, qwen_weights, **LORA), ckpt["one_lora"], 2)},
             str(out))
    on_ranks(2, train_cases, {"tp2": saving(tp_case("fsdp", 8, strategy__tp=2), ckpt["tp2"], 2),
                              "tp2_without_sequence_parallel": tp_case("fsdp", 8, strategy__tp=2,
                                                                       strategy__tp_sequence_parallel=False),
                              "tp2_qwen3": tp_case("fsdp", 8, qwen, strategy__tp=2),
                              "tp2_qwen3_without_sequence_parallel": tp_case("fsdp", 8, qwen, strategy__tp=2,
                                                                             strategy__tp_sequence_parallel=False),
                              "tp2_from_one": resuming(tp_case("fsdp", 8, strategy__tp=2), ckpt["one"], 2),
                              "tp2_lora": saving(tp_case("fsdp", 8, qwen_weights, strategy__tp=2, **LORA),
                                                 ckpt["tp2_lora"], 2)}, str(out))
    on_ranks(1, train_cases, {"ddp_from_tp2": resuming(tp_case("ddp", 8), ckpt["tp2"], 2),
                              "zero3_from_tp2": resuming(tp_case("zero3", 8), ckpt["tp2"], 2),
                              "ddp_lora_from_tp2": resuming(tp_case("ddp", 8, qwen_weights, **LORA), ckpt["tp2_lora"],
                                                            2)}, str(out))
    return {**ckpt, "out": out, "qwen": qwen, "qwen_weights": qwen_weights}


@pytest.fixture(scope="module")
def crossed(runs):
    """make test-all's: Llama, accumulation with activation checkpointing (with and without sequence
    parallelism), SHARD_GRAD_OP and bf16 at tp=2; LoRA on the built-in model and with accumulation and
    activation checkpointing at tp=2, and one rank's LoRA checkpoint resumed at tp=2."""
    out, qwen_weights = runs["out"], runs["qwen_weights"]
    llama = model_dir(out, "llama")
    accum_ac = dict(strategy__tp=2, train__grad_accum_steps=2, train__activation_checkpointing=True)
    on_ranks(1, train_cases, {"one_llama": tp_case("fsdp", 8, llama),
                              "one_bf16": tp_case("fsdp", 8, train__precision="bf16"),
                              "one_lora_builtin": tp_case("fsdp", 8, **BUILTIN_LORA)}, str(out))
    on_ranks(2, train_cases, {"tp2_llama": tp_case("fsdp", 8, llama, strategy__tp=2),
                              "tp2_grad_op": tp_case("fsdp", 8, strategy__tp=2, strategy__sharding="SHARD_GRAD_OP"),
                              "tp2_bf16": tp_case("fsdp", 8, strategy__tp=2, train__precision="bf16"),
                              "tp2_accum_ac": tp_case("fsdp", 4, **accum_ac),
                              "tp2_accum_ac_without_sequence_parallel": tp_case(
                                  "fsdp", 4, strategy__tp_sequence_parallel=False, **accum_ac),
                              "tp2_lora_builtin": tp_case("fsdp", 8, strategy__tp=2, **BUILTIN_LORA),
                              "tp2_lora_accum_ac": tp_case("fsdp", 4, qwen_weights, **accum_ac, **LORA),
                              "tp2_lora_from_one": resuming(tp_case("fsdp", 8, qwen_weights, strategy__tp=2, **LORA),
                                                            runs["one_lora"], 2)}, str(out))
    return out


@pytest.fixture(scope="module")
def fours(runs):
    """dp=2 x tp=2 on 4 ranks: two tensor groups, each reading its own rows (LoRA's too)."""
    out, qwen = runs["out"], runs["qwen"]
    on_ranks(4, train_cases, {"dp2_tp2": tp_case("fsdp", 4, strategy__tp=2),
                              "dp2_tp2_qwen3": tp_case("fsdp", 4, qwen, strategy__tp=2),
                              "dp2_tp2_lora": tp_case("fsdp", 4, runs["qwen_weights"], strategy__tp=2, **LORA),
                              "dp2_tp2_from_tp2": resuming(tp_case("fsdp", 4, strategy__tp=2), runs["tp2"], 2)},
             str(out))
    return out


# the built-in model's packed rows: three times as long as the conversations' ~85 tokens, so most rows hold several,
# some across the middle of the row, where a sequence-parallel rank's share of the tokens starts
PACKED_SEQ_LEN = 256


@pytest.fixture(scope="module")
def packed(runs):
    """make test-all's: chat conversations packed into rows (a row's documents kept apart by their position
    ids), the tiny Qwen3 on one rank, on fsdp at tp=2 and on zero2 at tp=2; the built-in model on one rank and
    on fsdp at tp=2 with its sequence-parallel norms (each rank's positions looked up from its share of the packed
    rows' position ids, attention over the whole rows' documents) and without them."""
    from trainer.demo import conversations, documents, train_chat_tokenizer, write_rows

    out = runs["out"]
    texts = documents()
    chat = {"data__name": "chat", "data__packing": True,
            "data__path": str(write_rows(out / "chat.jsonl", conversations(texts, n=60))),
            "data__tokenizer": str(train_chat_tokenizer(out / "chat_tokenizer", texts)),
            "data__cache_dir": str(out / "chat_cache")}

    def packed_case(strategy: str, **overrides) -> dict:
        cfg = tp_case(strategy, 8, runs["qwen"], **chat, **overrides)
        return {**cfg, "model": {**cfg["model"], "seq_len": 128}}

    def builtin_case(**overrides) -> dict:
        return tp_case("fsdp", 8, **chat, model__vocab_size=VOCAB, model__seq_len=PACKED_SEQ_LEN, **overrides)

    on_ranks(1, train_cases, {"one_packed": packed_case("fsdp"), "one_packed_builtin": builtin_case()}, str(out))
    on_ranks(2, train_cases, {"tp2_packed": packed_case("fsdp", strategy__tp=2),
                              "zero2_tp2_packed": packed_case("zero2", strategy__tp=2),
                              "tp2_packed_builtin": builtin_case(strategy__tp=2),
                              "tp2_packed_builtin_without_sequence_parallel": builtin_case(
                                  strategy__tp=2, strategy__tp_sequence_parallel=False)}, str(out))
    return {"out": out, "config": builtin_case(strategy__tp=2)}


def assert_same_run(runs, name: str, baseline: str) -> None:
    base, run = ([r for r in records(runs / which) if "split" not in r] for which in (baseline, name))
    validation = [[r["loss"] for r in records(runs / which) if "split" in r] for which in (name, baseline)]
    assert len(validation[1]) == 2, "evaluated after steps 2 and 4"
    assert_close(*validation, f"{name}: val loss", RTOL)
    assert len(base) == STEPS and [r["step"] for r in run] == [r["step"] for r in base], (name, run)
    assert all(r["grad_norm"] > CLIP for r in base[:1]), "clipped: a wrong norm would change the losses"
    assert_close(losses(run), losses(base), name, RTOL)
    assert_close([r["grad_norm"] for r in run], [r["grad_norm"] for r in base], f"{name}: grad_norm", RTOL)
    assert [r["tokens"] for r in run] == [r["tokens"] for r in base], f"{name}: a tensor group counts its rows once"


@pytest.mark.parametrize("name, baseline", [("tp2", "one"), ("tp2_without_sequence_parallel", "one"),
                                            ("tp2_qwen3", "one_qwen3"),
                                            ("tp2_qwen3_without_sequence_parallel", "one_qwen3")])
def test_tp2_gives_one_ranks_losses_and_norms(runs, name, baseline):
    assert_same_run(runs["out"], name, baseline)


def activations_held(out: Path, name: str) -> list[int]:
    return [r["mem"]["activations"] for r in records(out / name) if "mem" in r]


def test_tp2_holds_fewer_activation_bytes_than_one_rank(runs):
    """mem.activations counts what a rank holds: a saved DTensor by its local part, a weight's local
    share (`to_local`) as the weight (bench/tensor_parallel.py found both counted whole: 175 MB at
    tp=2 against 161 MB at one rank)."""
    held = {name: activations_held(runs["out"], name) for name in ("one", "tp2")}
    assert held["one"] and held["tp2"], held
    assert max(held["tp2"]) < 0.8 * min(held["one"]), held


@pytest.mark.parametrize("name, fewer", [("tp2", 5 * 66 * 4 * 512 // 2), ("tp2_qwen3", 5 * 65 * 4 * 256 // 2)])
def test_sequence_parallel_norms_keep_half_their_activation_bytes_at_tp2(runs, name, fewer):
    """With the norms sequence-parallel a rank keeps each norm's input (and what it derives) for its own half
    of the tokens, fewer bytes than at tp=2 without it, as the planner counts: the built-in's 5 norms x (64 + 2)
    fp32 values x 512 tokens / 2 = 337,920 (measured: 2,845,188 against 3,183,108); Qwen3's (null turns it on
    for a family of Llama's layout) 5 RMSNorms x (32 + 32 + 1) x 256 tokens / 2 = 166,400 (measured: 1,067,524
    against 1,233,924). The rest (each block's gathered input, its heads' and features' share) as without."""
    from trainer.config import to_config
    from trainer.plan.activations import planned

    without = f"{name}_without_sequence_parallel"
    held = {which: activations_held(runs["out"], which) for which in (name, without)}
    assert held[name] and held[without], held
    assert {a - b for a, b in zip(held[without], held[name])} == {fewer}, held
    model = runs["qwen"] if name == "tp2_qwen3" else None
    counted = {setting: to_config(tp_case("fsdp", 8, model, strategy__tp=2, strategy__tp_sequence_parallel=setting))
               for setting in (None, False)}
    kept = {setting: planned(cfg, False, False, tp=2).bytes(cfg.model.seq_len, cfg.train.micro_batch_size)
            for setting, cfg in counted.items()}
    assert kept[False] - kept[None] == fewer, kept


@pytest.mark.slow
@pytest.mark.parametrize("name, baseline", [("tp2_llama", "one_llama"), ("tp2_accum_ac", "one"),
                                            ("tp2_accum_ac_without_sequence_parallel", "one"), ("tp2_grad_op", "one")])
def test_tp2_crossed_gives_one_ranks_losses_and_norms(crossed, name, baseline):
    assert_same_run(crossed, name, baseline)


@pytest.mark.slow
@pytest.mark.parametrize("name, baseline", [("tp2_packed", "one_packed"), ("zero2_tp2_packed", "one_packed"),
                                            ("tp2_packed_builtin", "one_packed_builtin"),
                                            ("tp2_packed_builtin_without_sequence_parallel", "one_packed_builtin")])
def test_packed_chat_rows_at_tp2_give_one_ranks_losses_and_norms(packed, name, baseline):
    """Chat SFT with packing crosses tensor parallelism: each rank attends within a row's documents with
    its heads, and the losses, validation losses and norms are one rank's; with the built-in model's
    sequence-parallel norms too (a rank's share of a packed row looks up its own positions, which restart
    at each document, and attention keeps the whole rows' documents apart)."""
    assert_same_run(packed["out"], name, baseline)


@pytest.mark.slow
def test_packed_rows_hold_several_documents_and_sequence_parallel_norms_are_on(packed):
    """The packed runs' rows hold several conversations, some across the middle of the row (where the second
    rank's share of the tokens starts) and some starting in its second half; and the built-in model at tp=2
    runs its norms sequence-parallel: each keeps its input (and its mean and deviation) for half of the tokens,
    5 norms x (64 + 2) fp32 values x 8 rows x 256 tokens / 2 = 1,351,680 bytes fewer than without (measured:
    12,967,940 against 14,319,620)."""
    from trainer.config import to_config
    from trainer.data import load_data
    from trainer.data.sources import IGNORE_INDEX

    rows, _ = load_data(to_config(packed["config"]), 0)
    _, targets, positions = (torch.stack(column) for column in zip(*rows))
    document = (positions == 0).cumsum(dim=1)  # each token's document in its row (the padded tail one of its own)
    trained = [set(row[kept].tolist()) for row, kept in zip(document, targets != IGNORE_INDEX)]  # conversations
    assert min(map(len, trained)) >= 2, [len(t) for t in trained]  # several a row, in every row
    half = PACKED_SEQ_LEN // 2
    assert any(d in t and p > 0 for d, p, t in zip(document[:, half].tolist(), positions[:, half].tolist(), trained)), \
        "a conversation across the middle: the second share starts inside it"
    assert any(set(row[half + 1:][(p[half + 1:] == 0)].tolist()) & t for row, p, t in zip(document, positions, trained)), \
        "a conversation starting in the second share"
    held = {name: activations_held(packed["out"], name)
            for name in ("tp2_packed_builtin", "tp2_packed_builtin_without_sequence_parallel")}
    assert held["tp2_packed_builtin"] and held["tp2_packed_builtin_without_sequence_parallel"], held
    assert {a - b for a, b in zip(held["tp2_packed_builtin_without_sequence_parallel"], held["tp2_packed_builtin"])} \
        == {5 * 66 * 4 * 8 * PACKED_SEQ_LEN // 2}, held


@pytest.mark.slow
def test_with_checkpointing_sequence_parallel_ranks_keep_half_of_each_blocks_input(crossed):
    """With activation checkpointing a rank keeps each block's input, and the final norm's, for its own
    half of the tokens: (2 blocks x 64 + 66) fp32 values x 256 tokens / 2 = 99,328 bytes fewer than at
    tp=2 without sequence parallelism (measured: 300,548 against 399,876; one rank 530,948)."""
    held = {name: activations_held(crossed, name) for name in ("tp2_accum_ac", "tp2_accum_ac_without_sequence_parallel")}
    assert held["tp2_accum_ac"] and held["tp2_accum_ac_without_sequence_parallel"], held
    assert {a - b for a, b in zip(held["tp2_accum_ac_without_sequence_parallel"], held["tp2_accum_ac"])} == {
        (2 * 64 + 66) * 4 * 256 // 2}, held


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


@pytest.mark.parametrize("split, whole", [("tp2", "one"), ("tp2_lora", "one_lora")])
def test_a_tp2_checkpoint_verifies_and_holds_one_ranks_full_tensors(runs, split, whole):
    assert_holds_one_ranks_tensors(runs[split], runs[whole])


def test_a_tp2_checkpoint_exports_whole_weights(runs, tmp_path):
    """trainer.export of a tp=2 checkpoint writes every weight whole (rows, blocks of columns and packed
    parts joined), as one rank's export after the same 2 steps."""
    assert_exports_alike(runs["tp2"], runs["one"], tmp_path)


def assert_exports_alike(split: Path, whole: Path, out: Path, merge: bool = False, folder_file: str = "") -> None:
    """trainer.export of two checkpoints' step 2 (a file; `folder_file`: that file of an exported folder):
    the same tensors, of the same shapes, each within 1e-3 (relative, in norm)."""
    from safetensors.torch import load_file

    from trainer.checkpoint.export import export

    exported = []
    for name, run in (("split", split), ("whole", whole)):
        target = out / name if folder_file else out / f"{name}.safetensors"
        export(run / "step_00000002", target, merge)
        exported.append(load_file(str(target / folder_file if folder_file else target)))
    split, whole = exported
    assert split.keys() == whole.keys() and all(split[k].shape == whole[k].shape for k in whole)
    assert all((split[k] - whole[k]).norm() <= 1e-3 * whole[k].norm() for k in whole)


def assert_holds_one_ranks_tensors(split: Path, whole: Path) -> None:
    """Every file intact (`trainer.verify`), every key covered whole by the ranks' pieces (rows, blocks of
    columns, packed parts), each within 1e-3 (relative, in norm) of one rank's after the same 2 steps,
    Adam's moments too."""
    from trainer.checkpoint.format import read_step_dir
    from trainer.verify import verify

    split, whole = (run / "step_00000002" for run in (split, whole))
    assert verify(split) == []
    split, whole = read_step_dir(split), read_step_dir(whole)
    assert split.weights.keys() == whole.weights.keys() and split.step == whole.step == 2
    for name, value in whole.weights.items():
        for what, a, b in [("weights", split.weights[name], value),
                           *((m, split.moments[name][m], whole.moments[name][m]) for m in whole.moments[name])]:
            # measured 4.7e-5 at most (Adam's first steps move an element of a near-zero gradient by up to lr
            # whatever its rounding); a part in another's place: of the order of 1
            assert (a - b).norm() <= 1e-3 * b.norm(), (name, what, float((a - b).norm() / b.norm()))


# -- LoRA (peft=lora) on fsdp: each adapter split as its layer --------------------------------------
# `launch`: the fixture whose launches ran the case, beside its other runs (make test's `runs`, make
# test-all's `crossed` and `fours`)

SLOW = pytest.mark.slow


@pytest.mark.parametrize("launch, name, baseline", [
    ("runs", "tp2_lora", "one_lora"), pytest.param("crossed", "tp2_lora_builtin", "one_lora_builtin", marks=SLOW),
    pytest.param("crossed", "tp2_lora_accum_ac", "one_lora", marks=SLOW),
    pytest.param("fours", "dp2_tp2_lora", "one_lora", marks=SLOW)])
def test_lora_over_a_tensor_group_gives_one_ranks_losses_and_norms(request, runs, launch, name, baseline):
    """Adapters split as their layers (a colwise or packed layer's lora_B by rows, a rowwise layer's lora_A
    by columns, the other whole), the base frozen: one rank's losses, validation losses and clipped
    gradient norms, each adapter counted once."""
    request.getfixturevalue(launch)
    assert_same_run(runs["out"], name, baseline)


@pytest.mark.parametrize("launch, name, checkpoint", [("runs", "ddp_lora_from_tp2", "tp2_lora"),
                                                      pytest.param("crossed", "tp2_lora_from_one", "one_lora",
                                                                   marks=SLOW)])
def test_lora_checkpoints_hold_the_adapters_alone_and_move_between_tp2_and_one_rank(request, runs, launch, name,
                                                                                    checkpoint):
    """A LoRA checkpoint at tp=2, as at one rank, holds the adapters and their Adam moments alone (the base
    is read from its files); resumed at the other, the steps after 2 are the straight run's."""
    from trainer.checkpoint.format import read_manifest

    request.getfixturevalue(launch)
    saved = [key for key in read_manifest(runs[checkpoint] / "step_00000002")["tensors"] if key != "optim.step"]
    assert saved and all(".lora_A." in key or ".lora_B." in key for key in saved), saved
    assert_resumes(records(runs["out"] / name), records(runs["out"] / checkpoint), 2, name, RTOL)


@pytest.mark.parametrize("merge, weights", [(False, "adapter_model.safetensors"), (True, "model.safetensors")])
def test_a_lora_tp2_checkpoint_exports_whole_weights(runs, tmp_path, merge, weights):
    """trainer.export of a LoRA tp=2 checkpoint: its adapter folder, and the model with them merged, hold
    every tensor whole, as one rank's export after the same 2 steps."""
    assert_exports_alike(runs["tp2_lora"], runs["one_lora"], tmp_path, merge, weights)


class FileBytes(TorchDispatchMode):
    """Bytes that torch's ops copy out of the memory maps of the files under `folder` (/proc/self/maps):
    of each op that reads a tensor lying in one, as many of its elements as the op reads or writes, the
    fewer (an index reads what it gives, a copy what it copies; a view reads nothing)."""

    def __init__(self, folder: Path):
        super().__init__()
        self.folder, self.bytes = str(folder), 0

    def spans(self) -> list[tuple[int, int]]:
        lines = (line.split(maxsplit=5) for line in Path("/proc/self/maps").read_text().splitlines())
        return [tuple(int(a, 16) for a in fields[0].split("-")) for fields in lines
                if len(fields) == 6 and fields[5].startswith(self.folder)]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        spans = self.spans()
        mapped = [t for t in args if isinstance(t, torch.Tensor) and any(lo <= t.data_ptr() < hi for lo, hi in spans)]
        if mapped and not func.is_view:
            written = (out[0] if isinstance(out, (list, tuple)) else out).numel()
            self.bytes += sum(min(t.numel(), written) * t.element_size() for t in mapped)
        return out


def test_a_rank_copies_only_its_own_columns_of_a_rowwise_layer(tmp_path):
    """At tp=2 a rank's part of a rowwise layer is a block of columns, half of every row: from a checkpoint
    saved at tp=2 (each rank's columns in its file), from one saved by one rank (the tensor flat in one
    file) and from pretrained bf16 safetensors weights, each rank copies its part's own bytes from the files
    and nothing more (not its rows whole, twice them), and gets its part's values; from the tp=2 checkpoint
    it opens its own file only."""
    from trainer.checkpoint.format import Piece, PieceReader, write_tensors
    from trainer.models.weights import Block, SafetensorsWeights, save_safetensors

    rows, columns, tp = 8, 64, 2
    full = torch.randn(rows, columns)
    blocks = [Block(rank * columns // tp, columns // tp, columns) for rank in range(tp)]  # tensor_part's Shard(1)
    saved = {"tp2": [(rank, Piece(0, full[:, b.column:b.column + b.width].reshape(-1), b)) for rank, b in enumerate(blocks)],
             "one": [(0, Piece(0, full.view(-1)))]}
    for name, pieces in saved.items():
        (tmp_path / name).mkdir()
        checksums = {f"rank_{rank}.safetensors": write_tensors({f"w@{piece.start}": piece.tensor},
                                                               tmp_path / name / f"rank_{rank}.safetensors")
                     for rank, piece in pieces}
        manifest = {"tensors": {"w": {"pieces": [[f"rank_{rank}.safetensors", *piece.entry()] for rank, piece in pieces],
                                      "shape": [rows, columns]}}, "checksums": checksums}
        for rank, block in enumerate(blocks):
            reader = PieceReader(tmp_path / name, manifest)
            with FileBytes(tmp_path / name) as counted:
                part = reader.read("w", 0, rows * block.width, block)
            assert torch.equal(part, full[:, block.column:block.column + block.width].reshape(-1)), name
            assert counted.bytes == part.numel() * 4, (name, block, counted.bytes)
            assert list(reader.files) == [f"rank_{rank if name == 'tp2' else 0}.safetensors"], "opened (and hashed)"
    (tmp_path / "hub").mkdir()
    save_safetensors({"w": full.bfloat16()}, tmp_path / "hub" / "model.safetensors")
    weights = SafetensorsWeights(tmp_path / "hub", {"w": (rows, columns)})
    for block in blocks:
        with FileBytes(tmp_path / "hub") as counted:
            part = weights.read("w", 0, rows * block.width, block)
        assert torch.equal(part, full.bfloat16()[:, block.column:block.column + block.width].reshape(-1).float())
        assert counted.bytes == part.numel() * 2, (block, counted.bytes)


# -- zero1/2/3: DeepSpeed's AutoTP over the same plan (strategies/ds_tp.py) -----------------------

@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory):
    """One rank (ddp), and tp=2 on 2 ranks on each ZeRO stage; checkpoints from one to the other, and from
    zero2's tp=2 to fsdp's."""
    from trainer.demo import make_model_dir

    out = tmp_path_factory.mktemp("tensor_parallel_zero")
    qwen = model_dir(out, "qwen3")
    tied = str(make_model_dir(out / "qwen2", "qwen2", weights=False))  # its output layer is its embedding: whole
    ckpt = {name: out / f"ckpt_{name}" for name in ("one", "zero2_tp2")}
    on_ranks(1, train_cases, {"one": saving(tp_case("ddp", 8), ckpt["one"], 2),
                              "one_qwen3": tp_case("ddp", 8, qwen),
                              "one_qwen2": tp_case("ddp", 8, tied)}, str(out))
    on_ranks(2, train_cases, {"zero2_tp2": saving(tp_case("zero2", 8, strategy__tp=2), ckpt["zero2_tp2"], 2),
                              "zero2_tp2_qwen3": tp_case("zero2", 8, qwen, strategy__tp=2),
                              "zero1_tp2": tp_case("zero1", 8, strategy__tp=2),
                              "zero2_tp2_accum_ac": tp_case("zero2", 4, strategy__tp=2, train__grad_accum_steps=2,
                                                            train__activation_checkpointing=True),
                              "zero3_tp2_accum_micro_step": tp_case("zero3", 4, strategy__tp=2, train__grad_accum_steps=2,
                                                                    strategy__grad_reduce="micro_step"),
                              "zero3_tp2": tp_case("zero3", 8, strategy__tp=2),
                              "zero3_tp2_qwen3": tp_case("zero3", 8, qwen, strategy__tp=2),
                              "zero1_tp2_qwen2": tp_case("zero1", 8, tied, strategy__tp=2),
                              "zero3_tp2_qwen2": tp_case("zero3", 8, tied, strategy__tp=2),
                              "zero3_tp2_offload": tp_case("zero3", 8, strategy__tp=2, strategy__offload_params=True,
                                                           strategy__offload_optimizer=True),
                              "zero2_tp2_offload_from_one": resuming(tp_case("zero2", 8, strategy__tp=2,
                                                                             strategy__offload_optimizer=True),
                                                                     ckpt["one"], 2),
                              "zero3_tp2_from_one": resuming(tp_case("zero3", 8, strategy__tp=2), ckpt["one"], 2),
                              "fsdp_tp2_from_zero2_tp2": resuming(tp_case("fsdp", 8, strategy__tp=2),
                                                                  ckpt["zero2_tp2"], 2)}, str(out))
    on_ranks(1, train_cases, {"ddp_from_zero2_tp2": resuming(tp_case("ddp", 8), ckpt["zero2_tp2"], 2)}, str(out))
    return {**ckpt, "out": out, "qwen": qwen}


@pytest.fixture(scope="module")
def zero_fours(zero_runs):
    """dp=2 x tp=2 on 4 ranks: ZeRO partitions over each data-parallel pair (ranks {0, 2} and {1, 3})."""
    out, qwen = zero_runs["out"], zero_runs["qwen"]
    on_ranks(4, train_cases, {"zero2_dp2_tp2": tp_case("zero2", 4, strategy__tp=2),
                              "zero3_dp2_tp2_qwen3": tp_case("zero3", 4, qwen, strategy__tp=2),
                              "zero3_dp2_tp2_from_zero2_tp2": resuming(tp_case("zero3", 4, strategy__tp=2),
                                                                       zero_runs["zero2_tp2"], 2)}, str(out))
    return out


@pytest.mark.parametrize("name, baseline", [("zero2_tp2", "one"), ("zero2_tp2_qwen3", "one_qwen3"),
                                            ("zero1_tp2", "one"), ("zero3_tp2", "one"),
                                            ("zero3_tp2_qwen3", "one_qwen3"), ("zero2_tp2_accum_ac", "one"),
                                            ("zero3_tp2_accum_micro_step", "one"), ("zero1_tp2_qwen2", "one_qwen2"),
                                            ("zero3_tp2_qwen2", "one_qwen2"), ("zero3_tp2_offload", "one")])
def test_zero_tp2_gives_one_ranks_losses_and_norms(zero_runs, name, baseline):
    assert_same_run(zero_runs["out"], name, baseline)


@pytest.mark.slow
@pytest.mark.parametrize("name, baseline", [("zero2_dp2_tp2", "one"), ("zero3_dp2_tp2_qwen3", "one_qwen3")])
def test_zero_dp2_tp2_on_4_ranks_gives_one_ranks_losses_and_norms(zero_fours, name, baseline):
    assert_same_run(zero_fours, name, baseline)


@pytest.mark.slow
def test_a_zero2_tp2_checkpoint_resumes_at_zero3_dp2_tp2(zero_fours):
    assert_resumes(records(zero_fours / "zero3_dp2_tp2_from_zero2_tp2"), records(zero_fours / "zero2_tp2"), 2,
                   "zero3 dp2_tp2 from zero2 tp2", RTOL)


@pytest.mark.parametrize("name, checkpoint", [("zero3_tp2_from_one", "one"), ("zero2_tp2_offload_from_one", "one"),
                                              ("ddp_from_zero2_tp2", "zero2_tp2"),
                                              ("fsdp_tp2_from_zero2_tp2", "zero2_tp2")])
def test_checkpoints_move_between_zero_tp2_one_rank_and_fsdp_tp2(zero_runs, name, checkpoint):
    out = zero_runs["out"]
    assert_resumes(records(out / name), records(out / checkpoint), 2, name, RTOL)


def test_a_zero2_tp2_checkpoint_verifies_and_holds_one_ranks_full_tensors(zero_runs):
    assert_holds_one_ranks_tensors(zero_runs["zero2_tp2"], zero_runs["one"])


def test_zero_runs_at_tp1_and_tp2_in_the_same_processes_each_give_one_ranks_losses(tmp_path):
    """DeepSpeed keeps its (dp, tp) groups in its modules: zero2 on 2 ranks at tp=1, then at tp=2, then
    at tp=1 again, in the same ranks' processes, each make their own groups and train as one rank does
    (the tp=2 run on tensor groups of 2, the tp=1 runs after it partitioning over both ranks)."""
    runs = {"one": tp_case("ddp", 8), "zero2": tp_case("zero2", 4), "zero2_tp2": tp_case("zero2", 8, strategy__tp=2),
            "zero2_after_tp2": tp_case("zero2", 4)}
    on_ranks(1, train_cases, {"one": runs.pop("one")}, str(tmp_path))
    on_ranks(2, train_cases, runs, str(tmp_path))
    for name in runs:
        assert_same_run(tmp_path, name, "one")


def test_zero_tp_asks_deepspeed_for_autotp_and_a_users_config_cannot_disagree(tmp_path):
    """strategy.tp=2 on zero: AutoTP at 2, its own vocabulary-parallel head off (it would split a tied output
    layer and replace a Hugging Face model's loss; the plan splits an untied one), no train_batch_size (ZeRO-1/2 and ZeRO-3 check it against different ranks); a user's ds_config that
    turns AutoTP on at strategy.tp=1, or to another degree, is refused in one line."""
    import json

    from trainer.config import to_config
    from trainer.strategies.ds_config import build_ds_config

    ours = build_ds_config(to_config(with_overrides(case("zero3"), strategy__tp=2)), world_size=4)
    assert ours["tensor_parallel"] == {"autotp_size": 2, "vocab_parallel_lm_head": False}
    assert "train_batch_size" not in ours
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"tensor_parallel": {"autotp_size": 2}}))
    for tp in (1, 4):
        cfg = to_config(with_overrides(case("zero2", strategy__deepspeed_config=str(ds)), strategy__tp=tp))
        assert refused_by(build_ds_config, cfg, 4) == (f"strategy.deepspeed_config: tensor_parallel.autotp_size=2 "
                                                      f"disagrees with strategy.tp={tp}; choose with strategy.tp")


def split_logits_and_their_loss(env, cfg: dict) -> dict:
    """One forward at zero tp=2 on rows with unlabelled positions: the logits' columns on this rank, and
    the vocabulary-parallel loss and its gradient to this rank's logits against the cross-entropy of
    the whole logits (gathered here, for the comparison only)."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor

    from trainer.config import to_config
    from trainer.data import IGNORE_INDEX
    from trainer.losses.objectives import forward, token_loss_sum
    from trainer.strategies import build_strategy
    from trainer.training.setup import setup_model

    config = to_config(cfg)
    strategy = build_strategy(config, env)
    model, _, _, _ = setup_model(config, strategy)
    vocab = config.model.vocab_size
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    targets = ids.roll(-1, 1)
    targets[:, ::3] = IGNORE_INDEX  # no target: counts zero
    with torch.no_grad():
        logits = forward(model, [ids, targets])
    if not isinstance(logits, DTensor):  # gathered whole
        return {"columns": logits.shape[-1], "vocab": vocab}
    # a leaf: the loss's own gradient, without the model's backward (DeepSpeed's reduction after it)
    logits = DTensor.from_local(logits.to_local().requires_grad_(), logits.device_mesh, logits.placements)
    with strategy.autocast():
        loss = token_loss_sum(logits, targets)
        grad, = torch.autograd.grad(loss, logits)
    whole = logits.full_tensor().detach().requires_grad_()
    expected = F.cross_entropy(whole.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    expected.backward()
    columns = logits.to_local().shape[-1]
    own = whole.grad[..., strategy.layout.tp_rank * columns:(strategy.layout.tp_rank + 1) * columns]
    facts = {"columns": columns, "vocab": vocab, "loss": loss.item(), "expected": expected.item(),
             "grad_error": (grad.to_local() - own).abs().max().item()}
    strategy.teardown()
    return facts


@pytest.mark.parametrize("strategy, family", [("zero2", None), ("zero3", "qwen3")])
def test_zero_tp2_keeps_the_logits_split_and_its_loss_is_the_whole_logits_cross_entropy(tmp_path, strategy, family):
    """zero at tp=2 (the built-in on zero2; Qwen3 on zero3, its output layer partitioned too): each rank
    computes the logits of its half of the vocabulary only, never the whole, and the vocabulary-parallel
    cross-entropy over them is the whole logits' (positions without a target count zero), in value and
    in its gradient to each rank's half."""
    model = model_dir(tmp_path, family) if family else None
    facts = on_ranks(2, split_logits_and_their_loss, tp_case(strategy, 2, model, strategy__tp=2))
    for rank, f in facts.items():
        assert f["columns"] == f["vocab"] // 2, (rank, f)
        assert f["loss"] == pytest.approx(f["expected"], rel=RTOL), (rank, f)
        assert f["grad_error"] <= 1e-7, (rank, f)


def setup_refusal(env, cfg: dict) -> str | None:
    from trainer.config import to_config
    from trainer.strategies import build_strategy
    from trainer.training.setup import setup_model

    config = to_config(cfg)
    return refused_by(setup_model, config, build_strategy(config, env))


def test_zero_tp2_refuses_an_output_layer_that_autotp_splits_unevenly(tmp_path):
    """A ds_config's tp_grain_size can make AutoTP split the vocabulary unevenly (the built-in's 256 rows
    in grains of 96: 96 and 160), which the vocabulary-parallel loss (torch's equal shards) would misread:
    refused in one line on every rank."""
    import json

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"tensor_parallel": {"tp": {"tp_grain_size": 96}}}))
    said = on_ranks(2, setup_refusal, tp_case("zero2", 8, strategy__tp=2, strategy__deepspeed_config=str(ds)))
    assert set(said.values()) == {"strategy.tp=2: AutoTP split lm_head's vocabulary unevenly ([96, 160] rows), "
                                  "which the vocabulary-parallel loss does not take; leave the ds_config's "
                                  "tensor_parallel.tp.tp_grain_size unset"}, said


def test_under_bf16_zero_tp2_starts_from_the_fp32_masters(tmp_path):
    """lr 0, one step: what each ZeRO stage saves at tp=2 is where it started, the fp32 values themselves
    (DeepSpeed clones its masters from the bf16 slices unless they are set again, through the slice)."""
    configs = {s: with_overrides(case(s, steps=1), strategy__tp=2, train__precision="bf16", optim__lr=0.0,
                                 checkpoint__dir=str(tmp_path / s)) for s in ("zero1", "zero2", "zero3")}
    on_ranks(2, train_cases, configs, str(tmp_path / "runs"))
    assert_saved_the_fp32_start(configs, tmp_path)


# -- refusals: before any work, in one line --------------------------------------------------------

REFUSED = {  # settings (strategy.*, or group__leaf) -> the start of the line
    "ddp": (dict(name="ddp"), "strategy.tp=2 needs strategy=fsdp, zero1, zero2 or zero3"),
    "sp": (dict(sp=2), "strategy.tp=2 with strategy.sp=2"),
    "ep": (dict(ep=2), "strategy.tp=2 with strategy.ep=2"),
    "hsdp": (dict(sharding="HYBRID_SHARD"), "strategy.tp=2 with strategy.sharding=HYBRID_SHARD"),
    "no_shard": (dict(sharding="NO_SHARD"), "strategy.tp=2 with strategy.sharding=NO_SHARD"),
    "offload": (dict(offload_params=True, offload_optimizer=True), "strategy.tp=2 with offload"),
    "compile": (dict(train__compile=True), "strategy.tp=2 with train.compile=true"),
    "fused_loss": (dict(train__fused_loss=True), "strategy.tp=2 with train.fused_loss=true"),
    "fp16": (dict(train__precision="fp16"), "strategy.tp=2 with train.precision=fp16"),
    "dpo": (dict(objective__name="dpo"), "strategy.tp=2 with objective=dpo"),
    "world": (dict(world=3), "strategy.tp: the world size 3 must be a multiple of strategy.tp=2"),
    "heads": (dict(tp=8, world=8), "strategy.tp=8: Transformer has 4 attention heads"),
    "zero": (dict(tp=0), "strategy.tp: must be >= 1"),
    "zero3_lora": (dict(name="zero3", peft__name="lora"), "strategy.tp=2 with peft=lora: strategy=zero3"),
    "zero1_fused_loss": (dict(name="zero1", train__fused_loss=True), "strategy.tp=2 with train.fused_loss=true"),
    "zero3_dpo": (dict(name="zero3", objective__name="dpo"), "strategy.tp=2 with objective=dpo: strategy=zero3"),
    "zero2_heads": (dict(name="zero2", tp=8, world=8), "strategy.tp=8: Transformer has 4 attention heads"),
    "sequence_parallel_zero3": (dict(name="zero3", tp_sequence_parallel=True),
                                "strategy.tp_sequence_parallel: true needs strategy=fsdp, strategy.tp > 1 (got zero3"),
    "sequence_parallel_tp1": (dict(tp=1, tp_sequence_parallel=True),
                              "strategy.tp_sequence_parallel: true needs strategy=fsdp, strategy.tp > 1 (got fsdp, tp=1"),
    "sequence_parallel_seq_len": (dict(model__seq_len=63), "strategy.tp=2: Transformer's pos_emb has 63 positions"),
    "sequence_parallel_lora": (dict(tp_sequence_parallel=True, peft__name="lora"),
                               "strategy.tp_sequence_parallel: true needs strategy=fsdp, strategy.tp > 1 (got fsdp, tp=2), "
                               "no peft=lora"),
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


def test_sequence_parallel_is_refused_where_the_plan_does_not_declare_it_and_left_off_by_default(tmp_path):
    """A Hugging Face family of Llama's layout (Qwen3, Llama) is given a `_tp_sequence_plan`: null (the default)
    and true take it, false leaves it off, and a model.seq_len that strategy.tp does not divide is refused.
    Gemma2 (norms after attention and the MLP too) declares none: true is refused in one line, null splits it as
    without."""
    from trainer.checks import check_tensor_parallel
    from trainer.config import to_config
    from trainer.models import meta_model
    from trainer.models.tensor_plan import uses_sequence_parallel

    def checked(family: str, setting: bool | None, seq_len: int = 32) -> tuple[str | None, bool]:
        cfg = with_overrides(tp_case("fsdp", 8, model_dir(tmp_path, family), strategy__tp=2,
                                     strategy__tp_sequence_parallel=setting), model__seq_len=seq_len)
        cfg = to_config(cfg)
        model = meta_model(cfg.model, cfg.peft)
        return refused_by(check_tensor_parallel, cfg, 2, model), uses_sequence_parallel(cfg.strategy, model)

    for family in ("qwen3", "llama"):
        assert checked(family, None) == checked(family, True) == (None, True)
        assert checked(family, False) == (None, False)
    refused, _ = checked("qwen3", None, seq_len=31)
    assert refused.startswith("strategy.tp_sequence_parallel: model.seq_len=31 must be a multiple of strategy.tp=2"), \
        refused
    assert checked("gemma2", None) == (None, False)
    refused, _ = checked("gemma2", True)
    assert refused.startswith("strategy.tp_sequence_parallel: true needs") and "\n" not in refused, refused


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


def test_lora_adapters_split_as_their_layers_and_stay_whole_beside_a_layer_left_whole(tmp_path):
    """peft=lora at tp=2 on fsdp passes the checks. A planned layer's base_layer splits (not peft's wrapper
    around it), a colwise layer's lora_B and a rowwise layer's lora_A as it, the other adapter whole; the
    adapters of Qwen2's tied output layer, which stays whole, stay whole too."""
    from torch import nn

    from trainer.checks import check_tensor_parallel
    from trainer.config import to_config
    from trainer.demo import make_model_dir
    from trainer.models import meta_model
    from trainer.models.tensor_plan import planned_modules

    tied = str(make_model_dir(tmp_path / "qwen2", "qwen2", weights=False))
    cfg = to_config(tp_case("fsdp", 8, tied, strategy__tp=2, **LORA, peft__target_modules=["q_proj", "o_proj",
                                                                                          "lm_head"]))
    model = meta_model(cfg.model, cfg.peft)
    assert refused_by(check_tensor_parallel, cfg, 2, model) is None
    planned = {name: (type(module), value) for name, module, value in planned_modules(model)}
    attention = "model.layers.0.self_attn"
    assert {name: planned[name] for name in planned if name.startswith((f"{attention}.q_proj", f"{attention}.o_proj"))} \
        == {f"{attention}.q_proj": (nn.Linear, "colwise"), f"{attention}.q_proj.lora_B.default": (nn.Linear, "colwise"),
            f"{attention}.o_proj": (nn.Linear, "rowwise"), f"{attention}.o_proj.lora_A.default": (nn.Linear, "rowwise")}
    assert not any(name.startswith("lm_head") for name in planned), planned


def test_the_command_line_refuses_tp_on_ddp_before_any_rank_starts(tmp_path):
    from tests.harness import refusal

    # strategy=auto with strategy.tp: the planner's (tests/test_plan_tensor_parallel.py)
    assert refusal(tmp_path, "nproc=2", "strategy.tp=2").startswith("strategy.tp=2 needs strategy=fsdp")
