"""``models.gguf_file`` / ``models.drafter_gguf_file``: a GGUF checkpoint (llama.cpp format) as target
or drafter, checked in the driver like every other model path and loaded with transformers'
``from_pretrained(folder, gguf_file=...)``.  Uses a tiny Llama written as GGUF here (tiny_gguf.py);
the real GGUF checkpoints are tested in tests/real/."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from pipeline.config import ConfigError, load_config
from pipeline.models import ModelError, check_model_path, check_models, load_models
from tiny_gguf import write_non_gguf_files, write_tiny_llama_gguf

REPO = Path(__file__).resolve().parents[2]
DEMO_TOKENIZER = REPO / "models" / "demo-target" / "tokenizer.json"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """(folder, file name, the random LlamaForCausalLM it was written from)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = len(json.loads(DEMO_TOKENIZER.read_text())["model"]["vocab"])
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    model = LlamaForCausalLM(cfg).eval()
    folder = tmp_path_factory.mktemp("gguf")
    write_tiny_llama_gguf(model, DEMO_TOKENIZER, folder / "tiny-llama.F32.gguf", bos=0, eos=1, unk=2, pad=3)
    return folder, "tiny-llama.F32.gguf", model


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    return write_non_gguf_files(tmp_path_factory.mktemp("bad"))


def test_config_keys():
    cfg = load_config(None, ["models.target=some/folder", "models.gguf_file=m.Q4_K_M.gguf",
                             "models.drafter_gguf_file=d.gguf"])
    assert cfg.models.gguf_file == "m.Q4_K_M.gguf" and cfg.models.drafter_gguf_file == "d.gguf"
    assert load_config(None).models.gguf_file is None  # default: a config.json checkpoint
    with pytest.raises(ConfigError, match="models.gguf_file"):
        load_config(None, ["models.gguf_file=' '"])
    with pytest.raises(ConfigError, match="models.drafter_gguf_file is set but models.drafter"):
        load_config(None, ["models.drafter=null", "method.name=plain", "models.drafter_gguf_file=d.gguf"])


def test_gguf_checkpoint_loads_with_its_weights_and_tokenizer(tiny_gguf):
    folder, name, reference = tiny_gguf
    cfg = load_config(None, [f"models.target={folder}", f"models.gguf_file={name}", "method.name=plain"])
    checked = check_models(cfg.models, cfg.uses_drafter)
    assert checked["target_config"].model_type == "llama" and checked["target_config"].hidden_size == 32
    m = load_models(cfg.models, cfg.uses_drafter, "cpu")
    assert type(m.target).__name__ == "LlamaForCausalLM"
    loaded, ref = m.target.state_dict(), reference.state_dict()
    assert set(loaded) == set(ref)
    for k in ref:  # q/k were permuted to llama.cpp's layout on write and back on load: exact
        assert torch.equal(loaded[k], ref[k]), k
    from transformers import AutoTokenizer

    demo = AutoTokenizer.from_pretrained(REPO / "models" / "demo-target")
    text = "The council voted on Tuesday to build a new bridge."
    assert m.tokenizer(text, add_special_tokens=False)["input_ids"] == demo(text, add_special_tokens=False)["input_ids"]


def test_gguf_target_and_drafter_run_in_the_engine(tiny_gguf):
    """The GGUF target with the same GGUF file as drafter: draft_model decoding equals plain."""
    from pipeline.engine import GenerationSettings, SpeculationSettings, SpeculativeEngine

    folder, name, reference = tiny_gguf
    cfg = load_config(None, [f"models.target={folder}", f"models.gguf_file={name}",
                             f"models.drafter={folder}", f"models.drafter_gguf_file={name}"])
    check_models(cfg.models, cfg.uses_drafter)
    m = load_models(cfg.models, cfg.uses_drafter, "cpu")
    assert m.drafter is not None and m.drafter_tokenizer is not None
    ids = m.tokenizer("The council voted")["input_ids"]
    gs = GenerationSettings(max_new_tokens=8, eos_token_id=[])
    spec = SpeculativeEngine(m.target, cfg.method.speculation_settings(), drafter=m.drafter, tokenizer=m.tokenizer,
                             drafter_tokenizer=m.drafter_tokenizer).generate(ids, gs)
    plain = SpeculativeEngine(reference, SpeculationSettings(method="plain")).generate(ids, gs)
    assert spec.token_ids == plain.token_ids and len(plain.token_ids) == 8
    assert spec.stats.accepted_tokens == spec.stats.draft_tokens  # the drafter is the target


@pytest.mark.parametrize("kind, message", [
    ("missing", "GGUF file 'missing.gguf' not found in models.target"),
    ("text", "is not a GGUF file (it starts with b'this'"),
    ("header_only", "is not a readable GGUF checkpoint"),
    ("architecture", "architecture no-such-architecture is not supported"),
])
def test_bad_gguf_file_is_a_model_error_naming_the_key(bad_files, kind, message):
    folder = str(next(iter(bad_files.values())).parent)
    name = "missing.gguf" if kind == "missing" else bad_files[kind].name
    with pytest.raises(ModelError, match="^models.gguf_file: ") as e:
        check_model_path(folder, "models.target", gguf_file=name, gguf_key="models.gguf_file")
    assert message in str(e.value)
    with pytest.raises(ModelError, match="^models.drafter_gguf_file: "):
        check_model_path(folder, "models.drafter", gguf_file=name, gguf_key="models.drafter_gguf_file")


def test_gguf_folder_missing_names_the_model_key(tmp_path):
    with pytest.raises(ModelError, match="models.drafter: model path .* does not exist"):
        check_model_path(str(tmp_path / "nope"), "models.drafter", gguf_file="x.gguf", gguf_key="models.drafter_gguf_file")


def test_drafter_gguf_is_checked_only_when_the_method_uses_it(tiny_gguf, bad_files):
    folder, name, _ = tiny_gguf
    sets = [f"models.target={folder}", f"models.gguf_file={name}", f"models.drafter={bad_files['text'].parent}",
            f"models.drafter_gguf_file={bad_files['text'].name}"]
    with pytest.raises(ModelError, match="models.drafter_gguf_file"):
        cfg = load_config(None, sets + ["method.name=draft_model"])
        check_models(cfg.models, cfg.uses_drafter)
    cfg = load_config(None, sets + ["method.name=prompt_lookup"])
    check_models(cfg.models, cfg.uses_drafter)  # the drafter is not loaded by prompt_lookup


def test_job_with_a_bad_gguf_file_exits_2_before_ray_starts(tmp_path, bad_files):
    (tmp_path / "in.jsonl").write_text(json.dumps({"id": 1, "text": "x"}) + "\n")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({
        "input": {"uri": str(tmp_path / "in.jsonl")},
        "models": {"target": str(bad_files["header_only"].parent), "gguf_file": bad_files["header_only"].name,
                   "drafter": None},
        "method": {"name": "plain"},
        "output": {"uri": str(tmp_path / "out")},
    }))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTHONPATH")}
    r = subprocess.run([sys.executable, str(REPO / "jobs" / "summarize.py"), "--config", str(job)],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "error: models.gguf_file: 'header.gguf' is not a readable GGUF checkpoint" in r.stderr
    assert "Traceback" not in r.stderr and "Started a local Ray instance" not in r.stderr
    assert not (tmp_path / "out").exists()
