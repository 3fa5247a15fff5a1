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


REAL = sorted((Path(__file__).resolve().parents[1] / "configs" / "real").glob("*.yaml"))


def test_real_model_configs_cover_the_methods():
    """configs/real/: SmolLM2 with draft_model, prompt_lookup, early_exit, eagle; Gemma 3 with prompt_lookup
    and early_exit; universal with a Gemma 3 target and a SmolLM2 drafter (different tokenizers)."""
    runs = set()
    for path in REAL:
        cfg = load_config(path)
        runs.add((Path(cfg.models.target).name, cfg.method.name, cfg.models.drafter and Path(cfg.models.drafter).name))
    assert runs == {
        ("SmolLM2-135M-Instruct", "draft_model", "smollm2-135m-drafter"),
        ("SmolLM2-135M-Instruct", "prompt_lookup", None),
        ("SmolLM2-135M-Instruct", "early_exit", None),
        ("SmolLM2-135M-Instruct", "eagle", "smollm2-135m-eagle"),
        ("gemma-3-270m", "prompt_lookup", None),
        ("gemma-3-270m", "early_exit", None),
        ("gemma-3-270m", "universal", "SmolLM2-135M-Instruct"),
    }


@pytest.mark.parametrize("path", REAL, ids=lambda p: p.name)
def test_real_model_config_validates(path):
    cfg = load_config(path)
    repo = Path(__file__).resolve().parents[1]  # relative paths in a config resolve against its folder
    assert cfg.models.target.startswith(str(repo / "models" / "cache") + "/")  # where scripts/fetch_models.py converts them
    assert cfg.generation.do_sample is False and cfg.output.uri.startswith(str(repo / "out" / "real") + "/")
    # the instruct model is prompted through its chat template, the base model without one
    assert cfg.task.chat_template is ("SmolLM2" in cfg.models.target)
