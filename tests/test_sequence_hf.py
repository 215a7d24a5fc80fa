"""Sequence parallelism (strategy.sp) for model=hf: Hugging Face families attend through Ulysses
(trainer/models/hf_sequence.py). On 2 gloo ranks without the loop: logits and gradients of the whole
model; through the trainer: one rank's fp32 losses on every strategy, packed conversations kept
apart; and what cannot be split is refused before any rank starts (single process, fast)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from tests.harness import (
    assert_close,
    case,
    crossings,
    losses,
    on_ranks,
    records,
    refused_by,
    train_cases,
    with_overrides,
)
from tests.test_chat import PACKED_RTOL, chat, chat_case, summed_loss  # noqa: F401 (chat: the fixture)
from trainer.demo import FAMILIES, VOCAB

SEQ = 16  # tokens of a whole row; each of 2 ranks holds 8
# Two packed documents per row (positions restart at 0): attention must stay within each.
PACKED = torch.cat([torch.arange(11), torch.arange(5)])


def model_config(path: str):
    from trainer.config import ModelConfig

    return ModelConfig(name="hf", kind="hf", path=path, seq_len=SEQ)


def logits_and_grads(model, ids, positions, targets):
    """(logits, every parameter's gradient) of the summed token loss of `ids`."""
    logits = model(ids, position_ids=positions).logits
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def rows(vocab: int):
    """Two rows of SEQ tokens (ids, targets) and their positions: plain, and two packed documents."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, SEQ + 1), generator=generator)
    return ids[:, :-1], ids[:, 1:], {"plain": torch.arange(SEQ).expand(2, SEQ), "packed": PACKED.expand(2, SEQ)}


def sharded_against_whole(env, path: str) -> dict[str, float]:
    """On each of 2 ranks: the model built for sp=2 (Ulysses attention) runs this rank's half of the
    tokens inside `sharded(...)`; its logits and gradients, joined over the ranks, against the
    model built as at sp=1 running the whole rows (same weights). The largest relative differences."""
    import torch.distributed as dist

    from trainer.models import hf, sequence

    cfg = model_config(path)
    torch.manual_seed(0)
    whole = hf.builder(cfg)()
    split = hf.builder(cfg, sp=2)()
    assert split.config._attn_implementation != whole.config._attn_implementation
    split.load_state_dict(whole.state_dict())
    group = sequence.SequenceGroup(dist.group.WORLD, 2, dist.get_rank())
    ids, targets, positions = rows(whole.config.vocab_size)
    found = {}
    for kind, position_ids in positions.items():
        whole.zero_grad(), split.zero_grad()
        expected_logits, expected_grads = logits_and_grads(whole, ids, position_ids, targets)
        with sequence.sharded(group, position_ids if kind == "packed" else None):
            logits, grads = logits_and_grads(split, group.local(ids), group.local(position_ids), group.local(targets))
        gathered = [torch.empty_like(logits) for _ in range(2)]
        dist.all_gather(gathered, logits)
        for g in grads.values():  # each rank's gradient is its own tokens' share: the sum is the whole rows'
            dist.all_reduce(g)
        found[f"{kind} logits"] = float((torch.cat(gathered, 1) - expected_logits).abs().max()
                                        / expected_logits.abs().max())
        found[f"{kind} grads"] = max(float((grads[n] - e).abs().max() / e.abs().max().clamp_min(1e-30))
                                     for n, e in expected_grads.items())
    return found


TRANSFORMERS = tuple(int(n) for n in transformers.__version__.split(".")[:2])
FALCON = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=False,
              max_position_embeddings=128)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "gpt_neox", pytest.param("falcon", marks=pytest.mark.skipif(
    TRANSFORMERS < (5, 25), reason="Falcon attends through transformers' attention functions from 5.25 on"))])
def test_hf_attention_split_over_two_ranks_gives_the_whole_models_logits_and_gradients(hf_assets, family, tmp_path):
    """Qwen2 (grouped-query attention: 8 query heads, 4 key/value heads, so that a rank's 4 query heads
    need its 2 key/value heads repeated), GPT-NeoX (partial rotary, parallel residual) and Falcon
    (multi-query: one key/value head, sent whole), on 2 gloo ranks: plain rows and rows of two packed
    documents."""
    from trainer.demo import make_model_dir

    if family == "falcon":
        torch.manual_seed(0)
        path = tmp_path / family
        AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **FALCON)).save_pretrained(str(path))
    elif family == "qwen2":
        path = make_model_dir(tmp_path, family, weights=True, num_attention_heads=8, num_key_value_heads=4)
    else:
        path = hf_assets.pretrained[family]
    found = on_ranks(2, sharded_against_whole, str(path))
    for rank, differences in found.items():
        for what, difference in differences.items():
            assert difference < 1e-5, (family, rank, what, difference)


# -- what cannot be split is refused, in one line, before any rank starts -------------------------

TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)


class BuiltConfig(PretrainedConfig):
    """A causal LM built for the refusals: one attention layer that attends as `attention` says.
    - "interface": through transformers' attention functions (AttentionInterface), as Llama does;
    - "classes of its own": a class of its own per implementation name, any other name a KeyError (Falcon
      up to transformers 5.24: its sdpa and eager classes);
    - "sdpa itself": torch's scaled_dot_product_attention called whatever the implementation."""

    model_type = "trainer_test_attention"

    def __init__(self, vocab_size=128, hidden_size=32, num_attention_heads=4, attention="interface", **kwargs):
        self.vocab_size, self.hidden_size, self.num_attention_heads = vocab_size, hidden_size, num_attention_heads
        self.attention = attention
        super().__init__(**kwargs)


class BuiltAttention(nn.Module):
    def __init__(self, config: BuiltConfig):
        super().__init__()
        self.config, self.heads, self.is_causal = config, config.num_attention_heads, True
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)

    def forward(self, x):
        q, k, v = (y.unflatten(-1, (self.heads, -1)).transpose(1, 2) for y in self.qkv(x).chunk(3, dim=-1))
        how, implementation = self.config.attention, self.config._attn_implementation
        if how == "sdpa itself":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
        if how == "classes of its own" and implementation not in ("sdpa", "eager"):
            raise KeyError(implementation)
        return ALL_ATTENTION_FUNCTIONS[implementation](self, q, k, v, None, dropout=0.0, scaling=None)[0].flatten(2)


