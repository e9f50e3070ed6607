#!/usr/bin/env bash
# Set up if needed, then run the whole test suite (pytest arguments pass through) on 2 worker
# processes (pytest-xdist, a test file per worker; see tests/conftest.py). TEST_WORKERS=0
# runs it in this process, as plain pytest does.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest tests -n "${TEST_WORKERS:-2}" --dist loadfile "$@"
