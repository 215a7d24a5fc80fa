"""Chat SFT data (`data=chat`): the targets are the assistant's tokens, found in the chat
template's rendering; conversations are packed padding-free, with position ids that keep
attention within each, for the same loss as one padded row per conversation."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.harness import case, on_ranks, records, refusal, refused_by, train_cases, with_overrides
from trainer.config import TrainOn, to_config
from trainer.data.sources import IGNORE_INDEX
from trainer.demo import (
    CHAT_TEMPLATE,
    VOCAB,
    conversations,
    documents,
    make_model_dir,
    train_chat_tokenizer,
    write_rows,
)

# Packed rows and padded ones are other shapes (other kernels, sums in another order): not the parity
# tolerance of fp32 losses, tests/harness.py's, which compares runs of the same shapes.
PACKED_RTOL = 1e-5


def longer(rows: list[dict], roles: set[str]) -> list[dict]:
    """The same conversations with the messages of `roles` three times as long."""
    return [{"messages": [{**m, "content": " ".join([m["content"]] * 3)} if m["role"] in roles else m
                          for m in row["messages"]]} for row in rows]


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """Tokenizers with and without a chat template, the template as a file, a Qwen2 config,
    and 60 conversations three ways: as made, longer user and system turns, longer answers."""
    from types import SimpleNamespace

    root = tmp_path_factory.mktemp("chat")
    texts = documents()
    rows = conversations(texts, n=60)
    (root / "chatml.jinja").write_text(CHAT_TEMPLATE)
    return SimpleNamespace(
        root=root, rows=rows, cache=root / "cache", template=root / "chatml.jinja",
        tokenizer=train_chat_tokenizer(root / "tokenizer", texts),
        no_template=train_chat_tokenizer(root / "no_template", texts, template=False),
        # Initialised 10x wider than usual: attention that is far from uniform, so a model that
        # attended across conversations would give a measurably different loss (1e-5 at 0.02).
        qwen2=make_model_dir(root / "qwen2", "qwen2", weights=False, initializer_range=0.2),
        data=write_rows(root / "chat.jsonl", rows),
        longer_context=write_rows(root / "longer_context.jsonl", longer(rows, {"user", "system"})),
        longer_answers=write_rows(root / "longer_answers.jsonl", longer(rows, {"assistant"})),
    )


def tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def target_text(tok, ids: list[int], targets: list[int]) -> list[str]:
    """The decoded runs of consecutive targets."""
    runs, run = [], []
    for i, t in zip(ids, targets):
        if t:
            run.append(i)
        elif run:
            runs, run = runs + [tok.decode(run)], []
    return runs + ([tok.decode(run)] if run else [])


def encode(tok, row: dict, train_on: str = "assistant", template: str | None = None) -> tuple[list[int], list[int]]:
    from trainer.data.chat import Conversations

    ((ids, targets),) = Conversations(TrainOn(train_on), template).encode(tok, {k: [v] for k, v in row.items()}, 0)
    return ids, targets


def message(role: str, content: str) -> dict:
    return {"role": role, "content": content}


DIALOGUE = [message("system", "Be brief."), message("user", "Name a license."), message("assistant", "MIT, say."),
            message("user", "Another?"), message("assistant", " Apache 2.0 ")]


def test_the_targets_are_each_assistant_message_and_its_end_of_turn(chat):
    tok = tokenizer(chat.tokenizer)
    ids, targets = encode(tok, {"messages": DIALOGUE})
    assert target_text(tok, ids, targets) == ["MIT, say.<|im_end|>", " Apache 2.0 <|im_end|>"]
    assert tok.decode(ids) == tok.apply_chat_template(DIALOGUE, tokenize=False)
    ids_all, targets_all = encode(tok, {"messages": DIALOGUE}, "all")
    assert ids_all == ids and all(targets_all)
    # A template file gives a tokenizer without one the same rendering and targets.
    assert encode(tokenizer(chat.no_template), {"messages": DIALOGUE}, template=str(chat.template)) == (ids, targets)
    # A template that trims the content, and puts a space before the end of the turn.
    trimmed = chat.root / "trimmed.jinja"
    trimmed.write_text(CHAT_TEMPLATE.replace("message['content'] + '<|im_end|>'",
                                             "message['content'] | trim + ' <|im_end|>'"))
    ids, targets = encode(tok, {"messages": DIALOGUE}, template=str(trimmed))
    assert target_text(tok, ids, targets) == ["MIT, say. <|im_end|>", "Apache 2.0 <|im_end|>"]


def test_prompt_completion_rows_train_on_the_completion(chat):
    tok = tokenizer(chat.tokenizer)
    ids, targets = encode(tok, {"prompt": "The MIT license is", "completion": " short."})
    assert target_text(tok, ids, targets) == [" short.<|im_end|>"]  # no template: prompt + completion + EOS
    assert tok.decode(ids) == "The MIT license is short.<|im_end|>"
    row = {"prompt": DIALOGUE[:4], "completion": DIALOGUE[4:]}
    for train_on, expected in (("completion", [" Apache 2.0 <|im_end|>"]),
                               ("assistant", ["MIT, say.<|im_end|>", " Apache 2.0 <|im_end|>"])):
        ids, targets = encode(tok, row, train_on)
        assert target_text(tok, ids, targets) == expected, train_on


# ChatML that moves the system prompt into the last user message (as some Mistral templates do): a
# conversation's beginning renders it elsewhere than the whole does.
MOVES_SYSTEM = (
    "{%- set last_user = (messages | selectattr('role', 'eq', 'user') | list)[-1] %}"
    "{%- for message in messages if message['role'] != 'system' %}"
    "{%- set system = (messages[0]['content'] + ' ') if message is sameas last_user and messages[0]['role'] == "
    "'system' else '' %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + system + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
TWO_TURNS = [message("system", "Say MIT when asked."), message("user", "A license? MIT or BSD?"),
             message("assistant", "MIT"), message("user", "Why MIT?"), message("assistant", "Short.")]
# ChatML that renders the assistant's content in capitals: it is not where it is rendered.
SHOUTS = CHAT_TEMPLATE.replace("message['content']", "(message['content'] | upper if message['role'] == "
                               "'assistant' else message['content'])")


def test_targets_are_found_only_where_the_template_renders_the_message(chat, tmp_path):
    """The answer's words also stand in the system and user text: a template that moves the system prompt
    is refused in one line (it used to train the user's words), and content the template does not render
    is a bad row (it used to be found in the next user message)."""
    from trainer.data.chat import Conversations
    from trainer.data.tokenized import BadRow
    from trainer.errors import ConfigError

    for name, template in (("moves_system", MOVES_SYSTEM), ("shouts", SHOUTS)):
        (tmp_path / f"{name}.jinja").write_text(template)
    tok = tokenizer(chat.no_template)
    dialogue = TWO_TURNS
    ids, targets = encode(tok, {"messages": dialogue}, template=str(chat.template))
    assert target_text(tok, ids, targets) == ["MIT<|im_end|>", "Short.<|im_end|>"]
    with pytest.raises(ConfigError) as refused:
        encode(tok, {"messages": dialogue}, template=str(tmp_path / "moves_system.jinja"))
    error = str(refused.value)
    assert error.startswith("data.chat_template: the chat template renders the conversation of row 0 up to message "
                            "2 as text that does not begin its whole rendering") and "\n" not in error, error
    assert "'Say MIT when asked. A license?" in error and "the whole has 'A license?" in error  # where they differ
    # Without a system prompt that template keeps the prefix: its targets are found.
    ids, targets = encode(tok, {"messages": dialogue[1:]}, template=str(tmp_path / "moves_system.jinja"))
    assert target_text(tok, ids, targets) == ["MIT<|im_end|>", "Short.<|im_end|>"]
    shouting = Conversations(TrainOn.assistant, str(tmp_path / "shouts.jinja"))
    (bad,) = shouting.encode(tok, {"messages": [[message("user", "Hi"), message("assistant", "ok"),
                                                 message("user", "ok?")]]}, 7)
    assert isinstance(bad, BadRow) and str(bad).startswith("row 7: the content of message 1 ('ok') is not in"), bad


def skipping_case(chat, tmp_path, rows: list[dict], **data) -> dict:
    path = write_rows(tmp_path / "rows.jsonl", rows)
    return {"data": {"name": "chat", "path": str(path), "tokenizer": str(chat.tokenizer),
                     "cache_dir": str(tmp_path / "cache"), "num_workers": 0, **data},
            "model": {"vocab_size": VOCAB, "seq_len": 256}}


def test_a_bad_row_past_the_checked_ones_stops_the_run_or_is_skipped_and_counted(chat, tmp_path, caplog):
    import logging

    from trainer.data import check_data, load_data
    from trainer.data.read import the_source, token_cache
    from trainer.data.tokenized import CHECKED_ROWS
    from trainer.errors import ConfigError

    rows = list(chat.rows[:30])
    rows[CHECKED_ROWS + 4] = {"messages": [message("user", "Hi"), {"role": "assistant", "content": None}]}
    rows[CHECKED_ROWS + 9] = {"messages": [{"content": "no role"}, message("assistant", "Hi")]}
    stops = to_config(skipping_case(chat, tmp_path, rows))
    check_data(stops, world_size=1)  # the first rows read
    with pytest.raises(ConfigError, match=f"row {CHECKED_ROWS + 4}: message 1 is not .*data.bad_rows=skip leaves"):
        token_cache(stops, the_source(stops), stops.data.path, "data.path").prepare()
    skips = to_config(skipping_case(chat, tmp_path, rows, bad_rows="skip"))
    check_data(skips, world_size=1)
    with caplog.at_level(logging.INFO, logger="trainer"):
        train, _ = load_data(skips, local_rank=0)
    tokens = token_cache(skips, the_source(skips), skips.data.path, "data.path").tokens()[0]
    assert tokens.bad_rows == 2 and len(tokens.doc_starts) == len(rows) - 2
    assert "2 bad rows skipped (data.bad_rows=skip)" in caplog.text  # the start line
    assert f"row {CHECKED_ROWS + 9}: message 0 is not" in caplog.text  # each named as it is skipped
    assert len(train.spans) == len(rows) - 2
    # Every one of the first rows bad: no data of this kind, refused before work either way.
    with pytest.raises(ConfigError, match="none of the first 16 rows can be read; row 0: message 0 is not"):
        check_data(to_config(skipping_case(chat, tmp_path, [{"messages": [{"content": "no role"}]}] * 20,
                                           bad_rows="skip")), world_size=1)


def test_the_cache_keeps_a_target_mask_and_is_keyed_by_template_and_train_on(chat, tmp_path):
    from trainer.data.read import the_source, token_cache

    def source(**data):
        cfg = to_config({"data": {"name": "chat", "path": str(chat.data), "tokenizer": str(chat.no_template),
                                  "chat_template": str(tmp_path / "t.jinja"), "cache_dir": str(tmp_path / "cache"),
                                  **data}, "model": {"vocab_size": VOCAB}})
        return token_cache(cfg, the_source(cfg), cfg.data.path, "data.path")

    (tmp_path / "t.jinja").write_text(CHAT_TEMPLATE)
    first = source()
    first.prepare()
    tokens, _ = first.tokens()
    assert tokens.targets is not None and len(tokens.targets) == len(tokens.ids)
    assert 0 < tokens.targets.mean() < 1
    assert source(train_on="all").dir != first.dir
    (tmp_path / "t.jinja").write_text(CHAT_TEMPLATE.replace("<|im_end|>' + '\\n'", "<|im_end|>'"))
    assert source().dir != first.dir


def test_packed_rows_hold_whole_conversations_whose_positions_restart():
    from trainer.data.sources import PackedDocuments, Tokens, UnpackedDocuments

    lengths = [5, 3, 10, 4, 2]  # seq_len 8: the third is longer than seq_len + 1 and is cut to 9
    starts = np.cumsum([0] + lengths[:-1])
    ids = np.arange(1, sum(lengths) + 1, dtype=np.uint16)
    targets = np.ones(len(ids), dtype=np.uint8)
    targets[[1, 2, 6]] = 0  # context tokens of the first two conversations
    tokens = Tokens(ids, starts, targets)
    packed = PackedDocuments(tokens, seq_len=8, vocab_size=64, pad_id=0)
    assert len(packed) == 3 and packed.long == 1  # [5, 3] | [10 -> 9] | [4, 2]: greedy, in order
    x, y, position_ids = packed[0]
    assert x.tolist() == [1, 2, 3, 4, 6, 7, 0, 0]
    assert y.tolist() == [IGNORE_INDEX, IGNORE_INDEX, 4, 5, IGNORE_INDEX, 8] + [IGNORE_INDEX] * 2
    assert position_ids.tolist() == [0, 1, 2, 3, 0, 1, 0, 1]  # the padded tail is no conversation's
    assert packed[1][2].tolist() == list(range(8)) and packed[1][0].tolist() == list(range(9, 17))
    assert packed[2][2].tolist() == [0, 1, 2, 0, 0, 1, 2, 3]
    padded = UnpackedDocuments(tokens, seq_len=8, vocab_size=64, pad_id=0)
    assert sorted(t for r in packed for t in r[1].tolist() if t != IGNORE_INDEX) == \
        sorted(t for r in padded for t in r[1].tolist() if t != IGNORE_INDEX)
    assert len(PackedDocuments(tokens, 8, 64, 0, drop_long=True).spans) == 4


def test_the_reference_model_keeps_packed_documents_apart():
    from trainer.models.builtin import ModelShape, Transformer

    torch.manual_seed(0)
    model = Transformer(ModelShape(vocab_size=50, seq_len=16, d_model=32, n_layers=2, n_heads=4, d_ff=64))
    a, b = torch.randint(0, 50, (1, 10)), torch.randint(0, 50, (1, 6))
    with torch.no_grad():
        apart = torch.cat([model(a), model(b)], dim=1)
        position_ids = torch.cat([torch.arange(10), torch.arange(6)])[None]
        packed = model(torch.cat([a, b], dim=1), position_ids=position_ids)
        joined = model(torch.cat([a, b], dim=1))
        one_document = model(a, position_ids=torch.arange(10)[None])
    assert torch.allclose(packed, apart, atol=1e-5)
    assert not torch.allclose(joined[:, 10:], apart[:, 10:], atol=1e-2)  # without them b would see a
    assert torch.allclose(one_document, model(a), atol=1e-6)


class PositionsOnly(torch.nn.Module):
    """A custom model that takes position_ids for its position embedding: with `apart`, its attention
    keeps each packed sequence to itself (sequence.attention within its documents); without, it is causal over the
    whole row, across them, though its forward's signature is the same."""

    def __init__(self, vocab: int, dim: int, apart: bool):
        super().__init__()
        self.apart = apart
        self.embed, self.positions = torch.nn.Embedding(vocab, dim), torch.nn.Embedding(256, dim)
        self.qkv, self.head = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, vocab)

    def forward(self, ids, position_ids=None):
        from trainer.models.sequence import attention, documents_for

        position_ids = torch.arange(ids.shape[1])[None] if position_ids is None else position_ids
        x = self.embed(ids) + self.positions(position_ids)
        q, k, v = (t[:, None] for t in self.qkv(x).chunk(3, dim=-1))
        y = attention(q, k, v, documents=documents_for(position_ids)) if self.apart else \
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(x + y[:, 0])


