"""data=chat: conversations rendered with a chat template, and which of their tokens are targets.

Rows are `messages` ([{"role", "content"}, ...], the HF/OpenAI convention) or `prompt` +
`completion` (TRL's: both strings, or both message lists). The targets (`data.train_on`):
- assistant: each assistant message's content and the end-of-turn token after it; system and
  user text and the template's role headers are context only;
- completion (prompt/completion rows): the completion's messages the same way;
- all: every token.

Most templates have no `{% generation %}` markers, so the targets are found in the rendering
itself: the template renders the conversation up to an assistant message with
`add_generation_prompt=True` (up to another target message without it), and the message's content
is searched for after that and before the same rendering up to the next target: where the message
is rendered, never in the text around it. That needs a template whose rendering of a
conversation's beginning begins the rendering of the whole; one that does not (that moves the
system prompt, or renders something that changes) is refused, as nothing says where its targets
are. The tokens that overlap the content's characters are targets, and so is the first token after
it that is not whitespace (the end of the turn), with any whitespace before it.
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


def locate(text: str, content: str, start: int, end: int) -> tuple[int, int] | None:
    """The characters of `content` in `text[start:end]`: as given, or stripped (templates that trim it)."""
    for needle in (content, content.strip()):
        at = text.find(needle, start, end)
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

    def encode(self, tokenizer, rows: dict[str, list], first: int) -> list[Document | BadRow]:
        columns = list(rows)
        return [self.row(tokenizer, {c: rows[c][j] for c in columns}, first + j) for j in range(len(rows[columns[0]]))]

    def row(self, tokenizer, row: dict, index: int) -> Document | BadRow:
        try:
            return self.document(tokenizer, row, index)
        except BadRow as bad:
            return bad

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
        text = self.render(tokenizer, messages, index)
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)  # the template has its BOS
        if self.train_on is TrainOn.all:
            return encoded["input_ids"], [1] * len(encoded["input_ids"])
        targets = [i for i, m in enumerate(messages)
                   if (m["role"] == "assistant" if self.train_on is TrainOn.assistant else i >= n_prompt)]
        spans = self.content_spans(tokenizer, messages, targets, text, index)
        return encoded["input_ids"], token_targets(text, encoded["offset_mapping"], spans)

    def content_spans(self, tokenizer, messages: list[dict], targets: list[int], text: str,
                      index: int) -> list[tuple[int, int]]:
        """Where in the rendering `text` the content of each target message is: after the rendering
        of the conversation before it, and before that of the conversation before the next target (the
        last: before the messages after it, where the template renders them as the whole does)."""
        if not targets:
            return []
        starts = [len(self.beginning(tokenizer, messages, i, text, index)) for i in targets]
        through_last = self.render(tokenizer, messages[:targets[-1] + 1], index)
        spans = []
        for i, start, end in zip(targets, starts, starts[1:] + [len(through_last) if text.startswith(through_last)
                                                                else len(text)]):
            span = locate(text, messages[i]["content"], start, end)
            if span is None:
                raise BadRow(index, f"the content of message {i} ({messages[i]['content'][:60]!r}) is not in the "
                                    "chat template's rendering of it, so its tokens cannot be found")
            spans.append(span)
        return spans

    def beginning(self, tokenizer, messages: list[dict], i: int, text: str, index: int) -> str:
        """The rendering of the messages before message i (with the generation prompt, if i is the
        assistant's), which must begin the whole rendering `text`: else the template is refused."""
        before = self.render(tokenizer, messages[:i], index, add_generation_prompt=messages[i]["role"] == "assistant")
        if not text.startswith(before):
            at = next(k for k, (a, b) in enumerate(zip(before, text + "\0")) if a != b)
            key, whose = ("data.chat_template", "the") if self.template else \
                ("data.tokenizer", f"{tokenizer.name_or_path}'s")
            raise ConfigError(f"{key}: {whose} chat template renders the conversation of row {index} up to message "
                              f"{i} as text that does not begin its whole rendering (at character {at}: "
                              f"{before[at:at + 30]!r}, the whole has {text[at:at + 30]!r}): it moves or changes "
                              "earlier text (a system prompt, a date), so where it renders the targets is unknown; "
                              "give a template that renders a conversation's beginning the same in the whole: "
                              "data.chat_template=FILE.jinja")
        return before

    def render(self, tokenizer, messages: list[dict], index: int, add_generation_prompt: bool = False) -> str:
        try:
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                 chat_template=self.template)
        except Exception as e:  # the template's own refusal (raise_exception), or a field it lacks
            raise BadRow(index, f"the chat template cannot render it ({type(e).__name__}: "
                                f"{str(e).splitlines()[0] if str(e) else ''})") from None

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
