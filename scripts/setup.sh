#!/usr/bin/env bash
# Create .venv and install the recipe's requirements. Safe to run again: it only
# installs what changed. No GPU: the CPU build torch==2.13.0. A CUDA torch that is
# already installed (in .venv or in the system Python) is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.requirements.sha

if [ ! -x "$VENV/bin/python" ]; then
  if "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then
    echo "setup: reusing the system's CUDA torch in a new .venv"
    "$PYTHON" -m venv --system-site-packages "$VENV"
  else
    "$PYTHON" -m venv "$VENV"
  fi
fi
PY=$VENV/bin/python
want=$(sha256sum requirements.txt | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && "$PY" -c "import torch, deepspeed" 2>/dev/null; then
  exit 0
fi
"$PY" -m pip install -q --upgrade pip
if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: installing a CUDA build of torch"
    "$PY" -m pip install -q "torch>=2.6,<2.15"
  else
    echo "setup: no GPU found, installing the CPU build torch==2.13.0"
    "$PY" -m pip install -q torch==2.13.0
  fi
fi
"$PY" -m pip install -q -r requirements.txt
"$PY" -m pip install -q --no-deps "openpi-client>=0.1.2,<0.2"  # see requirements.txt
# DeepSpeed compiles its CPU shared-memory collective op on first use; build it once
# here (cached under ~/.cache/torch_extensions) instead of inside the first run.
"$PY" - <<'PY' >/dev/null 2>&1 || true
from deepspeed.comm.torch import build_shm_op
build_shm_op()
PY
echo "$want" > "$STAMP"
echo "setup: done ($("$PY" -c 'import torch; print("torch", torch.__version__)'))"
