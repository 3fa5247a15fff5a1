"""Checks that stop a bad job in the driver, before Ray starts: architectures from the
config alone (a decoder-only causal LM; encoder-decoders such as T5, BART and Whisper,
encoders such as DistilBERT refused), the drafter's vocabulary against the target's, the
prompt rendered once with the chat template and system prompt.  Every known refusal is
exit 2 in one line; a run where every row failed exits 1; an unexpected error is one line
plus a log file with the traceback."""

import os
import shutil
import subprocess
import sys
import time

import pytest

from pipeline_testkit import REPO, TEXTS, job_config, write_jsonl
from pipeline.config import ConfigError, TaskConfig
from pipeline.models import ModelError, check_models
from pipeline.prompts import check_prompt
from tiny import make_tokenizer


def _save(config, path, tokenizer=True, chat_template=None):
    config.save_pretrained(path)
    if tokenizer:
        make_tokenizer(chat_template).save_pretrained(path)
    return str(path)


NOT_CAUSAL = [  # (config factory, what the refusal says)
    (lambda: __import__("transformers").T5Config(d_model=32, num_layers=1, num_heads=2, d_kv=8, d_ff=64,
                                                 vocab_size=128), "a t5 model .* an encoder-decoder model"),
    (lambda: __import__("transformers").BartConfig(d_model=32, encoder_layers=1, decoder_layers=1, vocab_size=128),
     "a bart model .* an encoder-decoder model"),
    (lambda: __import__("transformers").WhisperConfig(d_model=32, encoder_layers=1, decoder_layers=1),
     "a whisper model .* an encoder-decoder model"),
    (lambda: __import__("transformers").DistilBertConfig(dim=32, n_layers=1, n_heads=2, hidden_dim=64),
     "a distilbert model .* AutoModelForCausalLM cannot load: not a causal language model"),
]


@pytest.mark.parametrize("make, message", NOT_CAUSAL, ids=["t5", "bart", "whisper", "distilbert"])
@pytest.mark.parametrize("role", ["target", "drafter"])
def test_a_model_that_is_not_a_decoder_only_causal_lm_is_refused_from_its_config(tiny_models, tmp_path, make,
                                                                                   message, role):
    bad = _save(make(), tmp_path / "m")
    cfg = job_config(dict(tiny_models, **{role: bad}), "unused", str(tmp_path / "o")).models
    with pytest.raises(ModelError, match=f"models.{role}: .*{message}"):
        check_models(cfg, uses_drafter=True, method="draft_model")


@pytest.mark.parametrize("damage", ["garbage", "truncated", "missing shard"])
def test_a_corrupt_weight_file_is_refused_from_its_header(tiny_models, tmp_path, damage):
    m = tmp_path / "m"
    shutil.copytree(tiny_models["target"], m)
    weights = m / "model.safetensors"
    if damage == "garbage":
        weights.write_bytes(b"corrupt")
    elif damage == "truncated":
        os.truncate(weights, weights.stat().st_size - 100)
    else:
        weights.rename(m / "model-00001-of-00002.safetensors")
        (m / "model.safetensors.index.json").write_text(
            '{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}')
    cfg = job_config(dict(tiny_models, target=str(m)), "unused", str(tmp_path / "o")).models
    message = ".* lacks weight files its index names: model-00002-of-00002" if damage == "missing shard" else \
        "weight file model.safetensors of .* is unreadable: SafetensorError"
    with pytest.raises(ModelError, match=f"models.target: {message}"):
        check_models(cfg, uses_drafter=True, method="draft_model")


def test_the_drafter_must_share_the_targets_vocabulary_for_draft_model(tiny_models, tmp_path):
    from transformers import LlamaConfig

    small = _save(LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=1), tmp_path / "small", tokenizer=False)
    cfg = job_config(dict(tiny_models, drafter=small), "unused", str(tmp_path / "o")).models
    with pytest.raises(ModelError, match="models.drafter does not fit models.target for method 'draft_model': "
                                         "drafter vocabulary \\(16 ids\\) cannot map onto"):
        check_models(cfg, uses_drafter=True, method="draft_model")
    # a drafter whose tokenizer maps the same words to other ids
    other = tmp_path / "other"
    shutil.copytree(tiny_models["drafter"], other)
    tok = make_tokenizer()
    vocab = tok.get_vocab()
    words = sorted(vocab, key=vocab.get)
    from tokenizers import models

    swapped = {w: i for i, w in enumerate(words[:4] + list(reversed(words[4:])))}
    tok.backend_tokenizer.model = models.WordLevel(vocab=swapped, unk_token="<unk>")
    tok.save_pretrained(other)
    cfg = job_config(dict(tiny_models, drafter=str(other)), "unused", str(tmp_path / "o")).models
    with pytest.raises(ModelError, match="drafter tokenizer differs from the target's"):
        check_models(cfg, uses_drafter=True, method="draft_model")
    check_models(cfg, uses_drafter=True, method="universal")  # another tokenizer is what universal is for


SYSTEMLESS = ("{% for m in messages %}{% if m['role'] == 'system' %}"
              "{{ raise_exception('System role not supported') }}{% endif %}<s> {{ m['content'] }} {% endfor %}")


def test_the_prompt_is_rendered_once_in_the_driver_with_the_system_prompt():
    tok = make_tokenizer(chat_template=SYSTEMLESS)
    assert check_prompt(tok, TaskConfig()).startswith("<s> Summarize")  # no system prompt: fine
    with pytest.raises(ConfigError, match="task.chat_template .* and task.system_prompt: .*System role not supported"):
        check_prompt(tok, TaskConfig(system_prompt="Be brief."))
    with pytest.raises(ConfigError, match="task.chat_template is true but the target's tokenizer has no chat template"):
        check_prompt(make_tokenizer(), TaskConfig(chat_template=True))
    assert check_prompt(make_tokenizer(), TaskConfig(system_prompt="ignored without a chat template"))


