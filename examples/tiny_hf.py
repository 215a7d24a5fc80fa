"""A tiny Hugging Face model folder, a tokenizer and text data, made on the spot (no hub needed):

    python examples/tiny_hf.py demo

writes demo/qwen2/ (config.json, model.safetensors, tokenizer files), demo/train.jsonl (about
600 paragraphs of the bundled license texts) and demo/train.bin (the same text as uint16 token
ids). The tests build their models with the same functions.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

import trainer.distributed  # noqa: F401  (tells DeepSpeed, which transformers imports, the device)

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
BLOCKS = {"qwen2": "Qwen2DecoderLayer", "gpt_neox": "GPTNeoXLayer"}


def documents() -> list[str]:
    """Paragraphs of the bundled license texts: ~1,000 documents of very different lengths."""
    from trainer.data.sources import bundled_text

    paragraphs = [p.strip() for p in bundled_text().decode().split("\n\n")]
    return [p for p in paragraphs if len(p) > 20]


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def train_tokenizer(out: Path, texts: list[str], vocab: int = VOCAB) -> Path:
    """A byte-level BPE with an EOS token, saved as a Hugging Face tokenizer folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(str(out))
    return out


def make_model_dir(out: Path, family: str, weights: bool, tokenizer: Path | None = None, seed: int = 0) -> Path:
    """A Hugging Face model folder: config.json, and model.safetensors when `weights`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(FAMILIES[family])
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

    texts = documents()
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(out / "tokenizer", texts)
    model = make_model_dir(out / "qwen2", "qwen2", weights=True, tokenizer=tokenizer)
    write_jsonl(out / "train.jsonl", texts)
    tok = AutoTokenizer.from_pretrained(str(tokenizer))
    ids = [i for text in texts for i in tok(text)["input_ids"] + [tok.eos_token_id]]
    np.asarray(ids, dtype=np.uint16).tofile(out / "train.bin")
    print(f"{model}: a Qwen2-shaped model ({VOCAB} tokens, tied embeddings) with its weights and tokenizer\n"
          f"{out / 'train.jsonl'}: {len(texts)} documents; {out / 'train.bin'}: {len(ids):,} uint16 token ids")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python examples/tiny_hf.py OUT_DIR")
    main(Path(sys.argv[1]))
