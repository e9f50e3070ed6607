#!/usr/bin/env bash
# Train with torchrun on this node: one process per GPU, or 2 CPU processes (gloo) without a GPU.
#
#   bash scripts/train.sh                                  # configs/tiny.yaml, sets up .venv if missing
#   bash scripts/train.sh training.max_steps=50            # arguments go to train/train.py (key=value overrides)
#   CONFIG=configs/robotwin.yaml NPROC_PER_NODE=8 bash scripts/train.sh
#
# Environment, with defaults:
#   CONFIG            configs/tiny.yaml
#   DEEPSPEED_CONFIG  configs/zero2.json  (set it empty to train without DeepSpeed)
#   NPROC_PER_NODE    the number of visible GPUs, or 2 when there is none
#   RUN_NAME          the trainer's default (a readable name built from the config)
#   MASTER_PORT       29500; on a single node a free port is used instead when it is taken
# Several nodes (scripts/slurm/ sets these; every node runs this script with its own NODE_RANK):
#   NNODES 1, NODE_RANK 0, MASTER_ADDR (the host of node rank 0, reachable from every node)
set -euo pipefail
cd "$(dirname "$0")/.."

CONFIG=${CONFIG:-configs/tiny.yaml}
DEEPSPEED_CONFIG=${DEEPSPEED_CONFIG-configs/zero2.json}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_PORT=${MASTER_PORT:-29500}
if [ "$NNODES" = 1 ]; then
  MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
elif [ -z "${MASTER_ADDR:-}" ]; then
  echo "train.sh: NNODES=$NNODES needs MASTER_ADDR, the address of node rank 0 that every node can reach" >&2
  exit 2
fi

[ -x .venv/bin/torchrun ] || bash scripts/setup.sh
PY=.venv/bin/python

if [ -z "${NPROC_PER_NODE:-}" ]; then
  gpus=0
  # torch (not nvidia-smi) counts the GPUs this job may use: it honours CUDA_VISIBLE_DEVICES.
  if command -v nvidia-smi >/dev/null 2>&1; then
    gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())")
  fi
  NPROC_PER_NODE=$(( gpus > 0 ? gpus : 2 ))
fi

if [ "$NNODES" = 1 ]; then
  # The port is private to this node, so another free one is as good; with several nodes
  # every node must use the same agreed port and it is left alone.
  port=$("$PY" - "$MASTER_PORT" <<'EOF'
import socket, sys

def bind(port):
    with socket.socket() as s:
        s.bind(("", port))
        return s.getsockname()[1]

try:
    print(bind(int(sys.argv[1])))
except OSError:
    print(bind(0))
EOF
)
  if [ "$port" != "$MASTER_PORT" ]; then
    echo "train.sh: port $MASTER_PORT is taken; using free port $port (set MASTER_PORT to choose)"
    MASTER_PORT=$port
  fi
fi

# Forward Slurm's advance warning (USR1) to the workers so they save, not only TERM/INT; and give
# a worker that is saving after a signal time to finish before torchrun kills it (default 30 s).
export PET_SIGNALS_TO_HANDLE=${PET_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-600}

cmd=(.venv/bin/torchrun --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$NPROC_PER_NODE"
     --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT"
     train/train.py --config "$CONFIG")
if [ -n "$DEEPSPEED_CONFIG" ]; then
  cmd+=(--deepspeed "$DEEPSPEED_CONFIG")
fi
if [ -n "${RUN_NAME:-}" ]; then
  cmd+=(--run_name "$RUN_NAME")
fi
cmd+=("$@")

echo "+ ${cmd[*]}"
exec "${cmd[@]}"
