"""`train.fused_loss=true`: the output layer gives each token's loss, in chunks, without the
[tokens, vocab] logits; the same losses as the plain loss on every strategy (the output weight the
backend gathered, a tied one too), with LoRA, sequence parallelism, compile and validation; what
cannot be fused is refused before any rank starts."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from examples.toy_model import ToyLM
from tests.harness import (
    LOSS_RTOL,
    assert_close,
    assert_resumes,
    case,
    losses,
    on_ranks,
    records,
    refusal,
    resuming,
    saving,
    train_cases,
    with_overrides,
)
from trainer.data.sources import IGNORE_INDEX
from trainer.losses.objectives import NextToken
from trainer.models.builtin import ModelShape, Transformer
from trainer.models.fused_loss import fuse_output_layer

FUSED_RTOL = 1e-6  # fp32, against the plain loss on the same strategy and ranks


class ScaledLogits(ToyLM):
    """A custom model whose logits are its output layer's, doubled (as Cohere's logit_scale)."""

    def forward(self, ids):
        return 2 * super().forward(ids)


def scaled_logits(vocab: int = 256, dim: int = 16) -> ScaledLogits:
    return ScaledLogits(vocab, dim, 1)


def saved_for_backward(objective: NextToken, model, batch) -> tuple[torch.Tensor, list[torch.Size]]:
    """The summed loss of a micro-batch and the shapes of every tensor its forward saves for backward."""
    shapes = []

    def pack(t):
        shapes.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = objective.loss_sum(model, batch)
    return loss, shapes


def test_the_fused_loss_equals_the_plain_one_and_saves_no_tokens_by_vocab_tensor():
    tokens, vocab = (2, 96), 256  # more tokens than the width: the output weight [vocab, width] is smaller
    shape = ModelShape(vocab_size=vocab, seq_len=96, d_model=32, n_layers=1, n_heads=2, d_ff=64)
    torch.manual_seed(0)
    plain = Transformer(shape)
    fused = Transformer(shape)
    fused.load_state_dict(plain.state_dict())
    fuse_output_layer(fused, vocab)
    inputs = torch.randint(0, vocab, tokens)
    targets = torch.randint(0, vocab, tokens)
    targets[0, :10] = IGNORE_INDEX
    batch = [inputs, targets]

    expected, plain_saved = saved_for_backward(NextToken(), plain, batch)
    loss, fused_saved = saved_for_backward(NextToken(fused=True), fused, batch)

    logits_elements = tokens[0] * tokens[1] * vocab
    assert max(s.numel() for s in plain_saved) >= logits_elements  # the measure sees the plain loss's logits
    assert max(s.numel() for s in fused_saved) < logits_elements, sorted(fused_saved, key=torch.Size.numel)[-3:]
    assert abs(loss.item() - expected.item()) <= FUSED_RTOL * expected.item()
    expected.backward()
    loss.backward()
    for (name, p), q in zip(plain.named_parameters(), fused.parameters()):
        assert (q.grad - p.grad).abs().max() <= 2e-6 * p.grad.abs().max(), name  # measured: at most 5e-7
    # outside the objective the layer gives logits, as before (an export, generation)
    with torch.no_grad():
        torch.testing.assert_close(fused(inputs), plain(inputs))
    assert F.cross_entropy(plain(inputs).flatten(0, 1), targets.flatten(), reduction="sum").item() == pytest.approx(
        expected.item())


def test_a_target_outside_the_vocabulary_is_an_error_as_with_the_plain_loss():
    vocab = 64
    shape = ModelShape(vocab_size=vocab, seq_len=8, d_model=16, n_layers=1, n_heads=2, d_ff=32)
    fused = Transformer(shape)
    fuse_output_layer(fused, vocab)
    inputs = torch.randint(0, vocab, (1, 8))
    for wrong in (vocab, -3):
        targets = torch.randint(0, vocab, (1, 8))
        targets[0, 3] = wrong
        with pytest.raises(RuntimeError, match=r"a target outside the vocabulary \[0, 64\)"):
            NextToken(fused=True).loss_sum(fused, [inputs, targets])
    targets[0, 3] = IGNORE_INDEX  # ignored targets are not in the vocabulary either: no error
    NextToken(fused=True).loss_sum(fused, [inputs, targets])


def grad_factor(grad: torch.Tensor, reference: torch.Tensor) -> float:
    """The common factor between two gradients (least squares): 1 where neither is scaled off."""
    grad, reference = grad.float(), reference.float()
    return ((grad * reference).sum() / (reference * reference).sum()).item()


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16_weights", "autocast"])
def test_a_bf16_fused_step_is_its_plain_step_in_fp32_math(autocast):
    """bf16 weights (FSDP2, DeepSpeed) or fp32 weights under bf16 autocast (DDP): the fused loss equals
    the plain one (bf16 logits, cross-entropy in fp32), not the fp32 sum of bf16-rounded token losses,
    and the gradient's scale (here 1/3, not a bf16 number) enters in fp32: no common factor off by
    bf16's rounding (torch's op: 1.0018 measured)."""
    tokens, vocab = (2, 96), 256
    shape = ModelShape(vocab_size=vocab, seq_len=96, d_model=32, n_layers=1, n_heads=2, d_ff=64)
    torch.manual_seed(0)
    weights = torch.float32 if autocast else torch.bfloat16
    plain = Transformer(shape).to(torch.bfloat16).to(weights)  # bf16 values either way
    fused = Transformer(shape).to(weights)
    fused.load_state_dict(plain.state_dict())
    fuse_output_layer(fused, vocab)
    fp32 = Transformer(shape)
    fp32.load_state_dict(plain.state_dict())  # the same values, every op in fp32
    batch = [torch.randint(0, vocab, tokens), torch.randint(0, vocab, tokens)]
    batch[1][0, :10] = IGNORE_INDEX
    losses = {}
    for name, model, objective in (("plain", plain, NextToken()), ("fused", fused, NextToken(fused=True)),
                                   ("fp32", fp32, NextToken())):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast and model is not fp32):
            loss, _ = objective.loss_sum(model, batch)
        assert loss.dtype == torch.float32, name
        (loss / 3).backward()
        losses[name] = loss.item()
    assert losses["fused"] == pytest.approx(losses["plain"], rel=1e-6)  # measured: equal; torch's op (bf16 weights): 7.2e-6 off
    assert losses["fused"] == pytest.approx(losses["fp32"], rel=1e-5)  # the bf16 logits' rounding: 1.9e-6
    assert grad_factor(fused.lm_head.weight.grad, plain.lm_head.weight.grad) == pytest.approx(1, abs=1e-5)
    for (name, p), q, r in zip(plain.named_parameters(), fused.parameters(), fp32.parameters()):
        if p.dim() == 2:  # the matrices: a norm's or bias's few sums are bf16 noise (0.5 % between plain and fp32)
            assert grad_factor(q.grad, p.grad) == pytest.approx(1, abs=1e-3), name  # measured: <= 6e-4 off
            assert grad_factor(q.grad, r.grad) == pytest.approx(1, abs=1e-3), name  # measured: <= 6.6e-4 off



def output_weight_after_forward(env, cfg: dict) -> dict:
    """ZeRO-3, one micro-batch's forward with the fused loss: what autograd keeps of the output
    layer's gathered weight until backward (after DeepSpeed released it)."""
    from trainer.config import to_config
    from trainer.models.fused_loss import the_output_layer
    from trainer.strategies import build_strategy
    from trainer.training.setup import setup_model

    config = to_config(cfg)
    strategy = build_strategy(config, env)
    model, _, _, _ = setup_model(config, strategy)
    weight = the_output_layer(model, config.model.vocab_size).weight
    saved = []

    def pack(t):
        saved.append(t)
        return t

    ids = torch.randint(0, config.model.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = NextToken(fused=True).loss_sum(model, [ids, ids.roll(-1, 1)])
    whole = weight.ds_shape
    facts = {"saved_the_parameter": any(t is weight for t in saved),
             "kept_bytes": sum(t.untyped_storage().nbytes() for t in saved if t is weight or t.shape == whole),
             "gathered_now": weight.numel()}
    loss.backward()  # ZeRO-3 gathers it again for backward
    strategy.teardown()
    return facts


@pytest.mark.slow
def test_under_zero3_the_fused_loss_keeps_no_gathered_output_weight_until_backward(tmp_path):
    """The fused loss saves the output weight parameter itself, so DeepSpeed's release after the
    layer's forward frees the gathered weight (torch's op kept a detached alias: 64 KiB here, 1.1 GB
    bf16 for an 8B model). Every parameter is partitioned here (persistence threshold 0)."""
    ds_config = tmp_path / "ds.json"
    ds_config.write_text('{"zero_optimization": {"stage3_param_persistence_threshold": 0}}')
    cfg = with_overrides(case("zero3"), train__fused_loss=True, strategy__deepspeed_config=str(ds_config))
    for rank, facts in on_ranks(2, output_weight_after_forward, cfg).items():
        assert facts == {"saved_the_parameter": True, "kept_bytes": 0, "gathered_now": 0}, (rank, facts)


def test_a_model_whose_logits_are_not_its_output_layers_is_refused_before_any_rank_starts(tmp_path):
    error = refusal(tmp_path / "run", "train.fused_loss=true", "model=custom",
                    "model._target_=tests.test_fused_loss.scaled_logits", "strategy.wrap=[ToyBlock]")
    assert error.startswith("train.fused_loss: ") and "are not its output layer's output" in error, error


# ---- every strategy at 2 ranks, against the plain loss (slow: multi-process training runs) ----

STRATEGIES = ("ddp", "fsdp", "zero1", "zero2", "zero3")
VALIDATION = {"data__val_fraction": 0.1, "eval__every_steps": 3, "eval__max_batches": 2}


def builtin(strategy: str, fused: bool, **overrides) -> dict:
    """The built-in model (untied output layer), 6 steps, validated at steps 3 and 6."""
    return with_overrides(case(strategy, steps=6), train__fused_loss=fused, **VALIDATION, **overrides)


def qwen2(path, strategy: str, fused: bool, **overrides) -> dict:
    """A tiny Qwen2 with tied embeddings (the output layer's weight is the embedding's), from saved weights."""
    cfg = with_overrides(case(strategy, steps=6), train__fused_loss=fused, data__name="synthetic",
                         data__num_samples=256, optim__lr=1e-2, **overrides)
    cfg["model"] = {"name": "hf", "kind": "hf", "path": str(path), "seq_len": 32, "vocab_size": 512}
    return cfg


def custom(strategy: str, fused: bool) -> dict:
    """A custom model: its output layer is found as the last linear layer as wide as the vocabulary."""
    cfg = with_overrides(case(strategy, steps=6), train__fused_loss=fused, strategy__wrap=["ToyBlock"])
    cfg["model"] = {"name": "custom", "kind": "custom", "_target_": "examples.toy_model.build", "seq_len": 64}
    return cfg


def pairs(hf_path) -> dict[str, tuple[dict, dict]]:
    """name -> (the plain run, the fused run); each fused run is compared with its plain one."""
    found = {s: (builtin(s, False), builtin(s, True)) for s in STRATEGIES}
    found.update({f"qwen2_tied_{s}": (qwen2(hf_path, s, False), qwen2(hf_path, s, True)) for s in ("fsdp", "zero3")})
    found["qwen2_lora_zero3"] = tuple(qwen2(hf_path, "zero3", f, peft__name="lora", peft__r=4) for f in (False, True))
    found["sp2_zero3"] = tuple(builtin("zero3", f, strategy__sp=2) for f in (False, True))
    found["compile_ac_ddp"] = tuple(builtin("ddp", f, train__compile=True, train__activation_checkpointing=True)
                                    for f in (False, True))
    found["custom_ddp"] = (custom("ddp", False), custom("ddp", True))
    return found


def logits_bytes(name: str) -> int:
    """A rank's [tokens, vocab] fp32 log-probabilities of a micro-batch in the run `name` (4 rows),
    less what the fused layer keeps in their place: the tokens' fp32 log-sum-exps [tokens]."""
    tokens = 4 * (32 if name.startswith(("qwen2", "sp2")) else 64)  # qwen2: seq_len 32; sp=2: 64 / 2 a rank
    return tokens * ((512 if name.startswith("qwen2") else 256) - 1) * 4


def packed_chat(root: Path, strategy: str, fused: bool, **overrides) -> dict:
    """Packed conversations (rows of several, position ids restarting), 2 micro-batches accumulated."""
    from trainer.demo import VOCAB, conversations, documents, train_chat_tokenizer, write_rows

    if not (root / "chat.jsonl").exists():
        texts = documents()
        train_chat_tokenizer(root / "tokenizer", texts)
        write_rows(root / "chat.jsonl", conversations(texts, n=60))
    return with_overrides(case(strategy, steps=6), model__vocab_size=VOCAB, model__seq_len=256, data__name="chat",
                          data__path=str(root / "chat.jsonl"), data__tokenizer=str(root / "tokenizer"),
                          data__cache_dir=str(root / "cache"), train__micro_batch_size=2, train__grad_accum_steps=2,
                          train__fused_loss=fused, **overrides)


@pytest.fixture(scope="module")
def runs(hf_assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("fused")
    cases = {}
    for name, (plain, fused) in pairs(hf_assets.pretrained["qwen2"]).items():
        cases[f"{name}_plain"], cases[f"{name}_fused"] = plain, fused
    # the fused loss x packed rows x accumulation x a resume on another strategy (in turn: saved first)
    chat, ckpt = out / "chat", out / "ckpt"
    chat.mkdir()
    cases["packed_accum_plain"] = packed_chat(chat, "zero3", False)
    cases["packed_accum_fused"] = saving(packed_chat(chat, "zero3", True), ckpt, 3)
    cases["packed_accum_fused_resumed"] = resuming(packed_chat(chat, "fsdp", True), ckpt, 3)
    on_ranks(2, train_cases, cases, str(out))
    return {name: records(out / name) for name in cases}


@pytest.mark.slow
def test_packed_accumulated_fused_runs_give_the_plain_losses_and_resume_on_another_strategy(runs):
    plain, fused = runs["packed_accum_plain"], runs["packed_accum_fused"]
    assert len(fused) == 6 and plain[-1]["loss"] < plain[0]["loss"], plain
    assert_close(losses(fused), losses(plain), "packed, accumulated", FUSED_RTOL)
    assert [r["input_tokens"] for r in fused] == [r["input_tokens"] for r in plain]
    assert_resumes(runs["packed_accum_fused_resumed"], fused, at=3, what="zero3 -> fsdp", rtol=LOSS_RTOL)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ddp", "fsdp", "zero1", "zero2", "zero3", "qwen2_tied_fsdp", "qwen2_tied_zero3",
                                  "qwen2_lora_zero3", "sp2_zero3", "compile_ac_ddp", "custom_ddp"])
