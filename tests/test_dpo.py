"""Preference training (objective=dpo, data=preference). Pairs are tokenised as TRL's
DPOTrainer does; a pair's two sequences share a packed row and give the log-probabilities they
give alone; the loss and rewards are TRL's, normalised over the pairs of the whole step."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.harness import case, refusal, with_overrides
from tests.toys import Toy
from trainer.data.preference import PairRows, PreferencePairs
from trainer.data.sources import IGNORE_INDEX, Tokens
from trainer.demo import (
    VOCAB,
    documents,
    make_model_dir,
    preference_pairs,
    train_chat_tokenizer,
    write_rows,
)

SEQ = 128


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """A chat tokenizer, a Qwen2 folder with weights, and 24 pairs as messages and as strings."""
    from types import SimpleNamespace

    root = tmp_path_factory.mktemp("dpo")
    texts = documents()
    return SimpleNamespace(
        root=root, cache=root / "cache", tokenizer=train_chat_tokenizer(root / "tokenizer", texts),
        qwen2=make_model_dir(root / "qwen2", "qwen2", weights=True),
        data=write_rows(root / "pairs.jsonl", preference_pairs(texts, 24)),
        plain=write_rows(root / "plain.jsonl", preference_pairs(texts, 24, conversational=False)))


def tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def target_text(tok, document) -> tuple[str, str]:
    """(the text before the targets, the targets' text) of an encoded sequence."""
    ids, targets = document
    first = targets.index(1)
    assert all(targets[first:]), "the targets run from the response's first token to the end"
    return tok.decode(ids[:first]), tok.decode(ids[first:])


def test_a_pair_is_tokenised_as_trl_does(pairs):
    """Messages: the prompt as the template renders it with the generation prompt; the response's
    content, its end-of-turn token and what the template puts after it are the targets. Strings:
    prompt, then response + EOS as targets."""
    tok = tokenizer(pairs.tokenizer)
    row = json.loads(pairs.data.read_text().splitlines()[1])
    chosen, rejected = PreferencePairs(None).pair(tok, row, 0)
    prompt = tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
    for document, response in ((chosen, row["chosen"]), (rejected, row["rejected"])):
        before, targets = target_text(tok, document)
        assert before == prompt
        assert targets == response[0]["content"] + "<|im_end|>\n"
    row = json.loads(pairs.plain.read_text().splitlines()[1])
    for document, response in zip(PreferencePairs(None).pair(tok, row, 0), (row["chosen"], row["rejected"])):
        before, targets = target_text(tok, document)
        assert (before, targets) == (row["prompt"], response + "<|im_end|>")


def pair_tokens(lengths: list[tuple[int, int, int]]) -> Tokens:
    """Pairs of (prompt, chosen, rejected) lengths as two documents each, token ids counting up."""
    import numpy as np

    ids, starts, targets = [], [], []
    for prompt, *responses in lengths:
        for n in responses:
            starts.append(len(ids))
            ids += [(len(ids) + k) % 50 + 1 for k in range(prompt + n)]
            targets += [0] * prompt + [1] * n
    return Tokens(np.asarray(ids, np.uint16), np.asarray(starts), np.asarray(targets, np.uint8))


def test_long_pairs_are_truncated_and_counted_or_dropped_and_empty_ones_left_out():
    tokens = pair_tokens([(4, 6, 5), (4, 20, 3), (12, 3, 3), (3, 2, 2)])  # seq_len 10: rows of 11 tokens
    rows = PairRows(tokens, 10, 64, pad_id=0)
    assert (rows.long, rows.untargeted, list(rows.pairs)) == (2, 1, [0, 1, 3])  # pair 2: its prompt fills the row
    x, y, positions, sequence = rows[1]  # pair 1 alone: chosen cut to 10 inputs, then rejected's 6
    assert (sequence[:10] == 2).all() and (sequence[10:16] == 3).all() and (sequence[16:] == -1).all()
    assert positions[:16].tolist() == list(range(10)) + list(range(6))
    assert (y[:3] == IGNORE_INDEX).all() and (y[3:10] != IGNORE_INDEX).all()  # prompt of 4: its last predicts
    dropped = PairRows(tokens, 10, 64, pad_id=0, drop_long=True)
    assert list(dropped.pairs) == [0, 3] and dropped.long == 2


def test_packed_pairs_give_each_sequence_the_log_probability_it_has_alone(pairs, tmp_path):
    """Pairs packed several to a row (position ids restarting) against each sequence run alone,
    padded, without position ids: the same summed log-probabilities, the same pair numbers."""
    from transformers import AutoModelForCausalLM

    from trainer.config import DataName, to_config
    from trainer.data import load_data
    from trainer.losses.objectives import sequence_logps

    eight = write_rows(tmp_path / "eight.jsonl", preference_pairs(documents(), 8))
    cfg = to_config(with_overrides(case("ddp"), data__name=DataName.preference.value, data__path=str(eight),
                                   data__tokenizer=str(pairs.tokenizer), data__cache_dir=str(pairs.cache),
                                   model__vocab_size=VOCAB, model__seq_len=SEQ))
    packed, _ = load_data(cfg, 0)
    padded, _ = load_data(to_config({**with_overrides(case("ddp"), data__name="preference", data__path=str(eight),
                                                      data__tokenizer=str(pairs.tokenizer),
                                                      data__cache_dir=str(pairs.cache), data__packing=False),
                                     "model": {"vocab_size": VOCAB, "seq_len": SEQ}}), 0)
    assert len(packed) < len(padded) == len(padded.pairs) == 8
    # no cache: with one, transformers does not see the packed rows' documents in their position ids
    model = AutoModelForCausalLM.from_pretrained(str(pairs.qwen2), use_cache=False).eval()
    with torch.no_grad():
        together = {}
        for i in range(len(packed)):
            x, y, positions, sequence = (t.unsqueeze(0) for t in packed[i])
            logps, _, numbers, _ = sequence_logps(model, (x, y, positions, sequence), fused=False)
            together.update(zip(numbers.tolist(), logps.tolist()))
        alone = {}
        for i in range(len(padded)):
            x, y, _, sequence = padded[i]
            for number in sequence[sequence >= 0].unique():
                at = sequence == number
                alone_batch = (x[at], y[at], torch.arange(int(at.sum())), sequence[at])  # positions from 0
                logps, _, numbers, _ = sequence_logps(model, [t.unsqueeze(0) for t in alone_batch], fused=False)
                alone[int(numbers)] = float(logps)
    assert sorted(together) == sorted(alone) == list(range(2 * len(padded)))
    for number, value in alone.items():
        assert math.isclose(together[number], value, rel_tol=1e-5), (number, together[number], value)


def dpo_case(pairs, strategy: str, steps: int = 4, peft: dict | None = None, **overrides) -> dict:
    """The Qwen2 folder on the pairs, fp32, a high rate (the policy moves at once), every step logged."""
    cfg = with_overrides(case(strategy, steps=steps), **{
        "data__name": "preference", "data__path": str(pairs.data), "data__tokenizer": str(pairs.tokenizer),
        "data__cache_dir": str(pairs.cache), "objective__name": "dpo", "optim__lr": 1e-2, "optim__warmup_steps": 0,
        "train__micro_batch_size": 4, **overrides})
    cfg["model"] = {"name": "hf", "kind": "hf", "path": str(pairs.qwen2), "seq_len": SEQ, "vocab_size": VOCAB}
    if peft:
        cfg["peft"] = peft
    return cfg


STRATEGIES = ("ddp", "fsdp", "zero1", "zero2", "zero3")
LORA = {"name": "lora", "r": 4, "alpha": 8.0}
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")
# 0 at step 1, where the policy is its reference: not the accuracy, the share of pairs whose chosen
# reward is above the rejected one, where one pair's log-prob one ulp off counts (seen: 0.1 here)
REWARDS_AT_START = ("rewards/chosen", "rewards/rejected", "rewards/margins")
# fp32 at 2 ranks against 1 with the same global batch (the bound)
DPO_RTOL = 1e-6
TRL_REWARD_ATOL = 2e-6
REWARD_ATOL = 1e-5  # beta x the fp32 resolution of a log-prob summed over ~100 tokens


# LoRA against the adapters switched off; LoRA and full fine-tuning against precomputed log-probs
KINDS = {"lora": {"peft": LORA}, "lora_pre": {"peft": LORA, "objective__precompute_ref": True},
         # full fine-tuning at a tenth of the rate: every weight moves, and ZeRO-3's other reduction order with it
         "full": {"objective__precompute_ref": True, "optim__lr": 1e-3}}


# full fine-tuning against the frozen copy of model.path (no precompute_ref), at the same rate; LoRA
# continuing from a starting adapter (peft.init, the folder `starting_adapter` writes), against it
COPY = {"copy": {"optim__lr": 1e-3}, "init": {}}


def kind_case(pairs, kind: str, strategy: str, world: int, steps: int = 3, **overrides) -> dict:
    """A quarter of the pairs held out; global batch 8 rows (2 accumulated micro-batches)."""
    spec = dict({**KINDS, **COPY}[kind])
    if kind == "init":
        spec["peft"] = {"name": "lora", "init": str(starting_adapter(pairs))}
    return dpo_case(pairs, strategy, steps=steps, peft=spec.pop("peft", None), train__micro_batch_size=4 // world,
                    train__grad_accum_steps=2, data__val_fraction=0.25, **spec, **overrides)


def parity_cases(pairs) -> dict[int, dict]:
    """Every kind at 1 rank (ddp); LoRA and full on every strategy at 2 ranks, LoRA with
    precomputed log-probs on ddp and zero3."""
    two = {f"{k}:{s}@2": kind_case(pairs, k, s, 2) for k in ("lora", "full") for s in STRATEGIES}
    two.update({f"lora_pre:{s}@2": kind_case(pairs, "lora_pre", s, 2) for s in ("ddp", "zero3")})
    return {1: {f"{k}@1": kind_case(pairs, k, "ddp", 1) for k in KINDS}, 2: two}


@pytest.fixture(scope="module")
def parity(dpo_runs):
    return dpo_runs / "parity"


@pytest.mark.slow
def test_dpo_starts_at_ln2_and_two_ranks_equal_one_on_every_strategy(parity):
    from tests.harness import records

    for kind in ("lora", "lora_pre", "full"):
        one = records(parity / f"{kind}@1")
        steps = [r for r in one if "split" not in r]
        assert len(steps) == 3 and abs(steps[-1]["loss"] - math.log(2)) > 1e-4, f"{kind}: the policy must move"
        for run in sorted(parity.glob(f"{kind}*")):
            rows = records(run)
            first = rows[0]
            assert abs(first["loss"] - math.log(2)) < 1e-6, (run.name, first["loss"])
            assert all(abs(first[k]) < 1e-6 for k in REWARDS_AT_START), (run.name, first)
            assert [r.get("split") for r in rows] == [r.get("split") for r in one], run.name
            for mine, base in zip(rows, one):  # steps and the validation line: loss and rewards
                assert math.isclose(mine["loss"], base["loss"], rel_tol=DPO_RTOL), (run.name, mine, base)
                for key in REWARDS:  # beta x differences of summed log-probs: fp32 leaves ~1e-6
                    assert math.isclose(mine[key], base[key], abs_tol=REWARD_ATOL), \
                        (run.name, mine["step"], key, mine[key], base[key])


# (kind, first strategy and world size, then strategy and world size, the token cache of the resume)
# (kind, (strategy, ranks, strategy.sp) saving, (strategy, ranks) resuming, the log-prob cache)
RESUMES = [("lora", ("zero3", 2, 1), ("ddp", 1), "same"), ("full", ("fsdp", 2, 1), ("zero2", 1), "same"),
           ("full", ("zero3", 2, 1), ("fsdp", 1), "fresh"), ("copy", ("zero3", 2, 1), ("ddp", 1), "same"),
           ("init", ("zero2", 2, 1), ("fsdp", 1), "same"), ("init", ("zero3", 2, 2), ("ddp", 1), "same")]


def resume_cases(pairs, out) -> dict[int, dict]:
    """Each of RESUMES trained 4 steps, checkpointed at 2 (into `out`), and resumed from there."""
    from tests.harness import resuming, saving

    runs = {1: {}, 2: {}}
    for i, (kind, (s1, w1, sp), (s2, w2), cache) in enumerate(RESUMES):
        ckpt = out / f"ckpt{i}"
        runs[w1][f"straight{i}"] = saving(kind_case(pairs, kind, s1, w1 // sp, steps=4, strategy__sp=sp), ckpt, 2)
        fresh = {"data__cache_dir": str(out / f"fresh_cache{i}")} if cache == "fresh" else {}
        runs[w2][f"resumed{i}"] = resuming(kind_case(pairs, kind, s2, w2, steps=4, **fresh), ckpt, 2)
    assert all(w1 == 2 and w2 == 1 for _, (_, w1, _), (_, w2), _ in RESUMES), "saved by the 2-rank launch, which runs first"
    return runs


@pytest.fixture(scope="module")
def resumed_runs(dpo_runs):
    return dpo_runs / "resumes"


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(RESUMES)), ids=["-".join(map(str, [k, *f, *t, c])) for k, f, t, c in RESUMES])
def test_dpo_resumes_under_another_strategy_and_world_size(resumed_runs, i):
    """The reference is rebuilt (adapters off; the frozen copy from model.path, not from the
    checkpoint's trained weights; the starting adapter from peft.init's folder), read back (precomputed, in the cache), or computed again without
    the cache, on the starting weights: the uninterrupted run's losses. Also saved at sp=2 (2 ranks, one
    data-parallel rank), resumed at sp=1."""
    from tests.harness import assert_resumes, records

    assert_resumes(records(resumed_runs / f"resumed{i}"), records(resumed_runs / f"straight{i}"), 2, RESUMES[i][0],
                   rtol=DPO_RTOL)


BAD = {
    "dpo on text": (["objective=dpo"], ["objective", "data=preference"]),
    "pairs for lm": (["data=preference", "data.path={root}/pairs.jsonl"], ["data", "objective=dpo"]),
    "no chosen": (["objective=dpo", "objective.precompute_ref=true", "data=preference",
                   "data.path={root}/no_chosen.jsonl"],
                  ["data.path", "`chosen`", "prompt, chosen, rejected"]),
    "beta": (["objective=dpo", "objective.beta=0", "data=preference", "data.path={root}/pairs.jsonl",
              "objective.precompute_ref=true"], ["objective.beta", "> 0"]),
    "loss": (["objective=dpo", "objective.loss=hinge"], ["objective.loss", "sigmoid", "ipo"]),
}


def frozen_copy_cases(pairs) -> dict[int, dict]:
    """Full fine-tuning against the frozen copy (no precompute_ref), at 1 rank (ddp) and on every
    strategy at 2, beside the precomputed-reference run of the same settings at 1 rank."""
    copy = {"optim__lr": 1e-3}
    return {1: {"copy@1": dpo_case_of(pairs, "ddp", 1, **copy), "precomputed@1": kind_case(pairs, "full", "ddp", 1)},
            2: {f"copy:{s}@2": dpo_case_of(pairs, s, 2, **copy) for s in STRATEGIES}}


@pytest.fixture(scope="module")
def frozen_copy_runs(dpo_runs):
    return dpo_runs / "frozen_copy"


def dpo_case_of(pairs, strategy: str, world: int, **overrides) -> dict:
    """kind_case's settings (global batch 8, a quarter held out, 3 steps), without a peft or a reference choice."""
    return dpo_case(pairs, strategy, steps=3, train__micro_batch_size=4 // world, train__grad_accum_steps=2,
                    data__val_fraction=0.25, **overrides)


@pytest.mark.slow
def test_full_fine_tuning_against_the_frozen_copy_gives_the_precomputed_runs_losses(frozen_copy_runs):
    """ln 2 at step 1 with rewards 0, 2 ranks = 1 rank on every strategy, and the precomputed
    reference's losses and rewards (the same starting model, held instead of tabled)."""
    from tests.harness import records

    base = records(frozen_copy_runs / "precomputed@1")
    steps = [r for r in base if "split" not in r]
    assert len(steps) == 3 and abs(steps[-1]["loss"] - math.log(2)) > 1e-4, "the policy must move"
    runs = sorted(frozen_copy_runs.glob("copy*"))
    assert len(runs) == 1 + len(STRATEGIES)
    # mem.params, measured: ddp's fp32 copy holds as many bytes as the policy (replicated, fp32)
    held = {run: records(frozen_copy_runs / run)[0]["mem"]["params"] for run in ("copy@1", "copy:ddp@2")}
    assert held == dict.fromkeys(held, 2 * base[0]["mem"]["params"]), (held, base[0]["mem"])
    for run in runs:
        rows = records(run)
        assert abs(rows[0]["loss"] - math.log(2)) < 1e-6 and all(abs(rows[0][k]) < 1e-6 for k in REWARDS_AT_START), \
            (run.name, rows[0])
        assert [r.get("split") for r in rows] == [r.get("split") for r in base], run.name
        for mine, theirs, one in zip(rows, base, records(frozen_copy_runs / "copy@1")):
            for other in (theirs, one):  # the precomputed run; the copy at 1 rank
                assert math.isclose(mine["loss"], other["loss"], rel_tol=DPO_RTOL), (run.name, mine, other)
                for key in REWARDS if mine["step"] > 1 else REWARDS_AT_START:
                    assert math.isclose(mine[key], other[key], abs_tol=REWARD_ATOL), (run.name, key, mine, other)


@pytest.mark.parametrize("name", list(BAD))
def test_bad_dpo_settings_are_refused_in_one_line(pairs, tmp_path, name):
    write_rows(tmp_path / "no_chosen.jsonl", [{"prompt": "a", "rejected": "b"}])
    write_rows(tmp_path / "pairs.jsonl", preference_pairs(documents()[:40], 4))
    overrides, fragments = BAD[name]
    args = [o.format(root=tmp_path) for o in overrides]
    args += ["model=hf", f"model.path={pairs.qwen2}", f"data.tokenizer={pairs.tokenizer}",
             f"data.cache_dir={pairs.cache}"]
    message = refusal(tmp_path, *args)
    for fragment in fragments:
        assert fragment in message, message


def trl_records(pairs, rows_file, out, steps: int, lr: float, loss: str) -> list[dict]:
    """TRL 1.16's DPOTrainer on the same model and pairs: full fine-tuning, AdamW, constant lr,
    every pair in every step (the batch is the data set, so its order does not matter)."""
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    torch.manual_seed(0)
    dataset = load_dataset("json", data_files=str(rows_file), split="train", cache_dir=str(out / "hf"))
    args = DPOConfig(output_dir=str(out), per_device_train_batch_size=len(dataset), max_steps=steps, learning_rate=lr,
                     lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999,
                     adam_epsilon=1e-8, max_grad_norm=1.0, logging_steps=1, beta=0.1, loss_type=[loss],
                     max_length=SEQ + 1,
                     use_cpu=True, bf16=False, fp16=False, report_to=[], save_strategy="no", disable_tqdm=True,
                     dataset_num_proc=None, seed=0)
    trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(str(pairs.qwen2)), args=args,
                         train_dataset=dataset, processing_class=AutoTokenizer.from_pretrained(str(pairs.tokenizer)))
    trainer.train()
    return [r for r in trainer.state.log_history if "loss" in r]


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["sigmoid", "ipo"])
def test_dpo_agrees_with_trl_on_the_first_three_steps(pairs, tmp_path, loss):
    """Loss and rewards of steps 1-3 within 1e-5 relative of TRL's (full fine-tuning: here against
    precomputed log-probs, TRL against its reference copy; the same numbers while both are the start)."""
    from tests.harness import on_ranks, records, train_cases

    rows = write_rows(tmp_path / "eight.jsonl", preference_pairs(documents(), 8))
    lr = 1e-3
    cfg = dpo_case(pairs, "ddp", steps=3, data__path=str(rows), data__packing=False, train__micro_batch_size=8,
                   objective__precompute_ref=True, optim__lr=lr, optim__schedule="constant", optim__weight_decay=0.0,
                   optim__betas=[0.9, 0.999], optim__eps=1e-8, train__grad_clip=1.0, objective__loss=loss)
    on_ranks(1, train_cases, {"ours": cfg}, str(tmp_path))
    ours = records(tmp_path / "ours")
    theirs = trl_records(pairs, rows, tmp_path / "trl", 3, lr, loss)
    assert len(ours) == len(theirs) == 3
    assert theirs[-1]["rewards/margins"] > 1e-3, "the policy must move for the comparison to mean anything"
    # Rewards are beta x differences of log-probs summed over ~60 tokens in fp32, which packed rows
    # and TRL's padded batch compute in other shapes: they agree to ~6e-7 (1e-5 of their size).
    apart = [(step, key, mine[key], trl[key]) for step, (mine, trl) in enumerate(zip(ours, theirs), 1)
             for key, rtol, atol in (("loss", 1e-5, 0.0), *((k, 1e-5, TRL_REWARD_ATOL) for k in REWARDS))
             if not math.isclose(mine[key], trl[key], rel_tol=rtol, abs_tol=atol)]
    assert not apart, apart


