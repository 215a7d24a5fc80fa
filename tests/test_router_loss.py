"""The router's load-balancing loss of mixture-of-experts models (losses/router_loss.py):
transformers' own number for one row, per-row statistics, and 2 ranks = 1 rank on every strategy
and across the crossings, with the term on."""
from __future__ import annotations

import pytest
import torch

from tests.harness import assert_close, case, losses, on_ranks, records, resuming, saving, train_cases, with_overrides
from trainer.data.sources import IGNORE_INDEX
from trainer.demo import (
    VOCAB,
    conversations,
    documents,
    make_model_dir,
    preference_pairs,
    train_chat_tokenizer,
    write_rows,
)
from trainer.losses.objectives import NextToken
from trainer.losses.router_loss import RouterBalanced, check_router_loss, router_logits, with_router_loss
from trainer.models.sequence import SequenceGroup

ONE_RANK = SequenceGroup(None, 1, 0)
COEF = 0.1  # larger than the families' defaults (0.001-0.02): the term shows in the loss


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    on = dict(output_router_logits=True, router_aux_loss_coef=COEF)
    return {"mixtral": make_model_dir(root / "mixtral", "mixtral", weights=False, **on),
            "gpt_oss": make_model_dir(root / "gpt_oss", "gpt_oss", weights=True, **on),
            "qwen3_moe_off": make_model_dir(root / "qwen3_moe_off", "qwen3_moe", weights=False),
            "deepseek_v3": make_model_dir(root / "deepseek_v3", "deepseek_v3", weights=False),
            "root": root}


def hf_model(path):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path))
    config._attn_implementation = "eager"
    config.use_cache = False  # as the trainer builds it: transformers keeps packed documents apart only then
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).float()


def per_row_aux(objective: RouterBalanced, model, x, y) -> torch.Tensor:
    """aux_loss of the micro-batch (x, y): its statistic over the micro-batch's units."""
    _, stats = objective.loss_sum(model, [x, y])
    return stats[-1] / objective.count([x, y])


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_one_row_gives_transformers_own_loss_and_aux_loss(folders, family):
    model = hf_model(folders[family])
    objective = with_router_loss(NextToken(), router_logits(model), ONE_RANK)
    assert isinstance(objective, RouterBalanced) and objective.coef == COEF
    ids = torch.randint(0, VOCAB, (1, 33), generator=torch.Generator().manual_seed(1))
    x, y = ids[:, :-1], ids[:, 1:]
    loss, stats = objective.loss_sum(model, [x, y])
    theirs = model(input_ids=x, labels=y, shift_labels=y)  # labels as the trainer's rows hold them: no shift
    assert abs((loss / 32).item() - theirs.loss.item()) <= 1e-6 * theirs.loss.item()
    assert abs((stats[-1] / 32).item() - theirs.aux_loss.item()) <= 1e-6 * theirs.aux_loss.item()
    assert theirs.aux_loss.item() > 1.0  # E * sum f P >= 1 for top-2 of 4 experts: a real term


def test_the_trainers_model_leaves_transformers_aux_loss_uncomputed_and_gives_its_number(folders, monkeypatch):
    """The model as the trainer builds it (config.json: output_router_logits on) runs without
    transformers' load_balancing_loss_func (the routers' logits come from hooks of the trainer's own);
    its config still says on. One unpacked row: the trainer's aux_loss is transformers' own."""
    from transformers.models.mixtral import modeling_mixtral

    from trainer.config import ModelConfig
    from trainer.models import hf

    calls = []
    theirs_func = modeling_mixtral.load_balancing_loss_func
    monkeypatch.setattr(modeling_mixtral, "load_balancing_loss_func", lambda *a, **k: calls.append(1) or theirs_func(*a, **k))
    model = hf.builder(ModelConfig(name="hf", kind="hf", path=str(folders["mixtral"]), attn_implementation="eager"))()
    plain = hf_model(folders["mixtral"])  # transformers' own forward, with the same weights
    plain.load_state_dict(model.state_dict())
    objective = with_router_loss(NextToken(), router_logits(model), ONE_RANK)
    ids = torch.randint(0, VOCAB, (1, 33), generator=torch.Generator().manual_seed(4))
    x, y = ids[:, :-1], ids[:, 1:]
    _, stats = objective.loss_sum(model, [x, y])
    output = model(input_ids=x)
    assert calls == [] and output.aux_loss is None and output.router_logits is None
    assert model.config.output_router_logits
    theirs = plain(input_ids=x).aux_loss
    assert calls == [1]
    assert abs((stats[-1] / 32).item() - theirs.item()) <= 1e-6 * theirs.item()


