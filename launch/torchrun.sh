#!/bin/bash
# One node, N processes (GPUs, or CPU ranks on gloo):  launch/torchrun.sh 2 strategy=zero3
# Runs the torchrun of the active environment (source .venv/bin/activate, or your own venv/conda env).
# Two nodes: on node i run  torchrun --nnodes 2 --node_rank i --master_addr NODE0 --master_port 29500 \
#   --nproc_per_node 8 -m trainer strategy=fsdp
# torchrun passes SIGTERM and SIGUSR1 on to the ranks, which save and stop (docs/troubleshooting.md:
# Stop signals); it waits SHUTDOWN_TIMEOUT seconds for them before SIGKILL. MAX_RESTARTS=K restarts
# all ranks after one dies; they resume from the newest checkpoint.
set -euo pipefail
NPROC=${1:?usage: launch/torchrun.sh NPROC [overrides...]}
shift
exec torchrun --standalone --nproc_per_node "$NPROC" --max-restarts "${MAX_RESTARTS:-0}" \
  --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout "${SHUTDOWN_TIMEOUT:-120}" \
  -m trainer "$@"
