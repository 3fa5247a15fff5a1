"""Job configs: validated on load, unknown keys and bad values refused by name, overrides."""

from pathlib import Path

import pytest

from pipeline.config import ConfigError, apply_overrides, load_config
from pipeline.engine import METHODS

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["summarize", "demo-summarize", "translate"])
def test_shipped_configs_load(name):
    cfg = load_config(REPO / "configs" / f"{name}.yaml")
    assert cfg.task.name == name.removeprefix("demo-")
    # the default summarize job runs SmolLM2-135M-Instruct with the drafter distilled from it;
    # the demo config and the translate job run the tiny demo pair
    # (relative paths in a config file resolve against its folder: configs/)
    assert (cfg.models.target, cfg.models.drafter) == tuple(str(REPO / p) for p in {
        "summarize": ("models/cache/SmolLM2-135M-Instruct", "models/smollm2-135m-drafter"),
        "demo-summarize": ("models/demo-target", "models/demo-drafter"),
        "translate": ("models/demo-target", "models/demo-drafter")}[name])
    assert cfg.models.gguf_file is None and cfg.models.drafter_gguf_file is None
    assert cfg.input.uri == str(REPO / {"summarize": "data/demo_prompts.jsonl", "demo-summarize": "data/demo_prompts.jsonl",
                                        "translate": "data/demo_translate.jsonl"}[name])
    assert cfg.method.name in METHODS
    assert cfg.models.trust_remote_code is False
    if name == "translate":
        assert "{source_lang}" in cfg.task.template and cfg.task.target_lang


def test_defaults_need_no_file():
    cfg = load_config(None)
    assert cfg.compute.num_actors == 1 and cfg.output.overwrite is False


@pytest.mark.parametrize(
    "override, key",
    [
        ("bogus.x=1", "bogus"),
        ("generation.bogus=1", "generation.bogus"),
        ("models.tokenizer=x", "models.tokenizer"),
        ("method.draft_len=3", "method.draft_len"),
        ("output.endpoint=x", "output.endpoint"),
    ],
)
def test_unknown_key_is_refused_by_name(override, key):
    with pytest.raises(ConfigError, match=f"unknown key {key}"):
        load_config(None, [override])


def test_unknown_key_in_yaml_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("compute:\n  num_actors: 2\n  gpu_per_actor: 1\n")
    with pytest.raises(ConfigError, match="compute.gpu_per_actor"):
        load_config(p)


