"""The trainer state of a checkpoint is one typed dataclass (trainer.checkpoint.format.TrainerState),
read and written in one place; manifests keep the bytes they always had."""
from __future__ import annotations

import json

from trainer.checkpoint.format import TrainerState

# The "trainer" entry of a manifest as a save wrote it before TrainerState (Run.save's dict, in its order).
SAVED = {"step": 6, "epoch": 1, "skipped": 0, "scale_skips": 2, "loss_scale": {"scale": 1024.0, "good_steps": 3},
         "tokens": 3072, "input_tokens": 3100,
         "data": {"epoch": 1, "samples_consumed": 8, "fingerprint": {"kind": "text", "seq_len": 64}},
         "global_batch": 8, "schedule_steps": 12, "run_dir": "/runs/a", "early_stop": {"best": 2.5, "best_step": 4,
                                                                                        "worse": 1},
         "optim": {"lr": 0.001, "betas": [0.9, 0.95], "eps": 1e-08, "weight_decay": 0.1}, "val_loss": None}


def test_a_saved_trainer_state_reads_and_writes_back_to_the_same_manifest_bytes():
    state = TrainerState.from_dict(json.loads(json.dumps(SAVED)))
    assert (state.step, state.scale_skips, state.loss_scale["scale"], state.data["samples_consumed"]) == (6, 2, 1024.0, 8)
    assert json.dumps(state.to_dict(), indent=1) == json.dumps(SAVED, indent=1)


def test_a_checkpoint_from_before_a_field_gets_its_default():
    # as convert wrote them before issue 28, and saves from before input tokens, scale skips, early stop
    old = {"step": 3, "epoch": 0, "skipped": 0, "loss_scale": None, "tokens": 96,
           "data": {"epoch": 0, "samples_consumed": 0}}
    state = TrainerState.from_dict(old)
    assert (state.step, state.tokens, state.input_tokens, state.scale_skips) == (3, 96, 96, 0)
    assert (state.global_batch, state.schedule_steps, state.early_stop, state.val_loss) == (None, None, None, None)
    assert TrainerState(step=5).to_dict()["data"] == {"epoch": 0, "samples_consumed": 0}