def test_the_fused_loss_gives_the_plain_losses(runs, name):
    plain, fused = runs[f"{name}_plain"], runs[f"{name}_fused"]
    steps, fused_steps = ([r for r in rows if "split" not in r] for rows in (plain, fused))
    assert len(steps) == 6, name
    assert_close([r["loss"] for r in fused_steps], [r["loss"] for r in steps], name, FUSED_RTOL)
    assert_close([r["grad_norm"] for r in fused_steps], [r["grad_norm"] for r in steps], name, 1e-5)
    validation = [r["loss"] for r in plain if r.get("split") == "val"]
    assert len(validation) == (2 if not name.startswith(("qwen2", "custom")) else 0), name
    if validation:  # validation takes the same path
        assert_close([r["loss"] for r in fused if r.get("split") == "val"], validation, f"{name} val", FUSED_RTOL)
    # the fused runs really ran without the logits: their forward saved less for backward, by at least
    # the plain loss's [tokens, vocab] fp32 log-probabilities (outside the blocks: AC keeps them too)
    saved = [(p["mem"]["activations"], f["mem"]["activations"]) for p, f in zip(steps, fused_steps)]
    assert all(p - f >= logits_bytes(name) for p, f in saved), (name, saved, logits_bytes(name))


@pytest.mark.slow
def test_an_output_layer_with_lora_or_a_scale_after_it_is_refused(hf_assets, tmp_path):
    path = hf_assets.pretrained["qwen2"]
    error = refusal(tmp_path / "run", "train.fused_loss=true", "model=hf", f"model.path={path}", "peft=lora",
                    "peft.target_modules=[lm_head,q_proj]")
    assert error.startswith("train.fused_loss: ") and "peft.target_modules" in error, error
    # the built-in model's output layer, found by its width: peft's layer, not the base_layer inside it (once
    # fused, whose tokens' losses LoRA's logits were added to: a traceback in the first forward)
    error = refusal(tmp_path / "run", "train.fused_loss=true", "peft=lora", "peft.target_modules=[qkv,lm_head]")
    assert error.startswith("train.fused_loss: ") and "peft.target_modules" in error, error
    from transformers import AutoConfig

    cohere = tmp_path / "cohere"
    AutoConfig.for_model("cohere", vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, logit_scale=0.5).save_pretrained(str(cohere))
    error = refusal(tmp_path / "run", "train.fused_loss=true", "model=hf", f"model.path={cohere}")
    assert "CohereForCausalLM's logits are not its output layer's output unchanged" in error, error


