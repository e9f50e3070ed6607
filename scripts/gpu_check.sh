#!/usr/bin/env bash
# The first GPU run in one command: the GPU tests, then step time, peak memory, tokens/s and MFU of
# the small and motus sizes beside the memory model's prediction (benchmarks/results/gpu_check.json).
# Exits 2 with "no GPU" on a machine without one.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} TRANSFORMERS_OFFLINE=${TRANSFORMERS_OFFLINE:-1} WANDB_MODE=${WANDB_MODE:-offline}
exec "$PYTHON" benchmarks/gpu_check.py "$@"
