"""The example job configs of configs/examples/ validate (no model is loaded)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import ConfigError, load_config

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "configs" / "examples").glob("*.yaml"))


def test_there_are_examples():
    names = {p.name for p in EXAMPLES}
    assert {"layerskip-llama3.2-1b.yaml", "gemma2-9b-vicuna68m-universal.yaml",
            "smollm-1.7b-135m-ensemble.yaml"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_config_validates(path):
    cfg = load_config(path)
    spec = cfg.method.speculation_settings()
    if spec.method == "early_exit":
        assert spec.assistant_early_exit and not cfg.uses_drafter
    if spec.method == "universal":
        assert cfg.uses_drafter
    if spec.assistant_ensemble_weight is not None:
        assert 0 < spec.assistant_ensemble_weight < 1 and cfg.uses_drafter


def test_method_settings_are_checked():
    path = Path(EXAMPLES[0]).parent / "layerskip-llama3.2-1b.yaml"
    with pytest.raises(ConfigError, match="assistant_early_exit"):
        load_config(path, ["method.assistant_early_exit=0"])
    with pytest.raises(ConfigError, match="drafter"):
        load_config(Path(path).parent / "gemma2-9b-vicuna68m-universal.yaml", ["models.drafter=null"])