class BuiltForCausalLM(PreTrainedModel):
    config_class = BuiltConfig
    _supports_sdpa = True

    def __init__(self, config: BuiltConfig):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.attention = BuiltAttention(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids, position_ids=None, **kwargs):
        return CausalLMOutput(logits=self.lm_head(self.attention(self.embed(input_ids))))


class BuiltNoSdpaConfig(BuiltConfig):
    """Its class says it has no SDPA attention (Bloom, Gemma 2 and gpt-oss in transformers 5.24)."""

    model_type = "trainer_test_no_sdpa"


class BuiltNoSdpaForCausalLM(BuiltForCausalLM):
    config_class = BuiltNoSdpaConfig
    _supports_sdpa = False


for _config, _model in ((BuiltConfig, BuiltForCausalLM), (BuiltNoSdpaConfig, BuiltNoSdpaForCausalLM)):
    AutoConfig.register(_config.model_type, _config, exist_ok=True)
    AutoModelForCausalLM.register(_config, _model, exist_ok=True)

# A family's config (over TINY) or a built model's (BuiltConfig's `attention`), model.attn_implementation,
# strategy.sp -> the refusal's words
REFUSALS = {
    "eager": ("qwen2", {}, "eager", 2, "model.attn_implementation=eager is not taken"),
    "heads": ("qwen2", {}, "sdpa", 8, "its 4 attention heads do not divide among 8 ranks"),
    "attention dropout": ("qwen2", {"attention_dropout": 0.1}, "sdpa", 2, "attention dropout 0.1"),
    "sliding window": ("mistral", {"sliding_window": 8}, "sdpa", 2, "sliding window of 8 tokens is shorter"),
    "no sdpa": (BuiltNoSdpaConfig, {}, "sdpa", 2, "attention without SDPA"),
    "attention classes of its own": (BuiltConfig, {"attention": "classes of its own"}, "sdpa", 2,
                                     "does not run with its attention replaced"),
    "sdpa called itself": (BuiltConfig, {"attention": "sdpa itself"}, "sdpa", 2,
                           "does not go through transformers' attention functions"),
}


def family_dir(root, family: str | type, config: dict):
    """A model folder (config.json) of a transformers family by name, or of a built config class."""
    (AutoConfig.for_model(family, **{**TINY, **config}) if isinstance(family, str)
     else family(**config)).save_pretrained(str(root))
    return root


@pytest.mark.parametrize("name", list(REFUSALS))
def test_what_ulysses_cannot_split_is_refused_in_one_line(tmp_path, name):
    from trainer.config import ModelConfig
    from trainer.errors import ConfigError
    from trainer.models.checks import check_hf_sequence_parallel

    family, config, attention, sp, words = REFUSALS[name]
    cfg = ModelConfig(name="hf", kind="hf", path=str(family_dir(tmp_path, family, config)), seq_len=SEQ,
                      attn_implementation=attention)
    with pytest.raises(ConfigError) as refused:
        check_hf_sequence_parallel(cfg, sp)
    assert words in str(refused.value) and "\n" not in str(refused.value), str(refused.value)


def test_a_model_attending_through_the_interface_passes_the_check(tmp_path):
    """The built model of the refusals, attending through transformers' attention functions: nothing to
    refuse, so each refusal above is its attention's doing."""
    from trainer.config import ModelConfig
    from trainer.models.checks import check_hf_sequence_parallel

    path = family_dir(tmp_path, BuiltConfig, {})
    assert refused_by(check_hf_sequence_parallel, ModelConfig(name="hf", kind="hf", path=str(path), seq_len=SEQ),
                      2) is None