class DroppingLM(Toy):
    """The toy model with dropout at 0.5 on its embeddings, taking the position ids a forward passes."""

    def forward(self, ids, position_ids=None):
        return super().forward(ids)


def dropping_lm(vocab: int = 64) -> DroppingLM:
    return DroppingLM(vocab, 16, 2, 0.5, False, False, "SIGTERM", 0, False)


def frozen_reference_facts(env) -> dict:
    """Full fine-tuning's frozen reference on one rank: its log-probs on two calls, the policy's in
    eval mode and in train mode, whether any of its parameters trains or is in the optimizer."""
    from trainer.config import to_config
    from trainer.distributed import seed_everything
    from trainer.losses.objectives import Reference, sequence_logps
    from trainer.strategies import build_strategy
    from trainer.training.dpo_reference import frozen_copy
    from trainer.training.setup import setup_model

    model = {"name": "custom", "kind": "custom", "_target_": "tests.test_dpo.dropping_lm", "seq_len": 16,
             "vocab_size": 64}
    cfg = to_config({**with_overrides(case("ddp"), strategy__wrap=["ToyBlock"]), "model": model})
    seed_everything(0)
    strategy = build_strategy(cfg, env)
    policy, optimizer, _, _ = setup_model(cfg, strategy)
    frozen = frozen_copy(cfg, strategy)
    ids = torch.arange(32).view(2, 16)
    targets = ids.roll(-1, 1)
    batch = (ids, targets, torch.arange(16).repeat(2, 1), torch.tensor([0, 1]).repeat_interleave(16).view(2, 16))
    reference = Reference(frozen=frozen)
    numbers = torch.tensor([0, 1])
    policy.train()
    twice = [reference.logps(policy, batch, numbers) for _ in range(2)]
    with torch.no_grad():
        in_train = [sequence_logps(policy, batch, fused=False)[0] for _ in range(2)]
        policy.eval()
        in_eval = sequence_logps(policy, batch, fused=False)[0]
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    facts = {"twice": twice, "in_train": in_train, "in_eval": in_eval, "training": frozen.training,
             "trains": [n for n, p in frozen.named_parameters() if p.requires_grad],
             "in_optimizer": [n for n, p in frozen.named_parameters() if id(p) in optimized]}
    strategy.teardown()
    return facts