def test_statistics_are_per_row_and_padding_routes_nowhere(folders):
    """Two rows in one micro-batch give the token-weighted mean of each row's own aux (transformers
    would take f and P over both rows together); a padded tail (no target) changes nothing."""
    model = hf_model(folders["mixtral"])
    objective = with_router_loss(NextToken(), router_logits(model), ONE_RANK)
    g = torch.Generator().manual_seed(2)
    a, b = torch.randint(0, VOCAB, (1, 33), generator=g), torch.randint(0, VOCAB, (1, 33), generator=g)
    y_b = b[:, 1:].clone()
    y_b[:, 24:] = IGNORE_INDEX  # row b: 24 targets, then padding
    x, y = torch.cat([a[:, :-1], b[:, :-1]]), torch.cat([a[:, 1:], y_b])
    together = per_row_aux(objective, model, x, y)
    alone_a = per_row_aux(objective, model, a[:, :-1], a[:, 1:])
    alone_b = per_row_aux(objective, model, b[:, :24], y_b[:, :24])  # row b cut where its padding starts
    assert abs(together - (32 * alone_a + 24 * alone_b) / 56) <= 1e-6 * together
    transformers_way = model(input_ids=x, output_router_logits=True).aux_loss  # f and P over the micro-batch
    assert abs(together - transformers_way) > 1e-4


def test_a_packed_row_gives_its_conversations_padded_loss_and_aux_loss(folders):
    """Statistics per document: two conversations packed in one row (position ids restarting at the
    second, a padded tail of its own) give the summed loss and aux of the same two padded rows; a
    conversation's prompt (no targets) routes, its padding does not."""
    model = hf_model(folders["mixtral"])
    objective = with_router_loss(NextToken(), router_logits(model), ONE_RANK)
    g = torch.Generator().manual_seed(3)
    a, b = torch.randint(0, VOCAB, (20,), generator=g), torch.randint(0, VOCAB, (13,), generator=g)
    y_b = b[1:].clone()
    y_b[:4] = IGNORE_INDEX  # b's prompt
    x = torch.full((1, 32), 0)
    y = torch.full((1, 32), IGNORE_INDEX)
    x[0, :19], y[0, :19], x[0, 19:31], y[0, 19:31] = a[:-1], a[1:], b[:-1], y_b
    positions = torch.cat([torch.arange(19), torch.arange(12), torch.arange(1)])[None]
    packed_loss, packed_stats = objective.loss_sum(model, [x, y, positions])
    padded_x, padded_y = torch.full((2, 32), 0), torch.full((2, 32), IGNORE_INDEX)
    padded_x[0, :19], padded_y[0, :19], padded_x[1, :12], padded_y[1, :12] = a[:-1], a[1:], b[:-1], y_b
    padded_loss, padded_stats = objective.loss_sum(model, [padded_x, padded_y])
    assert abs(packed_loss - padded_loss) <= 1e-5 * padded_loss
    assert abs(packed_stats[-1] - padded_stats[-1]) <= 1e-5 * padded_stats[-1]
    assert packed_stats[-1] / 27 > 1.0  # 27 targets: a real term


