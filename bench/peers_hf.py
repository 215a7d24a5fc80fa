"""The peers' side of bench/peers.py: HF `Trainer` (text rows) or TRL's `SFTTrainer` (chat, packed),
as their users run them, under torchrun. Not run by hand: bench/peers.py writes the settings file.

    torchrun --nproc_per_node 2 bench/peers_hf.py SETTINGS.json

The optimizer is the Trainer's default (`optim`: torch's fused AdamW from torch 2.8 on). Strategies go
through the Trainer's own switches, which build Accelerate's plugins: ddp (none),
fsdp (`fsdp="full_shard"`, FSDP2 per decoder layer), zero2/zero3 (`deepspeed=` a config of
"auto" values). Rank 0 appends one JSON line per optimizer step to `records` in the settings:
{"step", "loss", "input_tokens" (cumulative, all ranks), "t" (perf_counter at the step's end)},
{"step", "save_s"} after a checkpoint, and first {"event": "setup", "distributed_type", "fsdp",
"deepspeed", "gradient_checkpointing"}: what Accelerate runs (on CPU, fsdp= gives DDP), and
whether the peer checkpoints activations (TRL's SFTConfig does by default).
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch


def strategy_args(strategy: str, block: str) -> dict:
    if strategy == "ddp":
        return {}
    if strategy == "fsdp":
        return {"fsdp": "full_shard", "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": [block],
                                                      "reshard_after_forward": True}}
    stage = {"zero2": 2, "zero3": 3}[strategy]
    # as the Trainer's DeepSpeed guide writes them (ds_config_zero2/3.json): bucket sizes "auto", which
    # the Trainer fills from the model's hidden size (reduce bucket: hidden^2, the trainer's size too);
    # no "optimizer" section: the Trainer's own (its default optim) goes to DeepSpeed as the client optimizer
    sizes = {"reduce_bucket_size": "auto", **({"stage3_prefetch_bucket_size": "auto",
                                                "stage3_param_persistence_threshold": "auto"} if stage == 3 else {})}
    return {"deepspeed": {"zero_optimization": {"stage": stage, **sizes}, "train_micro_batch_size_per_gpu": "auto",
                          "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}}


def main(settings_path: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    s = json.loads(open(settings_path).read())
    rank = int(os.environ.get("RANK", 0))

    class Records(TrainerCallback):
        """Rank 0: a line per optimizer step (and the checkpoint's save time)."""

        def __init__(self):
            self.step_end = 0.0

        def write(self, record: dict) -> None:
            if rank == 0:
                with open(s["records"], "a") as f:
                    f.write(json.dumps(record) + "\n")

        def on_step_end(self, args, state, control, **kwargs):
            self.step_end = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.write({"step": state.global_step, "loss": logs["loss"], "t": self.step_end,
                            "input_tokens": state.num_input_tokens_seen})

        def on_save(self, args, state, control, **kwargs):
            self.write({"step": state.global_step, "save_s": time.perf_counter() - self.step_end})

    common = dict(output_dir=s["output_dir"], max_steps=s["max_steps"], per_device_train_batch_size=s["micro_batch"],
                  learning_rate=s["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                  adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
                  logging_steps=1, save_strategy="steps" if s["save_steps"] else "no", save_steps=s["save_steps"] or 1,
                  report_to=[], use_cpu=not torch.cuda.is_available(), bf16=False, fp16=False, seed=s["seed"],
                  dataloader_num_workers=0, include_num_input_tokens_seen="non_padding", disable_tqdm=True,
                  ddp_backend="gloo" if not torch.cuda.is_available() else None,
                  **strategy_args(s["strategy"], s["block"]))
    model = AutoModelForCausalLM.from_pretrained(s["model"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(s["tokenizer"])
    if s["data"] == "text":
        from datasets import Dataset
        from transformers import Trainer, TrainingArguments

        windows = torch.load(s["windows"])  # [rows, seq_len + 1], already in the trainer's rank order
        rows = Dataset.from_dict({"input_ids": windows[:, :-1].tolist(), "labels": windows[:, :-1].tolist(),
                                  "shift_labels": windows[:, 1:].tolist()})
        # `shift_labels`: the next tokens of all seq_len positions (the trainer's targets), not labels shifted
        # inside the row (seq_len - 1 targets); kept by remove_unused_columns=False, taken by the model's loss.
        args = TrainingArguments(train_sampling_strategy="sequential", remove_unused_columns=False, **common)
        trainer = Trainer(model=model, args=args, train_dataset=rows.with_format("torch"), callbacks=[Records()])
    else:
        from datasets import load_dataset
        from trl import SFTConfig, SFTTrainer

        rows = load_dataset("json", data_files=s["chat"], split="train")
        args = SFTConfig(packing=True, max_length=s["seq_len"], **common)
        trainer = SFTTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer,
                             callbacks=[Records()])
    # what Accelerate made of the strategy's switches: on CPU it trains with DDP whatever fsdp= says
    # (its FSDP type is for accelerators only); DeepSpeed runs
    Records().write({"event": "setup", "distributed_type": trainer.accelerator.distributed_type.value,
                     "fsdp": trainer.is_fsdp_enabled, "deepspeed": trainer.is_deepspeed_enabled,
                     "gradient_checkpointing": args.gradient_checkpointing})  # TRL's SFTConfig: on by default
    trainer.train(resume_from_checkpoint=s["resume"])
    torch.distributed.destroy_process_group()
    time.sleep(0.5)  # gloo's exit crash after backward (FACTS): leave the group before the interpreter ends
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