@pytest.mark.parametrize(
    "override, words",
    [
        ("method.name=medusa", ["method.name", "unknown method 'medusa'"]),
        ("compute.num_actors=0", ["compute.num_actors"]),
        ("compute.rows_per_batch=abc", ["compute.rows_per_batch"]),
        ("generation.max_new_tokens=0", ["generation", "max_new_tokens"]),
        ("generation.top_p=1.5", ["generation", "top_p"]),
        ("method.num_assistant_tokens=0", ["method", "num_assistant_tokens"]),
        ("method.num_assistant_tokens_schedule=fast", ["method", "num_assistant_tokens_schedule"]),
        ("task.name=classify", ["task.name"]),
        ("models.dtype=float8", ["models.dtype"]),
    ],
)
def test_bad_value_is_refused_by_name(override, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    for w in words:
        assert w in str(e.value)


def test_sampling_needs_positive_temperature():
    with pytest.raises(ConfigError, match="temperature"):
        load_config(None, ["generation.do_sample=true", "generation.temperature=0"])
    cfg = load_config(None, ["generation.do_sample=true", "generation.temperature=0.7", "generation.top_k=20"])
    s = cfg.generation.generation_settings()
    assert s.do_sample and s.temperature == 0.7 and s.top_k == 20


def test_translate_needs_languages_and_template_needs_text():
    with pytest.raises(ConfigError, match="task.source_lang"):
        load_config(None, ["task.name=translate"])
    with pytest.raises(ConfigError, match="text"):
        load_config(None, ["task.prompt_template=Summarize this"])
    with pytest.raises(ConfigError, match="placeholder"):  # attribute access: nothing in a template is evaluated
        load_config(None, ["task.prompt_template={text.__class__} in {language}"])
    # any other {column} names an input column (checked against the input before work starts)
    assert load_config(None, ["task.prompt_template={text} in {language}"]).task.columns == ["text", "language"]


def test_draft_model_needs_a_drafter_and_plain_does_not_use_it():
    with pytest.raises(ConfigError, match="models.drafter"):
        load_config(None, ["models.drafter=null", "method.name=draft_model"])
    cfg = load_config(None, ["method.name=plain"])
    assert cfg.models.drafter and not cfg.uses_drafter


def test_method_params_pass_through_to_speculation_settings():
    cfg = load_config(None, ["method.name=prompt_lookup", "method.prompt_lookup_num_tokens=4",
                             "method.max_matching_ngram_size=3"])
    s = cfg.method.speculation_settings()
    assert (s.method, s.prompt_lookup_num_tokens, s.max_matching_ngram_size) == ("prompt_lookup", 4, 3)
    assert cfg.model_dump()["method"]["prompt_lookup_num_tokens"] == 4


@pytest.mark.parametrize("key", [
    "input.split_rows", "input.preflight_read_max_bytes", "compute.rows_per_batch", "compute.cpus_per_actor",
    "compute.stall_timeout_s", "output.max_rows_per_file", "output.lease_timeout_s", "retry.attempts",
    "audit.seed", "audit.fraction", "generation.max_new_tokens", "generation.top_k", "serve.port",
    "method.num_assistant_tokens", "method.assistant_ensemble_weight"])
@pytest.mark.parametrize("value", ["true", "false"])
def test_a_boolean_is_not_a_count(key, value):
    """``input.split_rows: true`` was read as 1: a boolean given for a number is refused by
    name, in every section (and in the YAML file as with --set); a real boolean still loads."""
    with pytest.raises(ConfigError, match=rf"{key.replace('.', '[.]')}: {value} is a boolean, not a number"):
        load_config(None, [f"{key}={value}"])


def test_numbers_are_numbers_and_booleans_booleans(tmp_path):
    p = tmp_path / "job.yaml"
    p.write_text("input:\n  split_rows: yes\n")  # YAML 1.1: yes is a boolean
    with pytest.raises(ConfigError, match="input.split_rows: true is a boolean"):
        load_config(p)
    with pytest.raises(ConfigError, match="input.split_rows"):
        load_config(None, ["input.split_rows='500'"])  # a string, even of digits, is not a count
    cfg = load_config(None, ["input.split_rows=500", "compute.cpus_per_actor=2", "generation.do_sample=true",
                             "compute.draft_length=fixed", "generation.temperature=1"])
    assert cfg.input.split_rows == 500 and cfg.compute.cpus_per_actor == 2.0
    assert cfg.generation.do_sample is True and cfg.compute.draft_length == "fixed"


def test_overrides_parse_yaml_scalars():
    d = apply_overrides({}, ["a.b=3", "a.c=true", "a.d=null", "a.e=[x, y]", "a.f=s3://b/k", "a.g=0.5"])
    assert d == {"a": {"b": 3, "c": True, "d": None, "e": ["x", "y"], "f": "s3://b/k", "g": 0.5}}
    with pytest.raises(ConfigError):
        apply_overrides({}, ["novalue"])


def test_missing_or_bad_config_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    p = tmp_path / "list.yaml"
    p.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(p)


def test_resolved_config_redacts_secrets():
    cfg = load_config(None, ["output.storage_options={key: AKIA, secret: s3cr3t, client_kwargs: {endpoint_url: http://x}}"])
    r = cfg.resolved()
    assert r["output"]["storage_options"]["secret"] == "***"
    assert r["output"]["storage_options"]["client_kwargs"]["endpoint_url"] == "http://x"
    assert cfg.output.storage_options["secret"] == "s3cr3t"


def test_the_draft_length_is_the_controllers_unless_fixed_and_the_old_key_names_the_new():
    assert load_config(None).compute.draft_length == "auto"
    assert load_config(None, ["compute.draft_length=fixed"]).compute.draft_length == "fixed"
    with pytest.raises(ConfigError, match="compute.draft_length"):
        load_config(None, ["compute.draft_length=adaptive"])
    for old in ("true", "false", "null"):
        with pytest.raises(ConfigError, match="compute.adaptive_draft_length was replaced by compute.draft_length"):
            load_config(None, [f"compute.adaptive_draft_length={old}"])


def test_exponent_floats_read_as_numbers_in_files_and_overrides(tmp_path):
    """PyYAML follows YAML 1.1, where ``1e-3`` (no dot) is a string, which the strict config
    then refused as "not a valid number"; every user means a number."""
    from pipeline.config import ConfigError, load_config

    p = tmp_path / "job.yaml"
    p.write_text("generation:\n  temperature: 7e-1\n  top_p: 9.5E-1\n")
    cfg = load_config(p, ["compute.cpus_per_actor=5e-1"])
    assert (cfg.generation.temperature, cfg.generation.top_p, cfg.compute.cpus_per_actor) == (0.7, 0.95, 0.5)
    with pytest.raises(ConfigError, match="generation.temperature"):
        load_config(None, ["generation.temperature=e-1"])  # not a number: still refused by name