def test_the_setting_turns_it_on_and_off_and_is_refused_where_there_is_no_such_loss(folders):
    from trainer.config import ModelConfig, model_config
    from trainer.errors import ConfigError
    from trainer.models import hf

    def objective(path, setting):
        model = hf.builder(ModelConfig(name="hf", kind="hf", path=str(path), router_aux_loss=setting))()
        return with_router_loss(NextToken(), router_logits(model), ONE_RANK)

    assert isinstance(objective(folders["qwen3_moe_off"], None), NextToken)  # config.json: off
    assert isinstance(objective(folders["qwen3_moe_off"], True), RouterBalanced)
    assert isinstance(objective(folders["mixtral"], None), RouterBalanced)  # config.json: on
    assert isinstance(objective(folders["mixtral"], False), NextToken)
    # the checks before any work (trainer/__main__.py's check_before_work calls it on the meta model)
    deepseek = hf.builder(ModelConfig(name="hf", kind="hf", path=str(folders["deepseek_v3"])))()
    with pytest.raises(ConfigError, match="^model.router_aux_loss: this model has no router load-balancing loss"):
        check_router_loss(True, deepseek)
    check_router_loss(None, deepseek)  # not asked: nothing to refuse
    with pytest.raises(ConfigError, match="^model.router_aux_loss"):
        model_config({"name": "hf", "kind": "hf", "path": str(folders["mixtral"]), "router_aux_loss": "maybe"})


# -- the trainer: 2 ranks = 1 rank with the term on, on every strategy and across the crossings --------

STEPS = 4


def moe_case(path, strategy: str, micro: int, accum: int = 1, **overrides) -> dict:
    """Synthetic rows of 32 tokens, global batch 4 at one rank (micro x accum x ranks), 4 steps."""
    cfg = with_overrides(case(strategy, steps=STEPS), train__micro_batch_size=micro, train__grad_accum_steps=accum,
                         data__name="synthetic", data__num_samples=256, optim__lr=1e-2, **overrides)
    return {**cfg, "model": {"name": "hf", "kind": "hf", "path": str(path), "seq_len": 32, "vocab_size": VOCAB,
                             **cfg.get("model", {})}}


DPO_RTOL = 3e-6

TWO_RANKS = {  # name: (strategy, micro, accum, overrides): global batch 4 each
    "ddp": ("ddp", 2, 1, {}),
    "fsdp": ("fsdp", 1, 2, {}),
    "zero1": ("zero1", 2, 1, {}),
    "zero2": ("zero2", 1, 2, {}),
    "zero3": ("zero3", 2, 1, {}),
    "ddp_ac": ("ddp", 1, 2, {"train__activation_checkpointing": True}),
    "zero3_offload": ("zero3", 1, 2, {"strategy__offload_optimizer": True, "strategy__offload_params": True}),
    "zero2_fused_loss": ("zero2", 2, 1, {"train__fused_loss": True}),
    "fsdp_sp2": ("fsdp", 4, 1, {"strategy__sp": 2}),  # dp=1: the whole global batch on each rank, half its tokens
    "ddp_compile": ("ddp", 2, 1, {"train__compile": True}),
}


def text_data(root):
    """A chat tokenizer, 24 conversations and 16 preference pairs on it, and its cache."""
    texts = documents()
    return {"data__tokenizer": str(train_chat_tokenizer(root / "tokenizer", texts)),
            "data__cache_dir": str(root / "cache"),
            "chat": str(write_rows(root / "chat.jsonl", conversations(texts, n=24))),
            "pairs": str(write_rows(root / "pairs.jsonl", preference_pairs(texts, 16)))}


def chat_case(path, data: dict, strategy: str, micro: int, accum: int = 1, steps: int = STEPS, **overrides) -> dict:
    """The tiny Mixtral on data=chat (packed unless data__packing=False) rows of 256 tokens."""
    chat = {"data__name": "chat", "data__path": data["chat"], **{k: v for k, v in data.items() if k.startswith("data__")}}
    cfg = with_overrides(moe_case(path, strategy, micro, accum), train__max_steps=steps, model__seq_len=256,
                         **{**chat, **overrides})
    del cfg["data"]["num_samples"]
    return cfg


def dpo_case(path, data: dict, strategy: str, micro: int, accum: int = 1, **overrides) -> dict:
    """objective=dpo on the pairs (packed, a pair's two sequences in a row), against a frozen copy."""
    return chat_case(path, data, strategy, micro, accum, data__name="preference", data__path=data["pairs"],
                     objective__name="dpo", **overrides)


