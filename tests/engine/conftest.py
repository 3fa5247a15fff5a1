"""Fixtures of the engine tests; the model builders live in tiny_models.py."""

import pytest

from tiny_models import build, perturbed_copy


@pytest.fixture(scope="session")
def llama_pair():
    target = build("llama", seed=0)
    return target, perturbed_copy(target, 0.5)


