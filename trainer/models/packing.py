"""Whether a model keeps packed conversations apart (data=chat, data.packing=true): decided by its
numbers, not by its forward's signature (a model may take `position_ids` for its rotary embedding
alone, and attend across conversations all the same).

Once, before any rank starts: a model built as the run's is (a Hugging Face model cut to one small
layer, `hf.small_builder`; a custom model whole), on the CPU with a fixed seed, gives two short
sequences packed in one row, `position_ids` restarting at the second, the logits it gives each
alone, within TOLERANCE of their scale; else attention (or any state) crosses from one to the next.
"""
from __future__ import annotations

import inspect

import torch

from trainer.config import ModelConfig, ModelKind
from trainer.errors import ConfigError
from trainer.log import log

LENGTHS = (7, 5)
# Relative to the largest logit. Measured on Hugging Face families cut as hf.small_builder does: at most
# 2.2e-6 on the 26 that keep sequences apart; 8e-3 (Bloom's ALiBi) to 1.0 (OPT, MPT, Mamba, Jamba) where they cross.
TOLERANCE = 1e-4


def check_packing(cfg: ModelConfig) -> None:
    """Refuse packed rows for a model that does not keep them apart (see the top)."""
    from trainer.models import custom, hf, logits_of

    kind = ModelKind(cfg.kind)
    build = hf.small_builder(cfg) if kind is ModelKind.hf else custom.builder(cfg)
    what = (f"the {cfg.attn_implementation} attention of {cfg.path}" if kind is ModelKind.hf else cfg.target)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build().eval()
    parameters = inspect.signature(model.forward).parameters
    if "position_ids" not in parameters and not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        raise ConfigError(f"data.packing: packed conversations pass position_ids (restarting at each one) to the "
                          f"model, and {cfg.target}'s forward takes none; give it a position_ids argument "
                          "that keeps attention within each conversation, or set data.packing=false")
    vocab = model.config.get_text_config().vocab_size if kind is ModelKind.hf else cfg.vocab_size
    sequences = [torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(n)) for n in LENGTHS]
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    try:
        with torch.no_grad():
            apart = torch.cat([logits_of(model(ids)) for ids in sequences], dim=1)
            packed = logits_of(model(torch.cat(sequences, dim=1), position_ids=positions))
    except Exception as e:
        if "flash" in cfg.attn_implementation and kind is ModelKind.hf:
            # Its kernels run on a GPU only; transformers gives them the sequences' bounds from position_ids.
            log.warning(f"data.packing: {what} does not run on the CPU, where packing is checked: not checked")
            return
        reason = str(e).splitlines()[0] if str(e) else ""
        raise ConfigError(f"data.packing: {what} could not run two sequences packed in one row with position_ids "
                          f"({type(e).__name__}: {reason}); set data.packing=false") from None
    difference = float((packed - apart).abs().max() / apart.abs().max().clamp_min(torch.finfo(apart.dtype).tiny))
    if difference > TOLERANCE:
        raise ConfigError(f"data.packing: packed conversations need a model whose attention stays within each "
                          f"(position_ids restart at each one); {what} gives two sequences packed in one row other "
                          f"logits than each alone (by {difference:.1e} of their scale, more than {TOLERANCE:g}): "
                          "its attention crosses from one to the next; set data.packing=false (a padded row each)")
