"""Preference rows of {chosen, rejected} alone (hh-rlhf's), the prompt inside both:
cut as TRL 1.16's extract_prompt cuts it, then tokenised as the row with that prompt."""
from __future__ import annotations

import pytest

from trainer.data.preference import PreferencePairs, implicit_prompt
from trainer.demo import documents, train_chat_tokenizer

USER = {"role": "user", "content": "What color is the sky?"}
ROWS = [
    {"chosen": "\n\nHuman: What color is the sky?\n\nAssistant: It is blue.",
     "rejected": "\n\nHuman: What color is the sky?\n\nAssistant: It is green."},
    {"chosen": "Say hi. Hello there", "rejected": "Say hi. Go away"},  # the space goes to the responses
    {"chosen": "abc", "rejected": "abcd"},  # one the other's start
    {"chosen": [USER, {"role": "assistant", "content": "It is blue."}],
     "rejected": [USER, {"role": "assistant", "content": "It is green."}]},
]


# what TRL 1.16's trl.data_utils.extract_prompt returns for the rows of strings (read once: importing
# trl takes ~20 s here)
TRL = [("\n\nHuman: What color is the sky?\n\nAssistant: It is", " blue.", " green."),
       ("Say hi.", " Hello there", " Go away"), ("ab", "c", "cd"),
       ([USER], [{"role": "assistant", "content": "It is blue."}], [{"role": "assistant", "content": "It is green."}])]


def test_the_prompt_is_cut_as_trls_extract_prompt_cuts_it():
    for row, trl in zip(ROWS, TRL):
        assert implicit_prompt(row["chosen"], row["rejected"]) == trl, row


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(train_chat_tokenizer(tmp_path_factory.mktemp("tok"), documents())))


def test_a_row_without_a_prompt_gives_the_tokens_of_the_row_with_it(tokenizer):
    encoding = PreferencePairs(None)
    for row in (ROWS[0], ROWS[3]):
        prompt, chosen, rejected = implicit_prompt(row["chosen"], row["rejected"])
        explicit = encoding.encode(tokenizer, {"prompt": [prompt], "chosen": [chosen], "rejected": [rejected]}, 0)
        implicit = encoding.encode(tokenizer, {k: [v] for k, v in row.items()}, 0)
        assert implicit == explicit and len(implicit) == 2 and all(sum(targets) for _, targets in implicit), implicit