def _cli(args, timeout=120):
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(REPO / "jobs" / "summarize.py"), *args], capture_output=True, text=True,
                       env=env, timeout=timeout)
    return r, time.monotonic() - t0


def _said(stderr):
    """stderr without the job's INFO log lines."""
    return [ln for ln in stderr.splitlines() if ln.strip() and " specbatch INFO " not in ln]


@pytest.mark.parametrize("case", ["t5 target", "chat_template=true", "system prompt the template refuses"])
def test_known_refusals_are_exit_2_in_one_line_before_ray_starts(tiny_models, tmp_path, case):
    write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "text": TEXTS[0]}])
    target, sets = tiny_models["target"], []
    if case == "t5 target":
        target = _save(NOT_CAUSAL[0][0](), tmp_path / "t5")
    elif case == "chat_template=true":
        sets = ["--set", "task.chat_template=true"]
    else:
        target = str(tmp_path / "chat")
        shutil.copytree(tiny_models["target"], target)
        make_tokenizer(chat_template=SYSTEMLESS).save_pretrained(target)
        sets = ["--set", "task.system_prompt=Be brief."]
    r, elapsed = _cli(["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out"), "--target", target,
                       "--drafter", tiny_models["drafter"], *sets])
    assert r.returncode == 2, r.stderr
    said = _said(r.stderr)
    assert len(said) == 1 and said[0].startswith("error: ") and "Traceback" not in r.stderr, r.stderr
    assert "Started a local Ray instance" not in r.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize("key, value", [("compute.cpus_per_actor", "0.00005"), ("compute.gpus_per_actor", "1e-5"),
                                        ("serve.cpus_per_replica", "0.00009"), ("serve.gpus_per_replica", "5e-5")])
def test_a_resource_ray_cannot_represent_is_refused_before_ray_starts_naming_the_key(tmp_path, capsys, key, value):
    """Ray counts CPUs and GPUs in steps of 0.0001: a smaller amount (not 0) failed after Ray
    started ("precision ... cannot go beyond 0.0001", exit 1); it is refused by the config."""
    import ray

    from pipeline.cli import main
    from pipeline.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=f"{key}: {float(value):g} is less than 0.0001, the smallest amount"):
        load_config(None, [f"{key}={value}"])
    assert load_config(None, [f"{key}=0.0001"])  # the unit itself is fine, and so is no GPU
    assert load_config(None, ["compute.gpus_per_actor=0", "serve.gpus_per_replica=0"])
    write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "text": TEXTS[0]}])
    was_running = ray.is_initialized()
    assert main("summarize", ["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out"),
                              "--set", f"{key}={value}"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and key in err[0] and "0.0001" in err[0]
    assert ray.is_initialized() == was_running and not (tmp_path / "out").exists()


def test_a_run_where_every_row_failed_exits_1(ray_local, tiny_models, tmp_path, capsys):
    from pipeline.cli import main

    write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "text": ""}, {"id": 2, "text": "   "}, {"id": 3}])
    args = ["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out"), "--target",
            tiny_models["target"], "--method", "plain", "--no-progress", "--set", "output.partition_by_date=false"]
    assert main("summarize", args) == 1
    err = capsys.readouterr().err
    assert "error: every row failed (3 rows; PromptError (3)); the output holds each row's error" in err
    assert main("summarize", args) == 1  # the stored output says the same on a rerun (nothing to do)


def test_an_unexpected_error_is_one_line_and_a_log_file(tmp_path, capsys, monkeypatch):
    import pipeline.run
    from pipeline.cli import main

    def broken(cfg, progress=True):
        raise RuntimeError("something odd\nwith a second line")

    monkeypatch.setattr(pipeline.run, "run_job", broken)
    assert main("summarize", ["--output", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: RuntimeError: something odd (traceback in ")
    log = err[0].split("(traceback in ", 1)[1].split(")", 1)[0]
    text = open(log).read()
    assert "Traceback" in text and "with a second line" in text and "def broken" not in err[0]


@pytest.mark.slow
def test_an_actor_that_dies_loading_its_model_is_one_line_with_the_cause(tiny_models, tmp_path):
    """Readable weights of a model of another size pass the driver's checks; the actors die
    loading them: one line with Ray's error and its root cause, the traceback in a log file
    (no actor traceback and no Ray Data stack trace on the console)."""
    from tiny import make_model_pair

    broken = tmp_path / "broken"
    shutil.copytree(tiny_models["target"], broken)
    other, _ = make_model_pair(tmp_path / "other", hidden=32)
    shutil.copy(os.path.join(other, "model.safetensors"), broken / "model.safetensors")
    write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "text": TEXTS[0]}])
    r, _ = _cli(["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out"), "--target", str(broken),
                 "--method", "plain", "--no-progress", "--set", "compute.max_actor_restarts=0"], timeout=240)
    assert r.returncode == 1, r.stderr[-3000:]
    said = [ln for ln in _said(r.stderr) if "Started a local Ray instance" not in ln and "core_worker.cc:2465" not in ln]
    assert len(said) == 1, r.stderr[-3000:]
    assert said[0].startswith("error: ActorDiedError: ") and "; cause: RuntimeError: " in said[0]
    log = said[0].split("(traceback in ", 1)[1].split(")", 1)[0]
    assert "size mismatch" in open(log).read() or "mismatched" in open(log).read()
    assert "Traceback" not in r.stderr and "Full stack trace" not in r.stderr
