#!/bin/bash
# One node, N processes (GPUs, or CPU ranks on gloo):  launch/torchrun.sh 2 strategy=zero3
# Runs the torchrun of the active environment (source .venv/bin/activate, or your own venv/conda env).
# Two nodes: on node i run  torchrun --nnodes 2 --node_rank i --master_addr NODE0 --master_port 29500 \
#   --nproc_per_node 8 -m trainer strategy=fsdp
set -euo pipefail
NPROC=${1:?usage: launch/torchrun.sh NPROC [overrides...]}
shift
exec torchrun --standalone --nproc_per_node "$NPROC" -m trainer "$@"
