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


def test_the_set_up_fetches_the_default_jobs_model_only_and_the_others_on_first_use(monkeypatch):
    """scripts/setup.sh fetches exactly the model configs/summarize.yaml names (minutes saved on a
    fresh machine); every other real model a config names can be fetched by the folder name the
    refusal prints (``--only <folder>``), and a test that needs one skips naming its command."""
    import re
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(repo / "tests" / "real"))
    from realkit import fetch_models, need

    script = [line for line in (repo / "scripts" / "setup.sh").read_text().splitlines()
              if not line.lstrip().startswith("#")]
    fetched = [m for line in script for m in re.findall(r"^\s*python scripts/fetch_models\.py(.*)$", line)]
    default = Path(load_config(repo / "configs" / "summarize.yaml").models.target).name
    assert [f.split() for f in fetched] == [["--only", next(m.key for m in fetch_models.MODELS.values()
                                                            if m.name == default)]]
    named = {Path(load_config(p).models.target).name for p in REAL} - {default}
    assert named == {fetch_models.GEMMA3.name}
    r = subprocess.run([sys.executable, str(repo / "scripts" / "fetch_models.py"), "--check", "--only",
                        fetch_models.GEMMA3.name], capture_output=True, text=True, timeout=60)
    assert r.returncode in (0, 1) and r.stdout.startswith("gemma3: "), r.stderr  # the folder name is a choice
    monkeypatch.setattr(fetch_models, "is_converted", lambda cache, model: False)
    with pytest.raises(pytest.skip.Exception, match="run python scripts/fetch_models.py --only gemma3 "):
        need(fetch_models.GEMMA3)
