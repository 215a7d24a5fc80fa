"""data=preference: {prompt, chosen, rejected} rows for objective=dpo, tokenised as TRL 1.16's
DPOTrainer does, and the rows that put a pair's two sequences through the model in one forward.

Tokens (TRL's `_prepare_dataset`): a row of message lists (TRL's conversational format) renders
the prompt with the generation prompt, and prompt + chosen, prompt + rejected whole, with the chat
template (`data.chat_template` or the tokenizer's); a row of strings tokenises prompt,
prompt + chosen + EOS and prompt + rejected + EOS with the tokenizer's own special tokens. The
response begins where the tokens of the prompt alone and those of prompt + response first differ
(the shorter of the two pairs' common prefixes), and runs to the end: its tokens, the end-of-turn
token and whatever the template renders after it, are the targets. In the token cache a pair is
two documents in a row, prompt + chosen then prompt + rejected, each with its target mask. Rows of
`{chosen, rejected}` alone (hh-rlhf's: the prompt inside both) have their prompt cut off first, as
TRL's `extract_prompt` does for a dataset without a `prompt` column (`implicit_prompt`).

Rows: each sequence is cut to its first `seq_len + 1` tokens (TRL's `max_length`, keep_start),
a response cut so is counted (or its pair dropped: `data.drop_long`), and a pair whose prompt
leaves either response no token is left out (TRL drops those too). A row is `2 x seq_len` wide
and holds whole pairs, chosen then rejected, position ids restarting at each sequence (attention
stays within it; padding's positions stay below `seq_len` too); packed, as many pairs as fit, else
one pair per row. Each position also carries the number of its sequence in the split (2 p for pair
p's chosen, 2 p + 1 for its rejected, -1 for padding), so the objective can sum each sequence's log-probabilities and find its reference.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from trainer.data.chat import Conversations
from trainer.data.sources import DocumentRows, Tokens, packed_row_starts
from trainer.data.tokenized import BadRow, Document
from trainer.errors import ConfigError

COLUMNS = ("prompt", "chosen", "rejected")


def common_prefix(a: Sequence, b: Sequence) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def implicit_prompt(chosen, rejected) -> tuple:
    """(prompt, chosen, rejected) of a row whose prompt is inside both responses (strings, or lists
    of messages): what they share at the start, as TRL 1.16's `extract_prompt` cuts it (a string
    gives the space before the first difference to the responses; where one response is the
    other's start, the last shared item goes to them)."""
    shared, shortest = common_prefix(chosen, rejected), min(len(chosen), len(rejected))
    if shared == shortest:
        cut = max(shortest - 1, 0)
    else:
        cut = shared - 1 if shared and chosen[shared - 1] == " " else shared
    return chosen[:cut], chosen[cut:], rejected[cut:]


def is_messages(value) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                           and isinstance(m.get("content"), str) for m in value)


class PreferencePairs:
    """data=preference's encoding (trainer/data/tokenized.py): two documents per row."""
    name, what, has_targets = "preference", "preference pairs", True

    def __init__(self, template_file: str | None):
        self.template = Conversations("assistant", template_file).template  # None: the tokenizer's own

    def key(self) -> dict:
        return {"rows": "preference", "chat_template": self.template}

    def check(self, dataset, tokenizer, path: Path) -> None:
        missing = [c for c in COLUMNS[1:] if c not in dataset.column_names]
        if missing:
            raise ConfigError(f"data.path: {path} has no {', '.join(f'`{c}`' for c in missing)} column; a preference "
                              f"row is {{prompt, chosen, rejected}} (or {{chosen, rejected}} with the prompt inside "
                              f"both); columns: {', '.join(dataset.column_names)}")
        conversational = len(dataset) > 0 and isinstance(dataset[0]["chosen"], list)
        if conversational and self.template is None and not tokenizer.chat_template:
            raise ConfigError(f"data.chat_template: the tokenizer {tokenizer.name_or_path} has no chat template to "
                              f"render the conversations of {path}; give one: data.chat_template=FILE.jinja")

    def encode(self, tokenizer, rows: dict[str, list], first: int) -> list[Document | BadRow]:
        out = []
        for j in range(len(rows["chosen"])):
            row = {c: rows[c][j] for c in COLUMNS if c in rows}
            if "prompt" not in row:
                row = dict(zip(COLUMNS, implicit_prompt(row["chosen"], row["rejected"])))
            try:
                out += self.pair(tokenizer, row, first + j)
            except BadRow as bad:
                out.append(bad)
        return out

    def pair(self, tokenizer, row: dict, index: int) -> list[Document]:
        prompt, chosen, rejected = (row[c] for c in COLUMNS)
        if all(isinstance(v, str) for v in (prompt, chosen, rejected)):
            eos = tokenizer.eos_token
            prompt_ids = tokenizer(prompt)["input_ids"]
            sequences = [tokenizer(prompt + r + ("" if r.endswith(eos) else eos))["input_ids"] for r in (chosen, rejected)]
        elif all(is_messages(v) for v in (prompt, chosen, rejected)):
            prompt_ids = self.render(tokenizer, prompt, index, add_generation_prompt=True)
            sequences = [self.render(tokenizer, prompt + r, index) for r in (chosen, rejected)]
        else:
            raise BadRow(index, "prompt, chosen and rejected must all be strings or all lists of {role, content} "
                                "messages")
        n_prompt = min(common_prefix(prompt_ids, ids) for ids in sequences)
        return [(ids, [0] * n_prompt + [1] * (len(ids) - n_prompt)) for ids in sequences]

    def render(self, tokenizer, messages: list[dict], index: int, add_generation_prompt: bool = False) -> list[int]:
        try:
            encoded = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                    add_generation_prompt=add_generation_prompt,
                                                    chat_template=self.template)
        except Exception as e:  # the template's own refusal (raise_exception), or a field it lacks
            raise BadRow(index, f"the chat template cannot render it ({type(e).__name__}: "
                                f"{str(e).splitlines()[0] if str(e) else ''})") from None
        return list(encoded["input_ids"])


