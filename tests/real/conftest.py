"""Tests of the real pretrained models (marker ``real``): they need ``python scripts/fetch_models.py``
(run by ``scripts/setup.sh`` unless ``SPECBATCH_SKIP_REAL_MODELS=1``) and are skipped, saying so,
when the models are not there."""

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


def pytest_collection_modifyitems(items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.real)


def need(model) -> Path:
    """The converted checkpoint of ``model`` (a fetch_models.RealModel), or skip the test."""
    if not fetch_models.is_converted(CACHE, model):
        pytest.skip(f"{model.name} was not fetched: run python scripts/fetch_models.py "
                    f"(scripts/setup.sh does, unless SPECBATCH_SKIP_REAL_MODELS=1)")
    return fetch_models.checkpoint_dir(CACHE, model)


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the converted SmolLM2-135M-Instruct, float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = need(fetch_models.SMOLLM2)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="session")
def gemma3():
    """(model, tokenizer) of the converted Gemma 3 270M, float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = need(fetch_models.GEMMA3)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)