def positions_only(vocab: int = VOCAB, dim: int = 32, apart: bool = False) -> PositionsOnly:
    return PositionsOnly(vocab, dim, apart)


def test_the_packing_check_passes_models_that_keep_conversations_apart(chat):
    """The same custom model without `apart` attends across them and is refused (more refusals are
    among the bad settings below)."""
    from trainer.models import resolve_model
    from trainer.models.checks import check_packing

    apart = {"name": "custom", "kind": "custom", "_target_": "tests.test_chat.positions_only", "apart": True}
    for node in (apart, {"name": "hf", "kind": "hf", "path": str(chat.qwen2)},
                 {"name": "hf", "kind": "hf", "path": str(chat.qwen2), "attn_implementation": "eager"}):
        assert refused_by(check_packing, resolve_model(to_config({"model": node}).model)) is None, node
    across = resolve_model(to_config({"model": {**apart, "apart": False}}).model)
    assert "data.packing" in refused_by(check_packing, across)


def chat_case(chat, path, **overrides) -> dict:
    """One epoch of every conversation at lr 0, a micro-batch of one row per step."""
    return with_overrides(case("ddp", steps=0), **{
        "model__vocab_size": VOCAB, "model__seq_len": 512, "data__name": "chat", "data__path": str(path),
        "data__tokenizer": str(chat.tokenizer), "data__cache_dir": str(chat.cache), "train__micro_batch_size": 1,
        "optim__lr": 0.0, **overrides})