class PairRows(DocumentRows):
    """Rows of whole pairs (see the top): (inputs, targets, position_ids, sequence), each `2 x seq_len`.
    `long`: the pairs with a sequence longer than `seq_len + 1` tokens; `untargeted`: pairs left out
    for a response with no token in the row."""

    def __init__(self, tokens: Tokens, seq_len: int, vocab_size: int, pad_id: int, drop_long: bool = False,
                 packing: bool = True):
        self.ids, self.targets = tokens.ids, tokens.targets
        self.seq_len, self.vocab_size, self.pad_id = seq_len, vocab_size, pad_id
        starts = tokens.doc_starts.astype(np.int64)
        ends = np.append(starts[1:], len(tokens.ids))
        long = ends - starts > seq_len + 1
        ends = np.minimum(ends, starts + seq_len + 1)
        seen = np.concatenate([[0], np.cumsum(tokens.targets, dtype=np.int64)])
        has_target = seen[ends] - seen[np.minimum(starts + 1, ends)] > 0
        pair_long, pair_targeted = long.reshape(-1, 2).any(1), has_target.reshape(-1, 2).all(1)
        keep = pair_targeted & ~(pair_long & drop_long)
        self.pairs = np.flatnonzero(keep)  # pair numbers in the split, kept
        self.n_pairs = len(keep)
        self.spans = np.stack([starts, ends], axis=1).reshape(-1, 2, 2)  # [pair, chosen|rejected, start|end]
        self.long, self.untargeted = int(pair_long.sum()), int((~pair_targeted).sum())
        widths = (ends - starts - 1).reshape(-1, 2).sum(1)[self.pairs]  # the positions a pair fills
        self.row_starts = packed_row_starts(widths.tolist(), 2 * seq_len) if packing else list(range(len(widths) + 1))
        # a TRL user counts pairs (per_device_train_batch_size); a sample here is a row
        self.sample_words = (f" (rows of {2 * seq_len} tokens holding {len(self.pairs):,} pairs packed; "
                             "train.micro_batch_size counts rows: data.packing=false makes each row one pair)"
                             if packing and len(self) < len(self.pairs) else "")

    def __len__(self) -> int:
        return len(self.row_starts) - 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        width = 2 * self.seq_len
        x = torch.full((width,), self.pad_id, dtype=torch.long)
        y = torch.full((width,), -100, dtype=torch.long)
        position_ids, sequence = torch.empty(width, dtype=torch.long), torch.full((width,), -1, dtype=torch.long)
        at = 0
        for p in self.pairs[self.row_starts[i]:self.row_starts[i + 1]]:
            for k in range(2):
                start, end = (int(v) for v in self.spans[p, k])
                inputs, targets = self.inputs_and_targets(start, end, f"pair {p}")
                n = len(inputs)
                x[at:at + n], y[at:at + n] = inputs, targets
                position_ids[at:at + n], sequence[at:at + n] = torch.arange(n), 2 * int(p) + k
                at += n
        # padding (no target, no sequence) in runs of at most seq_len: its positions stay within the
        # model's position table (the built-in model's, GPT-2's n_positions), as a row is 2 x seq_len wide
        position_ids[at:] = torch.arange(width - at) % self.seq_len
        return x, y, position_ids, sequence


def split_pairs(tokens: Tokens, fraction: float) -> tuple[Tokens, Tokens]:
    """(kept, held out): the last `fraction` of the pairs (a pair is two documents, never cut apart)."""
    n_pairs = len(tokens.doc_starts) // 2
    first_held = n_pairs - int(round(n_pairs * fraction))
    if first_held >= n_pairs:
        first_held = n_pairs - 1
    cut = int(tokens.doc_starts[2 * first_held])
    return (Tokens(tokens.ids[:cut], tokens.doc_starts[:2 * first_held], tokens.targets[:cut], tokens.bad_rows),
            Tokens(tokens.ids[cut:], tokens.doc_starts[2 * first_held:] - cut, tokens.targets[cut:]))