@pytest.mark.slow  # make test stays under 8 minutes: the rest of what it covers is in the quick suite
def test_the_frozen_reference_is_the_start_in_eval_mode_and_outside_the_optimizer():
    """A model with dropout: the reference's log-probs are the same on two calls, and are the
    starting policy's in eval mode (the policy's in train mode differ: the dropout is real)."""
    from tests.harness import on_ranks

    facts = on_ranks(1, frozen_reference_facts)[0]
    assert not torch.equal(*facts["in_train"]), "dropout must change the policy's train-mode log-probs"
    assert torch.equal(*facts["twice"]) and torch.equal(facts["twice"][0], facts["in_eval"]), facts
    assert facts["training"] is False and facts["trains"] == [] and facts["in_optimizer"] == []


def test_the_plan_counts_the_frozen_copy_and_rows_of_two_sequences():
    """objective=dpo: activations of rows 2 x seq_len wide; full fine-tuning without precompute_ref
    adds one model's parameters in the training dtype, sharded where the policy's are (fsdp, zero3);
    precomputed log-probs and LoRA's adapters-off reference add none."""
    from trainer.config import to_config
    from trainer.memory import DTYPE_BYTES
    from trainer.plan import activation_need, make_plan

    base = {"train": {"precision": "bf16", "micro_batch_size": 2}}
    dpo = {"objective": {"name": "dpo"}}
    world = 4

    def options(settings: dict) -> dict:
        plan = make_plan(to_config(settings), world, 10 ** 12)
        # parameters where they are held: on the device, or offloaded to the host (strategy.tp, which dpo does
        # not take, left out)
        return plan, {(o.name, o.activation_checkpointing, o.offload):
                      {**o.per_gpu_bytes, "params": o.per_gpu_bytes["params"] + o.host_bytes}
                      for o in plan.options if o.tp == 1}

    plan, lm = options(base)
    _, copy = options({**base, **dpo})
    _, precomputed = options({**base, "objective": {"name": "dpo", "precompute_ref": True}})
    _, lora = options({**base, **dpo, "peft": {"name": "lora"}})
    _, lora_lm = options({**base, "peft": {"name": "lora"}})
    cfg = to_config(base)
    reference = DTYPE_BYTES[cfg.train.precision] * plan.params  # bf16: 2 bytes a parameter
    for key, gpu in lm.items():
        name, checkpointing, offload = key
        sharded = name in ("fsdp", "zero3")
        held = 2 * reference if name == "ddp" else reference  # ddp's copy is fp32, as its policy (issue 43)
        assert copy[key]["params"] - precomputed[key]["params"] == held // (world if sharded else 1), key
        assert precomputed[key]["params"] == gpu["params"] and lora[key]["params"] == lora_lm[key]["params"], key
        two_rows = activation_need(cfg, checkpointing, False).bytes(2 * cfg.model.seq_len, 2)
        assert precomputed[key]["activations"] == two_rows > gpu["activations"], key