@pytest.fixture(scope="module")
def epochs(chat):
    """Epochs of the reference model and of a Qwen2 model, packed and padded (the reference model
    evaluated on the same conversations); and of the reference model on the longer ones."""
    qwen2 = {"name": "hf", "kind": "hf", "path": str(chat.qwen2), "seq_len": 256, "vocab_size": VOCAB}
    cfgs = {"packed": chat_case(chat, chat.data, data__val_path=str(chat.data)),
            "padded": chat_case(chat, chat.data, data__val_path=str(chat.data), data__packing=False),
            "longer_context": chat_case(chat, chat.longer_context),
            "longer_answers": chat_case(chat, chat.longer_answers),
            "hf_packed": {**chat_case(chat, chat.data), "model": qwen2},
            "hf_padded": {**chat_case(chat, chat.data, data__packing=False), "model": qwen2}}
    on_ranks(1, train_cases, cfgs, str(chat.root / "runs"))
    return chat.root / "runs"


def summed_loss(run_dir) -> tuple[float, int, int]:
    """(sum of the token losses, target tokens, steps) of the run's records (a step each)."""
    steps = [r for r in records(run_dir) if "tokens" in r]  # not the evaluations
    tokens = [0] + [r["tokens"] for r in steps]
    return sum(r["loss"] * (t - before) for r, before, t in zip(steps, tokens, tokens[1:])), tokens[-1], len(steps)


