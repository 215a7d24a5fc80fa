"""The speed a run reports: `tokens_per_s` is of the input tokens a step processed (padding left out,
the compiling step's left out of the first rate after it), and `mfu` is of the FLOPs the model
really does per token, as torch's FLOP counter counts them (LoRA's frozen base without its weight
gradients), over the peak of the precision that runs (none where no peak is known: a CPU, fp32)."""
from __future__ import annotations

import pytest
import torch

from tests.harness import case, on_ranks, records, run_cli, train_cases, with_overrides
from trainer.config import to_config


def counted_training_flops_per_token(overrides: dict | None = None) -> float:
    """The matmul FLOPs per token in one forward and backward of the model of `overrides` (default:
    the default model; with LoRA's adapters where they ask for them), counted by torch's
    FlopCounterMode as they run (attention through SDPA's math kernel, which the counter sees as
    bmm), not from a formula: the count the trainer's mfu must agree with."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from trainer.models import build_model, logits_of

    cfg = to_config(overrides or {})
    model = build_model(cfg.model, torch.device("cpu"), cfg.peft)
    x = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        logits_of(model(x)).float().sum().backward()
    return counter.get_total_flops() / x.numel()


# The trainer counts 6 FLOPs per token for every parameter that is not a lookup table, biases and
# norm weights included, whose elementwise work the counter above leaves out (matmuls only): for
# the tiny model 6 x 1,792 of 797,184 FLOPs per token, 1.3 % more than counted. Forward-only
# FLOPs (a third), attention left out (-12 %) or the embeddings counted (+17 %) are all outside 2 %.
MFU_FLOPS_RTOL = 0.02


@pytest.mark.slow  # make test stays under 8 minutes: the rest of what it covers is in the quick suite
def test_mfu_follows_the_flops_and_the_peak(tmp_path):
    result = run_cli("nproc=2", "train.max_steps=4", "train.log_every=2", "train.peak_flops=1e12",
                     f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    flops = counted_training_flops_per_token()
    for row in records(tmp_path):
        assert row["mfu"] == pytest.approx(row["tokens_per_s"] * flops / (1e12 * 2), rel=MFU_FLOPS_RTOL)
        assert row["mem"]["peak"] is None  # the CPU reports no peak allocation
    plain = run_cli("train.max_steps=2", "train.log_every=1", f"hydra.run.dir={tmp_path}/2")
    assert plain.returncode == 0
    assert [r["mfu"] for r in records(tmp_path / "2")] == [None, None]  # no known peak on a CPU


# LoRA: the frozen base's matmuls take 4 FLOPs per parameter (no weight gradient), the adapters 6.
# The counter finds 5.5 % fewer on the 2-layer model: the first block's base matmuls read the frozen
# embedding's output, whose gradient nobody needs (2 FLOPs, not 4), and the norms (1.3 %, as above).
# The 6N count of full training is 1.39 x.
LORA_FLOPS_RTOL = 0.06


LORA = {"name": "lora", "r": 4, "alpha": 8.0}


@pytest.mark.slow  # make test stays under 8 minutes: the rest of what it covers is in the quick suite
def test_lora_mfu_leaves_out_the_frozen_bases_weight_gradients(tmp_path):
    counted = counted_training_flops_per_token({"peft": LORA})
    assert counted < 0.8 * counted_training_flops_per_token()
    cfg = case("ddp", steps=2, train__peak_flops=1e12)
    cfg["peft"] = dict(LORA)
    on_ranks(1, train_cases, {"lora": cfg}, str(tmp_path))
    for row in records(tmp_path / "lora"):
        assert row["mfu"] == pytest.approx(row["tokens_per_s"] * counted / 1e12, rel=LORA_FLOPS_RTOL)


@pytest.mark.slow
def test_the_rate_and_mfu_are_of_the_tokens_processed_and_tokens_of_the_targets(tmp_path):
    """Chat SFT, one padded row per conversation, the assistant's tokens the targets: `tokens` counts
    those, `input_tokens` each row up to its last target (its padding left out), and the rate and mfu
    are of the input tokens. The same conversation in every row, so each step's counts are known."""
    from transformers import AutoTokenizer

    from trainer.config import TrainOn
    from trainer.data.chat import Conversations
    from trainer.demo import VOCAB, conversations, documents, train_chat_tokenizer, write_rows

    texts = documents()
    row = conversations(texts, n=1)[0]
    tokenizer = train_chat_tokenizer(tmp_path / "tokenizer", texts)
    ((ids, targets),) = Conversations(TrainOn.assistant, None).encode(
        AutoTokenizer.from_pretrained(str(tokenizer)), {k: [v] for k, v in row.items()}, 0)
    model = {"model": {"vocab_size": VOCAB, "seq_len": 256}}
    assert len(ids) - 1 <= 256  # one whole conversation per row
    last_target = max(i for i, t in enumerate(targets) if t)  # inputs 0 .. last_target - 1 predict targets
    per_row = {"tokens": sum(targets[1:]), "input_tokens": last_target}
    assert per_row["tokens"] < 0.8 * per_row["input_tokens"] < 0.8 * 256  # context and padding count apart
    cfg = with_overrides(case("ddp", steps=3, train__peak_flops=1e12, data__name="chat", data__packing=False,
                              data__path=str(write_rows(tmp_path / "chat.jsonl", [row] * 24)),
                              data__tokenizer=str(tokenizer), data__cache_dir=str(tmp_path / "cache")),
                         model__vocab_size=VOCAB, model__seq_len=256)
    on_ranks(1, train_cases, {"chat": cfg}, str(tmp_path))
    flops = counted_training_flops_per_token(model)
    rows = records(tmp_path / "chat")
    micro_batch = cfg["train"]["micro_batch_size"]
    for count, n in per_row.items():
        assert [r[count] for r in rows] == [step * micro_batch * n for step in (1, 2, 3)], count
    for r in rows:
        assert r["tokens_per_s"] == pytest.approx(micro_batch * per_row["input_tokens"] / r["step_time_s"], rel=1e-9)
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * flops / 1e12, rel=MFU_FLOPS_RTOL)


def test_the_compiling_steps_tokens_are_left_out_of_the_first_rate_after_it():
    from trainer.training.steps import StepMeter

    meter = StepMeter(torch.device("cpu"), flops_per_token=6, peak_flops=1e3, world_size=2, tokens=7, input_tokens=9)
    meter.count(torch.tensor(5), torch.tensor(100))  # the first step, which compiles
    meter.restart()  # Run.compiled
    meter.count(torch.tensor(5), torch.tensor(100))
    assert meter.totals() == {"tokens": 17, "input_tokens": 209}
    row = meter.read()
    assert (row["tokens"], row["input_tokens"]) == (17, 209)
    assert row["tokens_per_s"] * row["step_time_s"] == pytest.approx(100)  # one step's inputs in one step's time
    assert row["mfu"] == pytest.approx(row["tokens_per_s"] * 6 / 2e3)


def test_mfu_divides_by_the_peak_of_the_precision_that_runs(monkeypatch):
    from trainer.distributed import PEAK_BF16_FLOPS, peak_flops

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    gpu = torch.device("cuda", 0)
    assert peak_flops(gpu, "bf16") == peak_flops(gpu, "fp16") == PEAK_BF16_FLOPS["H200"]
    assert peak_flops(gpu, "fp32") is None  # TF32 or not is a setting: no mfu rather than a wrong one
    assert peak_flops(torch.device("cpu"), "bf16") is None