# 2 ranks of each against one rank: (strategy, micro, accum, overrides), global batch 2 rows (4 for dpo)
CHAT_TWO_RANKS = {
    "chat_packed_fsdp": ("fsdp", 1, 1, {}),
    "chat_packed_zero2_sp2": ("zero2", 2, 1, {"strategy__sp": 2}),  # documents numbered across the group
    "chat_padded_ddp_sp2": ("ddp", 2, 1, {"strategy__sp": 2, "data__packing": False}),
}


@pytest.fixture(scope="module")
def trained(folders, tmp_path_factory):
    out = tmp_path_factory.mktemp("router_runs")
    mixtral, data = folders["mixtral"], text_data(folders["root"])
    ones = {"baseline": moe_case(mixtral, "ddp", 4),
            "accumulated": moe_case(mixtral, "ddp", 1, 4),
            "off": moe_case(mixtral, "ddp", 4, model__router_aux_loss=False),
            # one epoch at lr 0, packed and padded: the same conversations' losses (a step per row)
            "chat_epoch_packed": chat_case(mixtral, data, "ddp", 1, steps=0, optim__lr=0.0),
            "chat_epoch_padded": chat_case(mixtral, data, "ddp", 1, steps=0, optim__lr=0.0, data__packing=False),
            "chat_packed": chat_case(mixtral, data, "ddp", 2),
            "chat_padded": chat_case(mixtral, data, "ddp", 2, data__packing=False),
            "dpo": dpo_case(mixtral, data, "ddp", 4)}
    twos = {name: moe_case(mixtral, s, micro, accum, **o) for name, (s, micro, accum, o) in TWO_RANKS.items()}
    twos |= {name: chat_case(mixtral, data, s, micro, accum, **o) for name, (s, micro, accum, o) in CHAT_TWO_RANKS.items()}
    twos["dpo_zero2"] = dpo_case(mixtral, data, "zero2", 1, 2)
    twos["dpo_zero3_sp2"] = dpo_case(mixtral, data, "zero3", 2, 2, strategy__sp=2)  # a pair's units from the whole row
    twos["zero3_saved"] = saving(twos["zero3"], out / "ckpt", 2)
    on_ranks(2, train_cases, twos, str(out))
    # with the checkpoint of 2 ranks on zero3 resumed at 1 rank on fsdp
    on_ranks(1, train_cases, {**ones, "resumed_fsdp_1": resuming(moe_case(mixtral, "fsdp", 4), out / "ckpt", 2)},
             str(out))
    return out


def aux(rows: list[dict]) -> list[float]:
    return [r["aux_loss"] for r in rows]


