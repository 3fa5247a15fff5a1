"""docs/adding-a-method.md, walked through: its toy method ``repeat_last`` is built from the
page's own code blocks (the file, the registry line, the tests, exactly as the page shows
them) and its tests run: greedy output equal to plain greedy decoding on a tiny float64
model, and its parameter checked.  The registry line joins the table here at run time, and
the settings class is composed again from the table (what importing the table with the line
in it gives)."""

from __future__ import annotations

import dataclasses
import re
import sys
import types
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[2] / "docs" / "adding-a-method.md"
FENCE = re.compile(r"<!-- run by: tests/engine/test_adding_a_method\.py::\w+ \((?P<what>[^)]*)\) -->\n"
                   r"```python\n(?P<body>.*?)```", re.S)


def page_block(what: str) -> str:
    """The page's code block marked ``(what)``, run by this file."""
    found = [m["body"] for m in FENCE.finditer(PAGE.read_text(encoding="utf-8")) if m["what"] == what]
    assert len(found) == 1, f"{PAGE.name} has {len(found)} blocks marked ({what}) run by this test"
    return found[0]


@pytest.fixture
def toy_method(monkeypatch):
    """The page's module as ``pipeline.engine.proposers.repeat_last``, its line in the table."""
    import pipeline.engine
    from pipeline.engine import METHODS
    from pipeline.engine.methods import MethodSpec
    from pipeline.engine.speculation import compose

    name = "pipeline.engine.proposers.repeat_last"
    module = types.ModuleType(name)
    module.__package__ = "pipeline.engine.proposers"
    monkeypatch.setitem(sys.modules, name, module)
    exec(compile(page_block("the file"), f"{PAGE.name}: the file", "exec"), module.__dict__)
    line = page_block("the registry line").strip()
    assert line.endswith(","), "a line of the METHODS table ends with a comma"
    spec = eval(compile(line[:-1], f"{PAGE.name}: the registry line", "eval"),
                {"MethodSpec": MethodSpec, "repeat_last": module})
    monkeypatch.setitem(METHODS, spec.name, spec)
    monkeypatch.setattr(pipeline.engine, "SpeculationSettings", compose(METHODS))
    return module, spec


def test_the_toy_method_of_the_page_is_lossless(toy_method):
    import pipeline.engine

    module, spec = toy_method
    settings = pipeline.engine.SpeculationSettings
    assert spec.param_names == ("repeat_last_period",) and spec.params is module.Params
    field = {f.name: f for f in dataclasses.fields(settings)}["repeat_last_period"]
    assert field.default is None and "repeat" in field.metadata["doc"]  # the config reference's text
    tests: dict = {"__name__": "test_repeat_last"}
    exec(compile(page_block("its tests"), f"{PAGE.name}: its tests", "exec"), tests)
    for period in (None, 1, 3):
        tests["test_repeat_last_greedy_equals_plain"](period)
    tests["test_repeat_last_period_is_checked"]()


def test_the_toy_proposer_drafts_the_periodic_tail(toy_method):
    """What the page says ``repeat_last`` drafts: the last ``period`` tokens, in turn."""
    import torch

    from pipeline.engine.proposers.base import DraftRequest

    module, _ = toy_method
    request = DraftRequest(slot=0, sequence=torch.tensor([[4, 5, 6, 7]]), k=5, shaper=None, generator=None,
                           want_probs=False)
    assert module.RepeatLastProposer(1).propose([request])[0].tokens.tolist() == [7] * 5
    assert module.RepeatLastProposer(3).propose([request])[0].tokens.tolist() == [5, 6, 7, 5, 6]
