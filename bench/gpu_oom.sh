#!/usr/bin/env bash
# CUDA + NCCL, train.on_oom=adapt for real: gpt_1b in bf16 at 16,384 tokens a row, micro-batch 8,
# restarted by the trainer's own launcher until it fits; the global batch, and so the losses, stay
# those planned. Sized for an H200 (~139 GiB a GPU): `python -m trainer.plan` counts 18 GB of
# parameters, gradients and Adam state, and 1.39 MB of activations a token without activation
# checkpointing, so micro-batch 8 needs ~200 GB a GPU (cannot fit), 4 ~109 GB (fits, by the
# planner's count; if not, the ladder goes on to 2, 1, then activation checkpointing). Prints the
# planner's table, the out-of-memory failures (oom.jsonl), the adaptations and the run's end
# (metrics.jsonl), then the planner's reading of the run dir.
#
#   bench/gpu_oom.sh                  # one GPU
#   NPROC=8 bench/gpu_oom.sh          # 8 local GPUs (NCCL): the same per-GPU sizes under ddp
#   MICRO=16 SEQ=8192 bench/gpu_oom.sh
#
# Not yet run: written on machines without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
RUN_DIR="${RUN_DIR:-$(mktemp -d)/run}"
SETTINGS=(model=gpt_1b train.precision=bf16 "model.seq_len=${SEQ:-16384}" data=synthetic train.device=cuda
          "train.micro_batch_size=${MICRO:-8}" strategy=ddp "nproc=${NPROC:-1}")
"$PYTHON" -m trainer.plan "${SETTINGS[@]}"
"$PYTHON" -m trainer "${SETTINGS[@]}" train.max_steps=4 train.log_every=1 max_restarts=5 train.max_adaptations=5 \
    hydra.run.dir="$RUN_DIR"
grep '"out_of_memory"' "$RUN_DIR/oom.jsonl" || true
grep -E '"event": "(adapted|end)"' "$RUN_DIR/metrics.jsonl"
"$PYTHON" -m trainer.plan "${SETTINGS[@]}" plan.run_dir="$RUN_DIR" | head -3