def val_loss(run_dir) -> float:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return next(r["loss"] for r in lines if r.get("split") == "val")


@pytest.mark.parametrize("model", ["", "hf_"])
def test_packed_and_padded_rows_give_the_same_loss_on_the_same_targets(epochs, model):
    packed_loss, packed_tokens, packed_rows = summed_loss(epochs / f"{model}packed")
    padded_loss, padded_tokens, padded_rows = summed_loss(epochs / f"{model}padded")
    assert packed_tokens == padded_tokens > 0
    assert math.isclose(packed_loss, padded_loss, rel_tol=PACKED_RTOL), (packed_loss, padded_loss)
    assert packed_rows < padded_rows / 2  # a row (and a step) per conversation when padded
    if not model:  # evaluation too
        assert math.isclose(val_loss(epochs / "packed"), val_loss(epochs / "padded"), rel_tol=PACKED_RTOL)


def test_a_packed_hf_model_given_no_position_ids_misses_the_padded_loss_by_more_than_the_tolerance(chat):
    """The negative control of the hf_ case above: the same conversations and targets, packed and padded,
    through the same Qwen2 model. With position_ids the summed losses agree within PACKED_RTOL; withheld,
    attention crosses conversations and they differ by more, so that test would see it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.data import load_data

    config = AutoConfig.from_pretrained(str(chat.qwen2))
    config.use_cache = False  # as the trainer builds it: no cache, so transformers reads packing from position_ids
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    qwen2 = {"name": "hf", "kind": "hf", "path": str(chat.qwen2), "seq_len": 256, "vocab_size": VOCAB}

    def summed_loss(packing: bool, positions: bool = True) -> float:
        rows, _ = load_data(to_config({**chat_case(chat, chat.data, data__packing=packing), "model": qwen2}), 0)
        x, y, *position_ids = (torch.stack(column) for column in zip(*rows))  # every row in one batch
        with torch.no_grad():
            logits = model(x, **({"position_ids": position_ids[0]} if position_ids and positions else {})).logits
        return F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX, reduction="sum").item()

    padded, packed, crossing = summed_loss(False), summed_loss(True), summed_loss(True, positions=False)
    assert math.isclose(packed, padded, rel_tol=PACKED_RTOL), (packed, padded)
    assert abs(crossing - padded) > 10 * PACKED_RTOL * padded, (crossing, padded)


def test_only_the_assistants_tokens_count_as_targets(epochs):
    tokens = {name: summed_loss(epochs / name)[1] for name in ("packed", "longer_context", "longer_answers")}
    assert tokens["longer_context"] == tokens["packed"], "user and system text must not be targets"
    assert tokens["longer_answers"] > 2 * tokens["packed"]


BAD_CHAT = {
    "no template": ([], ["data.chat_template", "has no chat template", "data.chat_template=FILE.jinja"]),
    "no template file": (["data.chat_template={root}/nowhere.jinja"], ["data.chat_template: no file"]),
    "content not rendered": (["data.chat_template={root}/upper.jinja"],
                             ["data.path", "row 1: the content of message 1", "not in the chat template's rendering"]),
    "completion of messages": (["data.tokenizer={tok}", "data.train_on=completion"],
                               ["data.train_on", "needs prompt + completion rows"]),
    "no conversations": (["data.tokenizer={tok}", "data.path={root}/text.jsonl"],
                         ["data.path", "neither a `messages` column nor `prompt` + `completion`", "columns: text"]),
    "custom model packed": (["data.tokenizer={tok}", "model=custom", "model._target_=examples.toy_model.build",
                             "+model.vocab=512", "strategy.wrap=[ToyBlock]"],
                            ["data.packing", "takes none", "position_ids", "data.packing=false"]),
    "custom model attends across": (["data.tokenizer={tok}", "model=custom",
                                     "model._target_=tests.test_chat.positions_only", "strategy.wrap=[Linear]"],
                                    ["data.packing: packed conversations need a model whose attention stays within "
                                     "each", "tests.test_chat.positions_only gives two sequences packed in one row "
                                     "other logits than each alone", "data.packing=false"]),
    "hf model attends across": (["data.tokenizer={tok}", "model=hf", "model.path={root}/opt"],
                                ["data.packing: packed conversations need a model whose attention stays within each",
                                 "the sdpa attention of", "opt gives two sequences packed in one row other logits",
                                 "data.packing=false"]),
    "train_on elsewhere": (["data=hf", "data.train_on=all"], ["data.train_on", "only read by data=chat"]),
    "bad_rows elsewhere": (["data=hf", "data.bad_rows=skip"], ["data.bad_rows", "only read by data=chat"]),
    "template moves the system prompt": (["data.chat_template={root}/moves_system.jinja", "data.path={root}/two.jsonl"],
                                         ["data.chat_template: the chat template renders the conversation of row 0",
                                          "does not begin its whole rendering"]),
    "drop_long when packed": (["data=hf", "data.drop_long=true"], ["data.drop_long", "data.packing=false"]),
}


@pytest.mark.parametrize("name", list(BAD_CHAT))
def test_bad_chat_settings_are_refused_before_any_rank_starts(chat, tmp_path, name):
    (tmp_path / "upper.jinja").write_text(CHAT_TEMPLATE.replace("message['content']", "message['content'] | upper"))
    # Row 0 survives the upper-casing template; row 1 does not.
    write_rows(tmp_path / "rows.jsonl", [{"messages": [message("user", "HI"), message("assistant", "OK")]},
                                         {"messages": [message("user", "Hi"), message("assistant", "Ok")]}])
    write_rows(tmp_path / "text.jsonl", [{"text": "no conversation here"}])
    (tmp_path / "moves_system.jinja").write_text(MOVES_SYSTEM)
    from transformers import OPTConfig  # learned positions from the row, not from position_ids

    OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
              word_embed_proj_dim=32, max_position_embeddings=128).save_pretrained(str(tmp_path / "opt"))
    write_rows(tmp_path / "two.jsonl", [{"messages": TWO_TURNS}])
    overrides, fragments = BAD_CHAT[name]
    args = [o.format(root=tmp_path, tok=chat.tokenizer) for o in overrides]
    args += ["data=chat"] if not any(a.startswith("data=") for a in args) else []
    args += [f"{key}={value}" for key, value in (("data.path", tmp_path / "rows.jsonl"),
                                                 ("data.tokenizer", chat.no_template)) if f"{key}=" not in str(args)]
    args += ["model.vocab_size=512", f"data.cache_dir={chat.cache}"]
    message_ = refusal(tmp_path, *args)
    for fragment in fragments:
        assert fragment in message_, message_