def test_families_ulysses_splits_pass_the_check(tmp_path):
    """Llama (rotary, GQA) and Mistral with its window longer than the rows: nothing to refuse."""
    from trainer.config import ModelConfig
    from trainer.models.checks import check_hf_sequence_parallel

    for family, config in (("llama", {}), ("mistral", {"sliding_window": 64})):
        path = family_dir(tmp_path / family, family, config)
        assert refused_by(check_hf_sequence_parallel, ModelConfig(name="hf", kind="hf", path=str(path),
                                                                  seq_len=SEQ), 2) is None, family


# -- the trainer: fp32 losses at sp=2 are one rank's with the same global batch ----------------------

STRATEGIES = ("ddp", "fsdp", "zero1", "zero2", "zero3")
GLOBAL_BATCH = 8  # rows per step: 1 rank x 8, sp=2 (dp=1) x 8, dp=2 x sp=2 x 4


def hf_case(path, strategy: str, sp: int, micro: int) -> dict:
    """Synthetic rows of 32 tokens for a Hugging Face model folder, 6 steps."""
    cfg = with_overrides(case(strategy, steps=6), strategy__sp=sp, train__micro_batch_size=micro,
                         data__name="synthetic", data__num_samples=512, optim__lr=1e-2)
    return {**cfg, "model": {"name": "hf", "kind": "hf", "path": str(path), "seq_len": 32, "vocab_size": VOCAB}}


# Each family on two or three strategies, each strategy on one family (crossings(), tests/harness.py):
# the attention split is the family's, the gradients' reduction the strategy's.
SP2 = crossings((list(FAMILIES), list(STRATEGIES)), [("qwen2", "ddp"), ("qwen2", "zero1"), ("qwen2", "zero3"),
                                                     ("gpt_neox", "fsdp"), ("gpt_neox", "zero2")])


@pytest.fixture(scope="module")
def trained(hf_assets, chat, tmp_path_factory):  # noqa: F811
    """Each family at one rank and at sp=2 on the strategies SP2 pairs it with (one launch of 2 ranks), Qwen2 at dp=2 x sp=2
    on zero3; one epoch of packed chat rows at sp=2 and of padded ones at sp=1, for a Qwen2 model."""
    out = tmp_path_factory.mktemp("hf_sp")
    qwen2 = {"name": "hf", "kind": "hf", "path": str(chat.qwen2), "seq_len": 256, "vocab_size": VOCAB}
    ones = {f"{f}_baseline": hf_case(hf_assets.pretrained[f], "ddp", 1, GLOBAL_BATCH) for f in FAMILIES}
    twos = {f"{f}_{s}_sp2": hf_case(hf_assets.pretrained[f], s, 2, GLOBAL_BATCH) for f, s in SP2}
    on_ranks(1, train_cases, {**ones, "chat_padded": {**chat_case(chat, chat.data, data__packing=False), "model": qwen2}},
             str(out))
    on_ranks(2, train_cases, {**twos, "chat_packed_sp2": {**chat_case(chat, chat.data, strategy__sp=2), "model": qwen2}},
             str(out))
    on_ranks(4, train_cases, {"qwen2_zero3_dp2_sp2": hf_case(hf_assets.pretrained["qwen2"], "zero3", 2,
                                                             GLOBAL_BATCH // 2)}, str(out))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family, strategy", [*SP2, ("qwen2", "zero3_dp2")])
def test_hf_losses_at_sp2_match_one_rank_on_every_strategy(trained, family, strategy):
    base = records(trained / f"{family}_baseline")
    assert base[-1]["loss"] < base[0]["loss"] - 0.05, "the baseline must learn"  # 6.25 -> 6.08 (Qwen2), 6.23 -> 6.15 (NeoX)
    name = f"{family}_{strategy}_sp2"
    assert_close(losses(records(trained / name)), losses(base), name, rtol=1e-6)
    assert [r["tokens"] for r in records(trained / name)] == [r["tokens"] for r in base], name  # every target once


@pytest.mark.slow
def test_packed_conversations_at_sp2_give_the_padded_loss_at_sp1_for_an_hf_model(trained):
    """One epoch at lr 0 (tests/test_chat.py's packing test): attention never crosses conversations,
    although a rank's share of a packed row starts in the middle of one."""
    packed_loss, packed_tokens, packed_rows = summed_loss(trained / "chat_packed_sp2")
    padded_loss, padded_tokens, padded_rows = summed_loss(trained / "chat_padded")
    assert packed_tokens == padded_tokens > 0
    assert packed_rows < padded_rows / 2
    assert math.isclose(packed_loss, padded_loss, rel_tol=PACKED_RTOL), (packed_loss, padded_loss)