@pytest.mark.slow
def test_the_term_is_in_the_loss_logged_apart_and_accumulation_changes_nothing(trained):
    base, off = records(trained / "baseline"), records(trained / "off")
    assert len(base) == STEPS and all(a > 1.0 for a in aux(base))
    assert "aux_loss" not in off[0]
    # the same weights at step 1: the loss with the term is the loss without it plus coef x aux_loss
    assert abs(base[0]["loss"] - (off[0]["loss"] + COEF * base[0]["aux_loss"])) <= 1e-6 * base[0]["loss"]
    accumulated = records(trained / "accumulated")
    assert_close(losses(accumulated), losses(base), "accumulation 4 x 1 row", rtol=1e-6)
    assert_close(aux(accumulated), aux(base), "accumulation: aux_loss", rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name", TWO_RANKS)
def test_two_ranks_give_one_ranks_losses_with_the_term_on(trained, name):
    base, two = records(trained / "baseline"), records(trained / name)
    assert_close(losses(two), losses(base), name, rtol=1e-6)
    assert_close(aux(two), aux(base), f"{name}: aux_loss", rtol=1e-6)


@pytest.mark.slow
def test_a_checkpoint_of_two_ranks_on_zero3_resumes_at_one_rank_on_fsdp(trained):
    base, resumed = records(trained / "baseline"), records(trained / "resumed_fsdp_1")
    assert [r["step"] for r in resumed] == [3, 4]
    assert_close(losses(resumed), losses(base)[2:], "resumed", rtol=1e-6)
    assert_close(aux(resumed), aux(base)[2:], "resumed: aux_loss", rtol=1e-6)


@pytest.mark.slow
def test_packed_chat_rows_give_the_padded_rows_loss_and_aux_loss_over_an_epoch(trained):
    """Statistics per conversation: one epoch at lr 0, summed over the target tokens, is the same packed
    (several conversations a row) and padded (one a row)."""
    from tests.test_chat import PACKED_RTOL, summed_loss

    packed, padded = trained / "chat_epoch_packed", trained / "chat_epoch_padded"
    (packed_loss, packed_tokens, packed_rows), (padded_loss, padded_tokens, padded_rows) = \
        summed_loss(packed), summed_loss(padded)
    assert packed_tokens == padded_tokens > 0 and packed_rows < padded_rows / 2
    assert abs(packed_loss - padded_loss) <= PACKED_RTOL * padded_loss
    tokens = {run: [0] + [r["tokens"] for r in records(run)] for run in (packed, padded)}
    summed_aux = {run: sum(r["aux_loss"] * (t - before) for r, before, t in zip(records(run), tokens[run], tokens[run][1:]))
                  for run in (packed, padded)}
    assert abs(summed_aux[packed] - summed_aux[padded]) <= PACKED_RTOL * summed_aux[padded]


@pytest.mark.slow
@pytest.mark.parametrize("name", [*CHAT_TWO_RANKS, "dpo_zero2", "dpo_zero3_sp2"])
def test_chat_and_dpo_rows_on_two_ranks_give_one_ranks_losses_with_the_term_on(trained, name):
    one = {"chat_packed_fsdp": "chat_packed", "chat_packed_zero2_sp2": "chat_packed",
           "chat_padded_ddp_sp2": "chat_padded", "dpo_zero2": "dpo", "dpo_zero3_sp2": "dpo"}[name]
    base, two = records(trained / one), records(trained / name)
    assert len(base) == STEPS and all(a > 1.0 for a in aux(base))
    # DPO's loss is a sigmoid of beta x a difference of log-probs summed over ~200 tokens each: the
    # ~1e-7 of a reduction in another order comes out ~1e-6 (CI saw 1.01e-6 at step 4)
    # at sp=2 attention sums in other orders too, and the rate is high: measured 0 at step 1, 3.3e-6 at step 4
    rtol = {"dpo_zero2": DPO_RTOL, "dpo_zero3_sp2": 1e-5}.get(name, 1e-6)
    assert_close(losses(two), losses(base), name, rtol=rtol)
    assert_close(aux(two), aux(base), f"{name}: aux_loss", rtol=1e-6)


# -- the command line ------------------------------------------------------------------------------

def test_the_cli_trains_with_the_term_asked_for_and_refuses_it_in_one_line(folders, tmp_path):
    """`trainer model=hf model.router_aux_loss=true` on a folder whose config.json leaves it off: on,
    said at the start, in the records; on DeepSeek-V3 (no such loss) and with a value that is no
    boolean: refused in one line before any work."""
    from tests.harness import refusal, run_cli

    model = ("model=hf", "model.attn_implementation=eager", "model.seq_len=32", f"model.vocab_size={VOCAB}")
    run = ("data=synthetic", "data.num_samples=64", "train.max_steps=2", "train.micro_batch_size=2",
           "train.log_every=1", "train.precision=fp32")
    result = run_cli(*model, f"model.path={folders['qwen3_moe_off']}", "model.router_aux_loss=true", *run,
                     f"hydra.run.dir={tmp_path / 'on'}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "router_aux_loss=on (coef 0.001, top-2 of 4 experts" in result.stdout + result.stderr
    assert [r["aux_loss"] > 1.0 for r in records(tmp_path / "on")] == [True, True]
    # the refusals in this process: the checks the command runs before work (tests/harness.py: refusal)
    refused = refusal(tmp_path / "deepseek", *model, f"model.path={folders['deepseek_v3']}", "model.router_aux_loss=true",
                      *run)
    assert "model.router_aux_loss: this model has no router load-balancing loss" in refused
    assert "model.router_aux_loss" in refusal(tmp_path / "bad", *model, f"model.path={folders['mixtral']}",
                                              "model.router_aux_loss=maybe", *run)
