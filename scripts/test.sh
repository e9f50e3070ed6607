#!/usr/bin/env bash
# Set up if needed, then run the whole test suite (pytest arguments pass through).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest tests "$@"
