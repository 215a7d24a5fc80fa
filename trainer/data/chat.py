"""data=chat: conversations rendered with a chat template, and which of their tokens are targets.

Rows are `messages` ([{"role", "content"}, ...], the HF/OpenAI convention) or `prompt` +
`completion` (TRL's: both strings, or both message lists). The targets (`data.train_on`):
- assistant: each assistant message's content and the end-of-turn token after it; system and
  user text and the template's role headers are context only;
- completion (prompt/completion rows): the completion's messages the same way;
- all: every token.

Most templates have no `{% generation %}` markers, so the targets are found in the rendering
itself: the template renders the conversation up to an assistant message with
`add_generation_prompt=True`; where the whole rendering starts with that, the message's content
follows it (else it is searched for after the previous one). The tokens that overlap the
content's characters are targets, and so is the first token after it that is not whitespace
(the end of the turn), with any whitespace before it.
Plain-string prompt/completion rows use no template: prompt + completion + EOS, whose targets
are the completion and EOS.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from trainer.config import TrainOn
from trainer.data.tokenized import BadRow, Document
from trainer.errors import ConfigError


def row_format(columns: list[str], path: Path) -> str:
    """`messages` or `prompt_completion`, from the columns."""
    if "messages" in columns:
        return "messages"
    if {"prompt", "completion"} <= set(columns):
        return "prompt_completion"
    raise ConfigError(f"data.path: {path} has neither a `messages` column nor `prompt` + `completion` columns; "
                      f"columns: {', '.join(columns)}")


def locate(text: str, content: str, start: int) -> tuple[int, int] | None:
    """The characters of `content` in `text` at or after `start`: as given, or stripped (templates
    that trim it)."""
    for needle in (content, content.strip()):
        at = text.find(needle, start)
        if at >= 0:
            return at, at + len(needle)
    return None


def token_targets(text: str, offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token of `text` that overlaps a span, and for the tokens after the span up to
    the first that is not whitespace (the end of the turn); 0 for the others."""
    starts, ends = np.asarray(offsets, dtype=np.int64).reshape(-1, 2).T
    targets = np.zeros(len(starts), dtype=np.uint8)
    for s, e in spans:
        targets[(starts < e) & (ends > s)] = 1
        for k in np.flatnonzero((starts >= e) & (ends > starts)):  # zero-width tokens (a BOS) are no text
            targets[k] = 1
            if text[starts[k]:ends[k]].strip():
                break
    return targets.tolist()


class Conversations:
    """data=chat's encoding (trainer/data/tokenized.py): one document per row, with its targets."""
    name, what, has_targets = "chat", "conversations", True

    def __init__(self, train_on: TrainOn, template_file: str | None):
        self.train_on = TrainOn(train_on)
        self.template = None  # None: the tokenizer's own
        if template_file is not None:
            if not Path(template_file).is_file():
                raise ConfigError(f"data.chat_template: no file {template_file}")
            self.template = Path(template_file).read_text()

    def key(self) -> dict:
        # The row format follows from the data files, which the key holds already.
        return {"rows": "chat", "train_on": self.train_on.value, "chat_template": self.template}

    def check(self, dataset, tokenizer, path: Path) -> None:
        rows = row_format(dataset.column_names, path)
        if self.train_on is TrainOn.completion and rows == "messages":
            raise ConfigError(f"data.train_on: completion needs prompt + completion rows; {path} has `messages` "
                              "(train_on=assistant trains on each assistant message)")
        plain = rows == "prompt_completion" and len(dataset) > 0 and isinstance(dataset[0]["prompt"], str)
        if not plain and self.template is None and not tokenizer.chat_template:
            raise ConfigError(f"data.chat_template: the tokenizer {tokenizer.name_or_path} has no chat template to "
                              f"render the conversations of {path}; give one: data.chat_template=FILE.jinja")

    def encode(self, tokenizer, rows: dict[str, list], first: int) -> list[Document]:
        columns = list(rows)
        return [self.document(tokenizer, {c: rows[c][j] for c in columns}, first + j)
                for j in range(len(rows[columns[0]]))]

    def document(self, tokenizer, row: dict, index: int) -> Document:
        if "messages" in row:
            messages, n_prompt = row["messages"], 0
        else:
            prompt, completion = row["prompt"], row["completion"]
            if isinstance(prompt, str) and isinstance(completion, str):
                return self.plain(tokenizer, prompt, completion)
            if not (isinstance(prompt, list) and isinstance(completion, list)):
                raise BadRow(index, "prompt and completion must both be strings or both lists of messages")
            messages, n_prompt = prompt + completion, len(prompt)
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise BadRow(index, f"message {i} is not {{role, content}} with text content: {str(m)[:80]}")
        text = tokenizer.apply_chat_template(messages, tokenize=False, chat_template=self.template)
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)  # the template has its BOS
        if self.train_on is TrainOn.all:
            return encoded["input_ids"], [1] * len(encoded["input_ids"])
        targets = [i for i, m in enumerate(messages)
                   if (m["role"] == "assistant" if self.train_on is TrainOn.assistant else i >= n_prompt)]
        spans = self.content_spans(tokenizer, messages, targets, text, index)
        return encoded["input_ids"], token_targets(text, encoded["offset_mapping"], spans)

    def content_spans(self, tokenizer, messages: list[dict], targets: list[int], text: str,
                      index: int) -> list[tuple[int, int]]:
        """Where in the rendering `text` the content of each target message is."""
        spans, cursor = [], 0
        for i in targets:
            try:
                before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True,
                                                       chat_template=self.template)
            except Exception:  # a template may refuse a conversation cut there (one that ends with a user)
                before = None
            start = len(before) if before and text.startswith(before) else cursor
            span = locate(text, messages[i]["content"], start)
            if span is None:
                raise BadRow(index, f"the content of message {i} ({messages[i]['content'][:60]!r}) is not in the "
                                    "chat template's rendering, so its tokens cannot be found")
            spans.append(span)
            cursor = span[1]
        return spans

    def plain(self, tokenizer, prompt: str, completion: str) -> Document:
        """prompt + completion + EOS, with the tokenizer's own special tokens (as data=hf)."""
        text = prompt + completion
        encoded = tokenizer(text, add_special_tokens=True, return_offsets_mapping=True)
        ids = encoded["input_ids"]
        if self.train_on is TrainOn.all:
            targets = [1] * len(ids)
        else:
            starts, ends = np.asarray(encoded["offset_mapping"], dtype=np.int64).reshape(-1, 2).T
            targets = ((ends > len(prompt)) & (starts < len(text))).astype(np.uint8).tolist()
        if not ids or ids[-1] != tokenizer.eos_token_id:
            ids, targets = ids + [tokenizer.eos_token_id], targets + [0]
        targets[-1] = 1  # EOS ends the completion (the tokenizer's own, too)
        return ids, targets
