"""A tiny Hugging Face model folder, a tokenizer and text data, made on the spot (no hub needed),
from any directory, as the trainer runs (needs the `hf` extra):

    python -m trainer.demo demo

writes demo/qwen2/ (config.json, model.safetensors, tokenizer files), demo/train.jsonl (about
600 paragraphs of the bundled license texts) and demo/train.bin (the same text as uint16 token
ids); for `data=chat`, demo/chat.jsonl (300 conversations made of those paragraphs) and
demo/chat_tokenizer/ (the same kind of tokenizer with ChatML's turn markers and chat template):

    trainer model=hf model.path=demo/qwen2 data=chat data.path=demo/chat.jsonl \
        data.tokenizer=demo/chat_tokenizer

and, for `objective=dpo`, demo/pairs.jsonl (200 preference pairs {prompt, chosen, rejected} as
lists of messages, for the same chat tokenizer).

The tests build their models and data with the same functions.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

import trainer.distributed  # noqa: F401  (tells DeepSpeed, which transformers imports, the device)
from trainer.errors import ConfigError
from trainer.extras import require_hf
from trainer.log import refuse

VOCAB = 512
FAMILIES = {
    # Qwen2: RMSNorm, rotary, grouped-query attention, biases on q/k/v, tied embeddings.
    "qwen2": dict(model_type="qwen2", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  tie_word_embeddings=True),
    # GPT-NeoX: LayerNorm, parallel residual, partial rotary, untied output matrix.
    "gpt_neox": dict(model_type="gpt_neox", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                     num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128,
                     tie_word_embeddings=False),
}
# Mixture-of-experts families: 4 experts, 2 per token. Their checkpoints store one tensor per expert,
# which transformers fuses at load (`experts.gate_up_proj`, `experts.down_proj`); gpt-oss stores them fused.
MOE = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_experts_per_tok=2,
           max_position_embeddings=128, tie_word_embeddings=False)
MOE_FAMILIES = {
    "qwen3_moe": dict(MOE, model_type="qwen3_moe", intermediate_size=64, moe_intermediate_size=16, num_experts=4,
                      num_key_value_heads=2, head_dim=8),
    # Mixtral: the checkpoint names the layer's MoE `block_sparse_moe` and its experts' matrices w1/w2/w3.
    "mixtral": dict(MOE, model_type="mixtral", intermediate_size=16, num_local_experts=4, num_key_value_heads=2),
    # Qwen2-MoE: a shared expert (with its own gate) beside the routed ones.
    "qwen2_moe": dict(MOE, model_type="qwen2_moe", intermediate_size=64, moe_intermediate_size=16, num_experts=4,
                      shared_expert_intermediate_size=32, num_key_value_heads=2),
    "olmoe": dict(MOE, model_type="olmoe", intermediate_size=16, num_experts=4, num_key_value_heads=4,
                  pad_token_id=1, eos_token_id=2),
    # DeepSeek-V3: latent attention, a dense first layer, a shared expert, grouped top-k routing.
    "deepseek_v3": dict(MOE, model_type="deepseek_v3", intermediate_size=64, moe_intermediate_size=16,
                        n_routed_experts=4, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
                        num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
                        qk_nope_head_dim=4, v_head_dim=8, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # gpt-oss: fused experts in the checkpoint too, biases, attention sinks, sliding window layers.
    "gpt_oss": dict(MOE, model_type="gpt_oss", intermediate_size=16, num_local_experts=4, num_key_value_heads=2,
                    head_dim=8, sliding_window=64, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}
BLOCKS = {"qwen2": "Qwen2DecoderLayer", "gpt_neox": "GPTNeoXLayer", "qwen3_moe": "Qwen3MoeDecoderLayer",
          "mixtral": "MixtralDecoderLayer", "qwen2_moe": "Qwen2MoeDecoderLayer", "olmoe": "OlmoeDecoderLayer",
          "deepseek_v3": "DeepseekV3DecoderLayer", "gpt_oss": "GptOssDecoderLayer"}


def documents() -> list[str]:
    """Paragraphs of the bundled license texts: ~1,000 documents of very different lengths."""
    from trainer.data.sources import bundled_text

    paragraphs = [p.strip() for p in bundled_text().decode().split("\n\n")]
    return [p for p in paragraphs if len(p) > 20]


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def bpe(texts: list[str], special_tokens: list[str], vocab: int = VOCAB):
    """A byte-level BPE trained on `texts`, its special tokens first (ids 0, 1, ...)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=special_tokens,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    return tok


