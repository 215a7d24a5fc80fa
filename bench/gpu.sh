#!/usr/bin/env bash
# One CUDA GPU: every strategy at world size 1 on gpt_1b (~1B params) in bf16, trainer against the
# raw loop of each backend. Prints step time, tokens/s, MFU (model FLOPs per token from
# trainer.models.model_facts over PEAK_FLOPS), peak GPU memory (metrics mem.peak) and the
# trainer/raw ratio; writes bench/results/strategies_gpt_1b_cuda.{json,png}.
#
#   bench/gpu.sh                      # H100/H200: dense bf16 peak 989e12 FLOP/s
#   PEAK_FLOPS=312e12 bench/gpu.sh    # A100
#   bench/gpu.sh --steps 20           # further flags go to bench/strategies.py (the last one wins)
#   bench/gpu.sh --device cpu --model tiny --steps 6 --warmup 2   # the same path on a CPU
#   bench/gpu.sh peers [flags]        # bench/peers.py on CUDA: the trainer against HF Trainer and TRL,
#                                     # one rank per GPU (RANKS=N to choose), bench/results/peers_cuda.json
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
[ -x "$PYTHON" ] || make setup
if [ "${1:-}" = peers ]; then
    shift
    exec "$PYTHON" bench/peers.py --device cuda --ranks "${RANKS:-$(nvidia-smi -L | wc -l)}" \
        --out bench/results/peers_cuda.json "$@"
fi
exec "$PYTHON" bench/strategies.py --device cuda --model gpt_1b --precision bf16 --ranks 1 \
    --global-batch "${GLOBAL_BATCH:-8}" --steps "${STEPS:-12}" --peak-flops "${PEAK_FLOPS:-989e12}" "$@"
