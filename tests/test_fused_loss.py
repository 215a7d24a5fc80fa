"""Issue 30, train.fused_loss=true: the output layer gives each token's loss, in chunks, without the
[tokens, vocab] logits; the same losses as the plain loss on every strategy (the output weight the
backend gathered, a tied one too), with LoRA, sequence parallelism, compile and validation; what
cannot be fused is refused before any rank starts."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from examples.toy_model import ToyLM
from tests.harness import assert_close, case, on_ranks, records, refusal, train_cases, with_overrides
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


@pytest.mark.parametrize("overrides, fragment", [
    (["objective=dpo", "data=preference", "data.path=pairs.jsonl"], "objective=dpo takes each token's log-probability"),
    (["model=custom", "model._target_=tests.test_fused_loss.scaled_logits", "strategy.wrap=[ToyBlock]"],
     "are not its output layer's output"),
])
def test_what_cannot_be_fused_is_refused_before_any_rank_starts(tmp_path, overrides, fragment):
    error = refusal(tmp_path / "run", "train.fused_loss=true", *overrides)
    assert error.startswith("train.fused_loss: ") and fragment in error, error


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
    """A rank's [tokens, vocab] fp32 log-probabilities of a micro-batch in the run `name` (4 rows)."""
    tokens = 4 * (32 if name.startswith(("qwen2", "sp2")) else 64)  # qwen2: seq_len 32; sp=2: 64 / 2 a rank
    return tokens * (512 if name.startswith("qwen2") else 256) * 4


@pytest.fixture(scope="module")
def runs(hf_assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("fused")
    cases = {}
    for name, (plain, fused) in pairs(hf_assets.pretrained["qwen2"]).items():
        cases[f"{name}_plain"], cases[f"{name}_fused"] = plain, fused
    on_ranks(2, train_cases, cases, str(out))
    return {name: records(out / name) for name in cases}


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
    from transformers import AutoConfig

    cohere = tmp_path / "cohere"
    AutoConfig.for_model("cohere", vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, logit_scale=0.5).save_pretrained(str(cohere))
    error = refusal(tmp_path / "run", "train.fused_loss=true", "model=hf", f"model.path={cohere}")
    assert "CohereForCausalLM's logits are not its output layer's output unchanged" in error, error
