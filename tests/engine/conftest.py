"""Fixtures of the engine tests; the model builders live in tiny_models.py."""

import pytest

from tiny_models import build, perturbed_copy


@pytest.fixture(scope="session")
def llama_pair():
    target = build("llama", seed=0)
    return target, perturbed_copy(target, 0.5)




@pytest.fixture(scope="session", autouse=True)
def fixed_draft_length():
    """The engine tests check what every method does with its drafts (exactness, rollback
    after rejections, statistics), so by default they draft the length they ask for: an
    engine built without ``draft_length`` gets ``"fixed"`` here.  The tests of the
    draft-length controller (test_draft_budget.py, and the controller's cases elsewhere) pass
    ``draft_length="auto"`` explicitly."""
    from pipeline.engine.loop import StepEngine

    init = StepEngine.__init__

    def fixed(self, *args, **kwargs):
        if len(args) < 7:  # draft_length is the seventh parameter after self
            kwargs.setdefault("draft_length", "fixed")
        init(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:  # session-wide: module fixtures build engines too
        mp.setattr(StepEngine, "__init__", fixed)
        yield