def test_a_reference_with_no_adapters_to_switch_off_is_an_error_not_the_policy():
    # Neither a table nor a frozen copy, and no LoRA layers: "adapters off" would be the policy
    # itself, and the loss would stay at ln 2 without a word (as zero3's copy once did).
    from torch import nn

    from trainer.losses.objectives import Reference

    with pytest.raises(RuntimeError, match="no LoRA layers"):
        Reference().logps(nn.Linear(2, 2), (torch.zeros(1, 2, dtype=torch.long),) * 4, torch.zeros(1))


def starting_adapter(pairs) -> Path:
    """A PEFT adapter folder for the Qwen2 model (r 4, alpha 8, every linear layer) far from zero,
    as an SFT run would leave one: continuing from it, the reference is this adapter, not the bare
    base (LLaMA-Factory#8459: loss 0 against the bare base)."""
    from trainer.config import PeftConfig, to_config
    from trainer.models import lora, meta_model

    out = pairs.root / "adapter"
    if not out.is_dir():
        cfg = to_config(dpo_case(pairs, "ddp"))
        model = meta_model(cfg.model, PeftConfig(name="lora", r=4, alpha=8.0))
        generator = torch.Generator().manual_seed(0)
        adapters = {lora.canonical_name(n): 0.3 * torch.randn(tuple(p.shape), generator=generator)
                    for n, p in model.named_parameters() if lora.is_adapter(n)}
        lora.write_adapter_folder(adapters, model.lora_settings, str(pairs.qwen2), out)
    return out