def test_the_planner_counts_the_fused_loss_only_where_the_run_takes_it():
    """python -m trainer.plan's longest seq_len per fused loss, and strategy=auto's trial of it: only for an
    output layer the fused loss takes (not one with LoRA on it, which a run refuses; the plan failed on it)."""
    from trainer.config import to_config
    from trainer.models.checks import fusable
    from trainer.plan import make_plan

    def lora(targets: list[str]):
        return to_config({"peft": {"name": "lora", "r": 4, "target_modules": targets}})

    assert fusable(lora(["qkv", "proj"])) and not fusable(lora(["qkv", "lm_head"]))
    # (tests/test_activations.py: the rows with the fused loss where it is taken)
    plan = make_plan(lora(["qkv", "lm_head"]), 2, gpu_memory_bytes=80 * 2**30)
    assert {fused for _, fused, _, _ in plan.long_context} == {False}, plan.long_context


def test_the_start_line_says_when_the_fused_loss_is_on():
    from types import SimpleNamespace

    from trainer.config import to_config
    from trainer.training.report import describe

    strategy = SimpleNamespace(layout=SimpleNamespace(dp_size=1), start_settings=lambda: {"offload": "none"})
    env, facts = SimpleNamespace(world_size=1, device="cpu"), SimpleNamespace(params=1, active=1)
    lines = {fused: describe(to_config({"train": {"fused_loss": fused}}), env, strategy, 8, facts) for fused in (False, True)}
    assert "fused_loss=on" in lines[True].split() and "fused_loss" not in lines[False], lines
