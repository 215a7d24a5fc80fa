#!/usr/bin/env bash
# One CUDA GPU, train.on_oom=adapt for real: gpt_1b in bf16 at a micro-batch sized to run out of
# GPU memory (64 rows of 2048 tokens), restarted by the trainer's own launcher until it fits; the
# global batch, and so the losses, stay those planned. Prints the adaptations (metrics.jsonl's
# `adapted` events) and the run's end.
#
#   bench/gpu_oom.sh                  # MICRO=64 by default; MICRO=128 for more rungs
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
RUN_DIR="${RUN_DIR:-$(mktemp -d)/run}"
"$PYTHON" -m trainer model=gpt_1b train.precision=bf16 model.seq_len=2048 data=synthetic train.device=cuda \
    train.micro_batch_size="${MICRO:-64}" train.max_steps=4 train.log_every=1 max_restarts=4 hydra.run.dir="$RUN_DIR"
grep -E '"event": "(adapted|end)"' "$RUN_DIR/metrics.jsonl"
