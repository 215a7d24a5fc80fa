"""`objective=dpo` trains without dropout unless told to keep it (TRL's
disable_dropout): the model's nn.Dropout, Hugging Face attention's dropout probability, LoRA's
lora_dropout; and peft.dropout=0 replaces a starting adapter's lora_dropout."""
from __future__ import annotations

import json
from contextlib import nullcontext
from types import SimpleNamespace

import torch

from tests.harness import case, with_overrides
from tests.toys import build
from trainer.config import PeftConfig, to_config
from trainer.models import disable_dropout
from trainer.models.lora import from_init
from trainer.models.sequence import WHOLE_ROWS
from trainer.training.objective import build_objective


def test_a_qwen2_with_attention_dropout_and_lora_dropout_computes_as_in_eval_mode():
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, attention_dropout=0.5, attn_implementation="eager")
    model = inject_adapter_in_model(LoraConfig(r=4, lora_dropout=0.5, target_modules=["q_proj", "v_proj"]),
                                    Qwen2ForCausalLM(config))
    for name, p in model.named_parameters():  # B starts at zero: give the adapters a say
        if "lora_B" in name:
            torch.nn.init.normal_(p)
    ids = torch.arange(24).view(2, 12)
    model.train()
    assert not torch.equal(model(ids).logits, model(ids).logits), "the test model must drop something"
    disable_dropout(model)
    trained = model(ids).logits
    model.eval()
    assert torch.equal(trained, model(ids).logits)


def test_objective_dpo_disables_the_policys_dropout_unless_told_to_keep_it():
    def dropout_after(**objective) -> float:
        cfg = to_config(with_overrides(case("ddp"), objective__name="dpo", data__name="preference",
                                       peft__name="lora", **objective))
        model = build(dropout=0.5)
        build_objective(cfg, model, SimpleNamespace(autocast=nullcontext, layout=SimpleNamespace(sequence=WHOLE_ROWS)), None, None, None)
        return model.dropout.p

    assert dropout_after() == 0.0
    assert dropout_after(objective__disable_dropout=False) == 0.5


def test_peft_dropout_0_replaces_a_starting_adapters_lora_dropout(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "lora_dropout": 0.05, "target_modules": ["q_proj"]}))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    assert from_init(PeftConfig(name="lora", init=str(tmp_path)))["dropout"] == 0.05
    assert from_init(PeftConfig(name="lora", init=str(tmp_path), dropout=0.0))["dropout"] == 0.0