def test_the_starting_adapter_as_reference_gives_the_policys_logits_at_the_start(pairs):
    """peft.init's reference (models.lora.StartingAdapters): with the adapter the policy starts
    from, the model's logits are the policy's own, bitwise; the bare base's (adapters off) differ;
    a LoRA layer the reference's adapter did not reach is an error, not silently the base."""
    from trainer.config import to_config
    from trainer.models import build_model, initial_weights
    from trainer.models.lora import StartingAdapters, adapters_disabled
    from trainer.models.weights import allocate_params, fill, params_on_meta

    cfg = to_config(dpo_case(pairs, "ddp", peft={"name": "lora", "init": str(starting_adapter(pairs))}))
    model = build_model(cfg.model, params_on_meta(), cfg.peft)
    allocate_params(model, torch.device("cpu"))
    fill(model, initial_weights(cfg.model, model, 0, cfg.peft))
    model.eval()
    reference = StartingAdapters(model, starting_adapter(pairs), torch.float32, torch.device("cpu"))
    ids = torch.arange(1, 33).view(2, 16)
    with torch.no_grad():
        policy = model(ids).logits
        with reference.applied(model):
            started = model(ids).logits
        with adapters_disabled(model):
            base = model(ids).logits
    assert torch.equal(started, policy)
    assert (base - policy).abs().max() > 1e-2, "the adapter must change the model for the test to mean anything"
    assert sum(p.numel() for p in reference.parameters()) == sum(p.numel() for n, p in model.named_parameters()
                                                                   if p.requires_grad)
    layer = next(iter(reference.layers.values()))
    layer._forward_hooks.clear()  # one layer without the reference's adapter
    with pytest.raises(RuntimeError, match="not applied to 1 LoRA layers"), torch.no_grad():
        with reference.applied(model):
            model(ids)


