#!/usr/bin/env bash
# Set up specbatch in ./.venv: the CPU build of torch first (pinned: a bare `torch` requirement
# would pull a multi-GB CUDA build), then the project with its test extras.
# On a GPU machine, install the torch build for your CUDA first; the pin below is then satisfied.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -d .venv ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test]"
python -c "import torch, transformers, ray; print(f'specbatch ready: torch {torch.__version__}, transformers {transformers.__version__}, ray {ray.__version__}')"
