"""What a run says of itself in words: the start line (what will run, resolved) and the command
that turns its checkpoint into weights (the done line's hint)."""
from __future__ import annotations

from trainer.config import Config, ModelKind, ObjectiveName, PeftName
from trainer.distributed import DistEnv
from trainer.memory import async_save_bytes
from trainer.models import ModelFacts
from trainer.models.active_params import short_count
from trainer.oom import size
from trainer.strategies import Strategy


def describe(cfg: Config, env: DistEnv, strategy: Strategy, total_steps: int, facts: ModelFacts) -> str:
    """What will run, resolved: the start line; `facts`: the model's (`model_facts`)."""
    s, t = cfg.strategy, cfg.train
    dp = strategy.layout.dp_size
    global_batch = t.micro_batch_size * t.grad_accum_steps * dp
    ranks = f"{dp} rank{'s' if dp > 1 else ''}" if s.sp == s.tp == 1 else f"{dp} data-parallel rank{'s' if dp > 1 else ''}"
    sp = [f"sp={s.sp} (dp={dp}): {cfg.model.seq_len // s.sp} tokens per rank of {cfg.model.seq_len}"] if s.sp > 1 else []
    ep = [f"ep={s.ep}: 1/{s.ep} of each MoE layer's experts per rank, tokens sent to them"] if s.ep > 1 else []
    tp = [f"tp={s.tp} (dp={dp}): 1/{s.tp} of each split layer per rank, its tensor group reading the same rows"] \
        if s.tp > 1 else []
    attention = [f"attn_implementation={cfg.model.attn_implementation}"] if cfg.model.kind == ModelKind.hf else []
    o = cfg.objective
    dpo = [f"objective=dpo beta={o.beta:g} loss={o.loss.value}" + ("" if o.disable_dropout else " dropout=kept")] \
        if o.name is ObjectiveName.dpo else []
    # a mixture of experts: all its parameters, and those a token uses
    active = f" ({short_count(facts.params)} parameters, {short_count(facts.active)} active)" \
        if facts.active < facts.params else ""
    said = strategy.start_settings()
    offload = said.pop("offload")
    return " ".join([f"strategy={s.name.value} world_size={env.world_size} device={env.device} model={cfg.model.name}{active}",
                     *attention,
                     f"steps={total_steps} precision={t.precision.value}", *(f"{key}={value}" for key, value in said.items()), *dpo,
                     # peft=lora and objective=dpo bring their own (conf/peft/lora.yaml, conf/objective/dpo.yaml):
                     # said, so nobody trains at a rate they did not expect
                     f"lr={cfg.optim.lr:g} weight_decay={cfg.optim.weight_decay:g}",
                     f"offload={offload}", *save_words(cfg, facts, env.world_size),
                     f"activation_checkpointing={'on' if t.activation_checkpointing else 'off'}",
                     *(["fused_loss=on"] if t.fused_loss else []),
                     f"global_batch={global_batch} ({t.micro_batch_size} x {t.grad_accum_steps} accumulation x "
                     f"{ranks}) seq_len={cfg.model.seq_len}", *sp, *ep, *tp])


def save_words(cfg: Config, facts: ModelFacts, world_size: int) -> list[str]:
    """checkpoint.async, with the host memory its copy of the state holds on each rank."""
    if not (cfg.checkpoint.async_ and cfg.checkpoint.dir):
        return []
    held = async_save_bytes(facts.trainable, facts.params - facts.trainable, world_size,
                            frozen_saved=cfg.model.path is None)
    return [f"checkpoint.async=on (+{size(held)} host memory a rank)"]


def export_hint(cfg: Config) -> str:
    """The command that turns the run's checkpoint into weights for inference, and what it writes."""
    command = f"python -m trainer.export {cfg.checkpoint.dir}"
    if PeftName(cfg.peft.name) is PeftName.lora:
        merged = "; with --merge, the merged model" if ModelKind(cfg.model.kind) is ModelKind.hf else ""
        return f"{command} OUT_DIR writes the LoRA adapters as a PEFT folder{merged}"
    if ModelKind(cfg.model.kind) is ModelKind.hf:
        return f"{command} OUT_DIR writes a Hugging Face folder"
    return f"{command} OUT.safetensors writes the weights"