def starting_adapter_cases(pairs) -> dict[int, dict]:
    """LoRA continuing from a starting adapter (peft.init), its reference that adapter, held whole
    beside the policy: at 1 rank (ddp) and on every strategy at 2 ranks (global batch 8)."""
    peft = {"name": "lora", "init": str(starting_adapter(pairs))}
    return {1: {"init@1": dpo_case_of(pairs, "ddp", 1, peft=peft)},
            2: {f"init:{s}@2": dpo_case_of(pairs, s, 2, peft=peft) for s in STRATEGIES}}


@pytest.fixture(scope="module")
def starting_adapter_runs(dpo_runs):
    return dpo_runs / "starting_adapter"


@pytest.mark.slow
def test_continuing_from_an_adapter_starts_at_ln2_against_it_on_every_strategy(starting_adapter_runs):
    """The reference is the starting adapter, frozen: ln 2 at step 1 with rewards 0 (against the
    bare base it would not be: the adapter moves the log-probs), and 2 ranks = 1 rank everywhere."""
    from tests.harness import records

    one = records(starting_adapter_runs / "init@1")
    steps = [r for r in one if "split" not in r]
    assert len(steps) == 3 and abs(steps[-1]["loss"] - math.log(2)) > 1e-4, "the policy must move"
    runs = sorted(starting_adapter_runs.glob("init*"))
    assert len(runs) == 1 + len(STRATEGIES)
    for run in runs:
        rows = records(run)
        assert abs(rows[0]["loss"] - math.log(2)) < 1e-6 and all(abs(rows[0][k]) < 1e-6 for k in REWARDS_AT_START), \
            (run.name, rows[0])
        assert [r.get("split") for r in rows] == [r.get("split") for r in one], run.name
        for mine, base in zip(rows, one):
            assert math.isclose(mine["loss"], base["loss"], rel_tol=DPO_RTOL), (run.name, mine, base)
            for key in REWARDS:
                assert math.isclose(mine[key], base[key], abs_tol=REWARD_ATOL), (run.name, key, mine, base)


