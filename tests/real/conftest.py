"""Tests of the real pretrained models (marker ``real``): they need ``python scripts/fetch_models.py``
(``scripts/setup.sh`` runs it for SmolLM2-135M-Instruct unless ``SPECBATCH_SKIP_REAL_MODELS=1``;
Gemma 3 270M: ``--only gemma3``) and are skipped, naming the command, when a model is not there."""

from pathlib import Path

import pytest
from realkit import fetch_models, need


def pytest_collection_modifyitems(items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.real)


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