def train_tokenizer(out: Path, texts: list[str], vocab: int = VOCAB) -> Path:
    """A byte-level BPE with an EOS token, saved as a Hugging Face tokenizer folder."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=bpe(texts, ["<|endoftext|>"], vocab), eos_token="<|endoftext|>")
    fast.save_pretrained(str(out))
    return out


# ChatML (Qwen's): each turn `<|im_start|>role\ncontent<|im_end|>\n`; <|im_end|> ends the turn.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def train_chat_tokenizer(out: Path, texts: list[str], vocab: int = VOCAB, template: bool = True) -> Path:
    """The BPE above with ChatML's turn markers as special tokens (in the same vocabulary, so it
    fits the models here), <|im_end|> as EOS, and the chat template (unless `template=False`)."""
    from transformers import PreTrainedTokenizerFast

    tok = bpe(texts, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], vocab)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    if template:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return out


SYSTEM_PROMPTS = ["You answer questions about software licenses.",
                  "You are a careful reader of license texts. Quote them; keep to what they say."]
QUESTIONS = ["What comes next?", "Which passage follows this one in the license?",
             "What does the license say after this passage?"]


def shorten(text: str, at_most: int) -> str:
    return text if len(text) <= at_most else text[:at_most].rsplit(" ", 1)[0]


def passage(texts: list[str], start: int, at_most: int) -> str:
    """The paragraphs from `start` on (round the end), joined and cut to `at_most` characters."""
    text, i = texts[start % len(texts)], start + 1
    while len(text) < at_most:
        text, i = text + "\n\n" + texts[i % len(texts)], i + 1
    return shorten(text, at_most)


ANSWER_CHARS = (20, 50, 100)  # the answers' lengths cycle through these caps


def conversations(texts: list[str], n: int = 300, answer_chars: tuple[int, ...] = ANSWER_CHARS) -> list[dict]:
    """`messages` rows from consecutive paragraphs: a system prompt in every third, a question
    (quoting a paragraph in every other one), the text that follows (cut to `answer_chars`, in
    turn) as the answer, and a second exchange in every fifth: with the tokenizers here, from
    about 45 to 140 tokens."""
    rows = []
    for i in range(n):
        question = QUESTIONS[i % len(QUESTIONS)]
        messages = [{"role": "system", "content": SYSTEM_PROMPTS[i % 2]}] if i % 3 == 0 else []
        messages += [{"role": "user",
                      "content": f"{question}\n\n{shorten(texts[i % len(texts)], 40)}" if i % 2 else question},
                     {"role": "assistant", "content": passage(texts, i + 1, answer_chars[i % len(answer_chars)])}]
        if i % 5 == 0:
            messages += [{"role": "user", "content": "And after that?"},
                         {"role": "assistant", "content": shorten(texts[(i + 2) % len(texts)], 30)}]
        rows.append({"messages": messages})
    return rows


def preference_pairs(texts: list[str], n: int = 200, conversational: bool = True) -> list[dict]:
    """{prompt, chosen, rejected} rows (TRL's preference format): a question quoting a paragraph,
    the paragraph that follows as the chosen answer and another, further on, as the rejected one;
    lists of messages, or plain strings (`conversational=False`)."""
    rows = []
    for i in range(n):
        question = f"{QUESTIONS[i % len(QUESTIONS)]}\n\n{shorten(texts[i % len(texts)], 40)}"
        chosen = passage(texts, i + 1, ANSWER_CHARS[i % len(ANSWER_CHARS)])
        rejected = passage(texts, i + 7, ANSWER_CHARS[(i + 1) % len(ANSWER_CHARS)])
        if conversational:
            rows.append({"prompt": [{"role": "user", "content": question}],
                         "chosen": [{"role": "assistant", "content": chosen}],
                         "rejected": [{"role": "assistant", "content": rejected}]})
        else:
            rows.append({"prompt": question + "\n", "chosen": chosen, "rejected": rejected})
    return rows


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def make_model_dir(out: Path, family: str, weights: bool, tokenizer: Path | None = None, seed: int = 0,
                   **config) -> Path:
    """A Hugging Face model folder: config.json (with `config` over the family's), and
    model.safetensors when `weights`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = {**(FAMILIES | MOE_FAMILIES)[family], **config}
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    out.mkdir(parents=True, exist_ok=True)
    if weights:
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(config).save_pretrained(str(out), safe_serialization=True)
    else:
        config.save_pretrained(str(out))
    if tokenizer is not None:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(tokenizer)).save_pretrained(str(out))
    return out


def main(out: Path) -> None:
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Writing model shards" for a model of one small file

    if (out / "pairs.jsonl").is_file():  # the last file written: the folder is whole
        # Written again, every file would get a new time, and each data set a new tokenised cache entry.
        print(f"{out}: already made, left as it is (remove the folder to make it again)")
        return
    texts = documents()
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(out / "tokenizer", texts)
    model = make_model_dir(out / "qwen2", "qwen2", weights=True, tokenizer=tokenizer)
    write_jsonl(out / "train.jsonl", texts)
    tok = AutoTokenizer.from_pretrained(str(tokenizer))
    ids = [i for text in texts for i in tok(text)["input_ids"] + [tok.eos_token_id]]
    np.asarray(ids, dtype=np.uint16).tofile(out / "train.bin")
    chat_tokenizer = train_chat_tokenizer(out / "chat_tokenizer", texts)
    chats = write_rows(out / "chat.jsonl", conversations(texts))
    pairs = write_rows(out / "pairs.jsonl", preference_pairs(texts))
    print(f"{model}: a Qwen2-shaped model ({VOCAB} tokens, tied embeddings) with its weights and tokenizer "
          f"(also alone in {tokenizer})\n"
          f"{out / 'train.jsonl'}: {len(texts)} documents; {out / 'train.bin'}: {len(ids):,} uint16 token ids\n"
          f"{chats}: 300 conversations; {chat_tokenizer}: a tokenizer with a ChatML chat template\n"
          f"{pairs}: 200 preference pairs (prompt, chosen, rejected) for objective=dpo")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m trainer.demo OUT_DIR")
    try:
        require_hf("python -m trainer.demo")
    except ConfigError as e:
        refuse(e, "trainer.demo")
    main(Path(sys.argv[1]))