def test_the_plan_counts_the_starting_adapter_whole_on_every_rank(tmp_path):
    """peft.init without precompute_ref: the reference's adapter, the trainable parameters again in
    the training dtype, unsharded, on every option."""
    from trainer.config import PeftConfig, Precision, to_config
    from trainer.memory import DTYPE_BYTES
    from trainer.models import lora, meta_model
    from trainer.plan import make_plan

    base = {"train": {"precision": "bf16"}, "objective": {"name": "dpo"}}
    model = meta_model(to_config(base).model, PeftConfig(name="lora", r=4, alpha=8.0))
    lora.write_adapter_folder({lora.canonical_name(n): torch.zeros(tuple(p.shape)) for n, p in model.named_parameters()
                               if lora.is_adapter(n)}, model.lora_settings, None, tmp_path / "adapter")

    def params(peft: dict) -> tuple:
        plan = make_plan(to_config({**base, "peft": {"name": "lora", **peft}}), 4, 10 ** 12)
        return plan, [o.per_gpu_bytes["params"] + o.host_bytes for o in plan.options]

    plan, fresh = params({"r": 4, "alpha": 8.0})
    _, started = params({"init": str(tmp_path / "adapter")})
    assert plan.trainable > 0
    assert [s - f for s, f in zip(started, fresh)] == [DTYPE_BYTES[Precision.bf16] * plan.trainable] * len(fresh)


# Full fine-tuning against the frozen copy in other precisions, with the optimizer offloaded: the
# copy is held in the training dtype, as the policy computes
PRECISIONS = {"bf16:fsdp": ("fsdp", {"train__precision": "bf16"}),
              "bf16:fsdp:pre": ("fsdp", {"train__precision": "bf16", "objective__precompute_ref": True}),
              "bf16:zero3:offload": ("zero3", {"train__precision": "bf16", "strategy__offload_optimizer": True}),
              "bf16:zero3:offload:pre": ("zero3", {"train__precision": "bf16", "strategy__offload_optimizer": True,
                                                    "objective__precompute_ref": True}),
              "fp16:fsdp": ("fsdp", {"train__precision": "fp16"}),  # DeepSpeed on CPU has no fp16
              "bf16:zero3:fused": ("zero3", {"train__precision": "bf16", "train__fused_loss": True}),
              "fp32:fsdp:offload": ("fsdp", {"strategy__offload_optimizer": True})}


@pytest.mark.slow
def test_the_frozen_copy_in_bf16_fp16_and_with_the_optimizer_offloaded(dpo_runs):
    """Each at 2 ranks: ln 2 and rewards 0 at step 1 (the copy computes as the policy does), a
    loss that moves and stays finite. mem.params against the same run with precomputed log-probs
    (no copy): bf16 FSDP's copy holds half the bytes of the policy's fp32 shards, bf16 ZeRO-3's
    as many as the policy's bf16 partitions."""
    from tests.harness import records

    out = dpo_runs / "precisions"
    for name in PRECISIONS:
        steps = [r for r in records(out / name) if "split" not in r]
        assert len(steps) == 3, name
        # In half precision the copy's log-probs and the policy's agree to a few 1e-6 after beta (seen:
        # margins 1.5e-6 on bf16 fsdp, 2.2e-6 on zero3); precomputed log-probs in bf16 come from
        # batches of other shapes: ~2e-5 off ln 2 on zero3.
        assert name.endswith(":pre") or abs(steps[0]["loss"] - math.log(2)) < REWARD_ATOL and \
            all(abs(steps[0][k]) < REWARD_ATOL for k in REWARDS_AT_START), (name, steps[0])
        assert all(math.isfinite(r["loss"]) for r in steps) and abs(steps[-1]["loss"] - math.log(2)) > 1e-4, \
            (name, steps)
    params = {name: records(out / name)[0]["mem"]["params"] for name in PRECISIONS}
    assert params["bf16:fsdp"] - params["bf16:fsdp:pre"] == params["bf16:fsdp:pre"] // 2, params
    assert params["bf16:zero3:offload"] - params["bf16:zero3:offload:pre"] == params["bf16:zero3:offload:pre"], params


# train.fused_loss=true (the log-probs from the fused output layer, no [tokens, vocab] logits), each
# against its plain run in parity/ or frozen_copy/: every kind of reference, on four strategies
FUSED = {"parity": {"lora:zero3@2": ("lora", "zero3"), "lora_pre:ddp@2": ("lora_pre", "ddp"),
                    "full:fsdp@2": ("full", "fsdp")},
         "frozen_copy": {"copy:zero2@2": ("copy", "zero2"), "copy:zero3@2": ("copy", "zero3")}}


