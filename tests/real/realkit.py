"""Shared by the tests of the real models: where they are, and skipping when they are not."""

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / "models" / "cache"
DRAFTER = REPO / "models" / "smollm2-135m-drafter"

_spec = importlib.util.spec_from_file_location("fetch_models", REPO / "scripts" / "fetch_models.py")
fetch_models = importlib.util.module_from_spec(_spec)
sys.modules["fetch_models"] = fetch_models
_spec.loader.exec_module(fetch_models)


def need(model) -> Path:
    """The converted checkpoint of ``model`` (a fetch_models.RealModel), or skip the test."""
    if not fetch_models.is_converted(CACHE, model):
        by = ("scripts/setup.sh does, unless SPECBATCH_SKIP_REAL_MODELS=1" if model is fetch_models.SMOLLM2 else
              "fetched on first use: scripts/setup.sh fetches the default job's model only")
        pytest.skip(f"{model.name} was not fetched: run python scripts/fetch_models.py --only {model.key} ({by})")
    return fetch_models.checkpoint_dir(CACHE, model)