# the log-probs' sums in another order (by vocabulary chunk): 1.5e-6 seen on a validation loss after 3 steps
FUSED_DPO_RTOL = 3e-6


def fused_cases(pairs) -> dict[int, dict]:
    return {2: {f"{group}/{name}": kind_case(pairs, kind, strategy, 2, train__fused_loss=True)
                for group, runs in FUSED.items() for name, (kind, strategy) in runs.items()}}


@pytest.mark.slow
def test_dpo_with_the_fused_loss_gives_the_plain_runs_losses_rewards_and_logits(dpo_runs):
    """The fused layer's per-token losses are the log-probs, in fp32, and its mean logits TRL's
    logits/*: the same records as the plain run (adapters-off, precomputed and frozen-copy references)."""
    from tests.harness import records

    for group, runs in FUSED.items():
        for name in runs:
            fused, plain = records(dpo_runs / "fused" / group / name), records(dpo_runs / group / name)
            assert [r.get("split") for r in fused] == [r.get("split") for r in plain] and len(fused) >= 3, name
            for mine, base in zip(fused, plain):
                assert math.isclose(mine["loss"], base["loss"], rel_tol=FUSED_DPO_RTOL), (name, mine, base)
                for key in (*REWARDS_AT_START, "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected"):
                    assert math.isclose(mine[key], base[key], rel_tol=1e-6, abs_tol=REWARD_ATOL), \
                        (name, mine["step"], key, mine[key], base[key])


# strategy.sp=2 on 2 ranks (one data-parallel rank: the 1-rank runs' micro-batch), each against the
# 1-rank run of its kind: the log-probs summed over the group's shares of each row
SEQUENCE_PARALLEL = {**{f"lora:{s}": ("lora", s, "parity/lora@1") for s in STRATEGIES},
                     **{f"full:{s}": ("full", s, "parity/full@1") for s in ("fsdp", "zero3")},
                     **{f"copy:{s}": ("copy", s, "frozen_copy/copy@1") for s in ("ddp", "zero3")},
                     "full:zero2:fused": ("full", "zero2", "parity/full@1"),
                     "init:zero3": ("init", "zero3", "starting_adapter/init@1")}


def sequence_parallel_cases(pairs) -> dict[int, dict]:
    return {2: {name: kind_case(pairs, kind, strategy, 1, strategy__sp=2, train__fused_loss=name.endswith(":fused"))
                for name, (kind, strategy, _) in SEQUENCE_PARALLEL.items()}}


@pytest.mark.slow
def test_dpo_at_sp2_gives_one_ranks_losses_and_rewards(dpo_runs):
    """Each response's log-probability is the sum over the group's shares of its row: sp=2 gives the
    losses, rewards, logps/* and logits/* of one rank (adapters-off, precomputed, frozen-copy and
    starting-adapter references; every strategy; with the fused loss)."""
    from tests.harness import records

    for name, (_, _, baseline) in SEQUENCE_PARALLEL.items():
        mine, base = records(dpo_runs / "sequence_parallel" / name), records(dpo_runs / baseline)
        assert [r.get("split") for r in mine] == [r.get("split") for r in base] and len(mine) >= 3, name
        assert abs(mine[0]["loss"] - math.log(2)) < 1e-6, (name, mine[0])
        for row, expected in zip(mine, base):
            rtol = FUSED_DPO_RTOL if name.endswith(":fused") else DPO_RTOL  # measured: 6.1e-7, fused 8.8e-7
            # -log sigmoid(reward margin): its resolution is the rewards' (at most REWARD_ATOL); measured
            # 8e-7 (init:zero3, step 3's validation: 1.15e-6 relative), the same on every rerun, the same versions
            assert math.isclose(row["loss"], expected["loss"], rel_tol=rtol, abs_tol=REWARD_ATOL), (name, row, expected)
            counts = ("tokens", "input_tokens") if "split" not in row else ()  # counted once per group
            for key in (*REWARDS_AT_START, "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected", *counts):
                assert math.isclose(row[key], expected[key], rel_tol=1e-6, abs_tol=REWARD_ATOL), \
                    (name, row["step"], key, row[key], expected[key])


@pytest.fixture(scope="module")
def dpo_runs(pairs):
    """Every multi-rank DPO run of the slow tests above, in two launches, each run into its group's
    folder: the 2-rank one, then the 1-rank one, which also resumes the checkpoints the first saved."""
    from tests.harness import on_ranks, train_cases

    out = pairs.root / "runs"
    groups = {"parity": parity_cases(pairs), "resumes": resume_cases(pairs, out / "resumes"),
              "frozen_copy": frozen_copy_cases(pairs), "starting_adapter": starting_adapter_cases(pairs),
              "fused": fused_cases(pairs), "sequence_parallel": sequence_parallel_cases(pairs),
              "precisions": {2: {name: dpo_case_of(pairs, strategy, 2, optim__lr=1e-3, **settings)
                                 for name, (strategy, settings) in PRECISIONS.items()}}}
    for world in (2, 1):
        on_ranks(world, train_cases, {f"{group}/{name}": cfg for group, runs in groups.items()
                                      for name, cfg in runs.get(world, {}).items()}, str(out))
    return out
