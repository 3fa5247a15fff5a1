"""Resume compares the config: each committed shard records a fingerprint of everything
that changes outputs (models and their files, method and parameters, generation settings,
task and prompt/chat template, system prompt); a run under another fingerprint is refused
(exit 2) naming what changed and pointing to --overwrite, which redoes the output; settings
that do not change outputs (actors, batch size, retries, file size) resume."""

import json
import os
import shutil
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline_testkit import REPO, TEXTS, committed, job_config, write_jsonl
from pipeline.fingerprint import config_fingerprint, config_identity, describe_changes, file_identity, model_files
from pipeline.input import units_of, resolve_shards
from pipeline.output import OutputError
from pipeline.output import OutputWriter
from pipeline.schema import OUTPUT_SCHEMA


@pytest.fixture
def inputs(tmp_path):
    write_jsonl(tmp_path / "in" / "a.jsonl", [{"id": i, "key": f"k{i}", "text": t, "body": t[::-1]}
                                              for i, t in enumerate(TEXTS[:2])])
    return tmp_path / "in"


def _commit_shard0(cfg):
    w = OutputWriter(cfg.output, retry=cfg.retry)
    shards = resolve_shards(cfg.input)
    assert w.on_write_start(shards, config_identity(cfg)).done == []
    w.write_part(shards[0], pa.Table.from_pylist([{"id": f"0{i}", "source_row": i} for i in range(shards[0].num_rows)],
                                                schema=OUTPUT_SCHEMA))
    w.on_write_complete({"rows": 1})


def _resume(cfg):
    return OutputWriter(cfg.output, retry=cfg.retry).on_write_start(resolve_shards(cfg.input), config_identity(cfg))


CHANGES = [  # (override, what the refusal names)
    ("method.name=plain", "method.name: 'draft_model' -> 'plain'"),
    ("method.num_assistant_tokens=3", "method.num_assistant_tokens: (unset) -> 3"),
    ("generation.max_new_tokens=8", "generation.max_new_tokens: 12 -> 8"),
    ("generation.do_sample=true", "generation.do_sample: (unset) -> True"),
    ("generation.seed=7", "generation.seed: (unset) -> 7"),
    ('task.prompt_template="Sum up: {text}"', "task.prompt_template: 'Summarize the following article"),
    ("task.system_prompt=Be brief.", "task.system_prompt: (unset) -> 'Be brief.'"),
    ("task.chat_template=false", "task.chat_template: 'auto' -> False"),
    ("models.dtype=bfloat16", "models.dtype: 'auto' -> 'bfloat16'"),
    ("input.text_column=body", "input.text_column: 'text' -> 'body'"),
    ("input.id_column=key", "input.id_column: 'id' -> 'key'"),
    ("input.format=jsonl", "input.format: 'auto' -> 'jsonl'"),
]


@pytest.mark.parametrize("override, named", CHANGES, ids=[c[0].split("=")[0] for c in CHANGES])
def test_resume_under_another_config_is_refused_naming_the_change(tiny_models, inputs, tmp_path, override, named):
    out = str(tmp_path / "out")
    _commit_shard0(job_config(tiny_models, str(inputs), out))
    with pytest.raises(OutputError, match="another config") as e:
        _resume(job_config(tiny_models, str(inputs), out, overrides=[override]))
    assert named in str(e.value) and "--overwrite" in str(e.value)
    # --overwrite redoes it from scratch under the new config
    assert OutputWriter(job_config(tiny_models, str(inputs), out, overrides=[override, "output.overwrite=true"]).output
                        ).on_write_start(resolve_shards(job_config(tiny_models, str(inputs), out).input)).done == []


@pytest.mark.parametrize("override", ["compute.num_actors=2", "compute.rows_per_batch=1", "retry.attempts=2",
                                      "output.max_rows_per_file=5", "audit.fraction=0.5", "generation.top_k=null",
                                      "compute.stall_timeout_s=60"])
def test_settings_that_do_not_change_outputs_resume(tiny_models, inputs, tmp_path, override):
    out = str(tmp_path / "out")
    _commit_shard0(job_config(tiny_models, str(inputs), out))
    assert _resume(job_config(tiny_models, str(inputs), out, overrides=[override])).done == ["part-00000-u00000.parquet"]


def test_the_drafter_counts_only_for_methods_that_use_it(tiny_models, inputs, tmp_path):
    other = tmp_path / "other-drafter"
    shutil.copytree(tiny_models["drafter"], other)
    plain = job_config(tiny_models, str(inputs), str(tmp_path / "o1"), method="plain")
    assert config_fingerprint(config_identity(plain)) == config_fingerprint(config_identity(
        job_config(dict(tiny_models, drafter=str(other)), str(inputs), str(tmp_path / "o1"), method="plain")))
    out = str(tmp_path / "o2")
    _commit_shard0(job_config(tiny_models, str(inputs), out))
    # the same drafter files at another path are the same drafter: resume goes on
    _resume(job_config(dict(tiny_models, drafter=str(other)), str(inputs), out))
    (other / "config.json").write_text((other / "config.json").read_text().replace("{", '{"x_retrained": 1, ', 1))
    with pytest.raises(OutputError, match="model_files.drafter: files changed: config.json"):
        _resume(job_config(dict(tiny_models, drafter=str(other)), str(inputs), out))


def test_model_files_are_identified_by_content_not_by_time(tiny_models, tmp_path):
    from safetensors.torch import load_file, save_file

    m = tmp_path / "m"
    shutil.copytree(tiny_models["target"], m)
    before = model_files(str(m))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(before)
    os.utime(m / "model.safetensors", (1, 1))  # a copy or an unpacked working dir: new times, same bytes
    assert model_files(str(m)) == before
    (m / "README.md").write_text("a model card does not change outputs")
    assert model_files(str(m)) == before
    tensors = load_file(m / "model.safetensors")
    name = sorted(tensors)[len(tensors) // 2]
    tensors[name] = tensors[name] + 1e-3  # "retrained": same shapes, same size
    save_file(tensors, m / "model.safetensors", metadata={"format": "pt"})
    after = model_files(str(m))
    assert after["model.safetensors"] != before["model.safetensors"]
    old_id, new_id = {"model_files": {"target": before}}, {"model_files": {"target": after}}
    assert describe_changes(old_id, new_id) == "model_files.target: files changed: model.safetensors"
    tok = json.loads((m / "tokenizer_config.json").read_text())
    tok["chat_template"] = "{{ messages[0]['content'] }}"
    (m / "tokenizer_config.json").write_text(json.dumps(tok))
    assert model_files(str(m))["tokenizer_config.json"] != before["tokenizer_config.json"]


@pytest.fixture
def hash_cache(tmp_path, monkeypatch):
    """A fresh per-user hash cache for the test."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "specbatch" / "file-hashes.json"


def _hash_reads(monkeypatch):
    """The paths pipeline.fingerprint opens to hash, from now on."""
    import pipeline.fingerprint as fp

    opened = []

    def spy(path, mode="r", *a, **k):
        if path != fp.hash_cache_path():
            opened.append(os.path.basename(path))
        return open(path, mode, *a, **k)

    monkeypatch.setattr(fp, "open", spy, raising=False)
    return opened


def test_large_files_are_hashed_whole_once_per_version(tmp_path, hash_cache, monkeypatch):
    import hashlib

    big = tmp_path / "weights.gguf"
    size = 9 * 2**20 + 123
    data = bytearray(os.urandom(size))
    big.write_bytes(data)
    ident = file_identity(str(big))
    assert ident == "sha256:" + hashlib.sha256(data).hexdigest()  # every byte counts
    assert hash_cache.exists() and oct(hash_cache.parent.stat().st_mode & 0o777) == "0o700"
    reads = _hash_reads(monkeypatch)
    assert file_identity(str(big)) == ident and reads == []  # cached: not read again
    for offset in (size // 3, size // 2 + 4321, size - 10):  # one byte anywhere, not only in a sample
        st = big.stat()
        with open(big, "r+b") as f:
            f.seek(offset)
            b = f.read(1)
            f.seek(offset)
            f.write(bytes([b[0] ^ 0xFF]))
        os.utime(big, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same mtime
        changed = file_identity(str(big))
        assert changed != ident and reads[-1] == "weights.gguf"
        with open(big, "r+b") as f:
            f.seek(offset)
            f.write(b)
    copy = tmp_path / "copy.gguf"
    shutil.copy(big, copy)  # the same bytes elsewhere: hashed once, the same identity
    assert file_identity(str(copy)) == file_identity(str(big)) == ident


def _with_big_weights(src, dst):
    """A copy of a tiny checkpoint whose weights file is > 9 MiB (a padding tensor)."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    tensors["zz_padding"] = torch.zeros(3 * 2**20)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("edit", ["a tensor in the middle", "the tokenizer", "the chat template"])
def test_a_checkpoint_edited_in_place_is_refused_on_resume_and_a_rerun_rehashes_nothing(
        tiny_models, inputs, tmp_path, hash_cache, monkeypatch, edit):
    m = _with_big_weights(tiny_models["target"], tmp_path / "m")
    out = str(tmp_path / "out")
    cfg = lambda: job_config(dict(tiny_models, target=str(m)), str(inputs), out)
    _commit_shard0(cfg())
    reads = _hash_reads(monkeypatch)
    assert _resume(cfg()).done == ["part-00000-u00000.parquet"] and reads == []  # nothing rehashed
    if edit == "a tensor in the middle":
        weights = m / "model.safetensors"
        header = int.from_bytes(weights.read_bytes()[:8], "little")
        a, b = json.loads(weights.read_bytes()[8:8 + header])["zz_padding"]["data_offsets"]
        start = 8 + header + a + (b - a) // 3  # away from the start, middle and end of the file
        st = weights.stat()
        with open(weights, "r+b") as f:  # same size, same header, same mtime: one tensor's bytes
            f.seek(start)
            f.write(b"\x01\x02\x03\x04")
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
        changed = "model.safetensors"
    elif edit == "the tokenizer":
        tok = json.loads((m / "tokenizer.json").read_text())
        tok["model"]["vocab"]["cat"], tok["model"]["vocab"]["dog"] = tok["model"]["vocab"]["dog"], tok["model"]["vocab"]["cat"]
        (m / "tokenizer.json").write_text(json.dumps(tok))
        changed = "tokenizer.json"
    else:
        t = json.loads((m / "tokenizer_config.json").read_text())
        t["chat_template"] = "{{ messages[0]['content'] }}"
        (m / "tokenizer_config.json").write_text(json.dumps(t))
        changed = "tokenizer_config.json"
    with pytest.raises(OutputError, match=f"model_files.target: files changed: {changed}"):
        _resume(cfg())
    assert reads == [changed]  # only the edited file was read again


def test_shards_fingerprinted_by_an_older_version_are_refused_saying_so(tiny_models, inputs, tmp_path):
    old = config_identity(job_config(tiny_models, str(inputs), str(tmp_path / "o")))
    del old["scheme"], old["input"]
    new = config_identity(job_config(tiny_models, str(inputs), str(tmp_path / "o")))
    assert describe_changes(old, new).startswith("the committed shards were fingerprinted by an older version")


def _cli(args, timeout=120):
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    return subprocess.run([sys.executable, str(REPO / "jobs" / "summarize.py"), *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


@pytest.mark.slow
def test_the_issue_example_plain_then_draft_model(ray_local, tiny_models, tmp_path):
    """Run plain (max 4 tokens); the same input and output with draft_model (max 8) is
    refused with exit 2, before any model loads, naming both changes; a partly overlapping
    input (one more shard) too; --overwrite redoes every shard with draft_model."""
    from pipeline.run import run_job

    for i in range(2):
        write_jsonl(tmp_path / "in" / f"s{i}.jsonl", [{"id": f"{i}-{j}", "text": TEXTS[i + j]} for j in range(2)])
    out = tmp_path / "out"
    base = [f"--input={tmp_path / 'in'}", f"--output={out}", f"--target={tiny_models['target']}",
            f"--drafter={tiny_models['drafter']}", "--no-progress", "--set", "output.partition_by_date=false"]
    first = run_job(job_config(tiny_models, str(tmp_path / "in"), str(out), method="plain",
                               overrides=["generation.max_new_tokens=4"]), progress=False)
    assert first["rows"] == 4
    before = {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    r = _cli([*base, "--method", "draft_model", "--max-new-tokens", "8"])
    assert r.returncode == 2, r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in r.stderr
    for named in ("method.name: 'plain' -> 'draft_model'", "generation.max_new_tokens: 4 -> 8", "--overwrite"):
        assert named in err[0]
    write_jsonl(tmp_path / "in" / "s2.jsonl", [{"id": "2-0", "text": TEXTS[5]}])  # partly overlapping input
    r = _cli([*base, "--method", "draft_model", "--max-new-tokens", "8"])
    assert r.returncode == 2 and "method.name: 'plain' -> 'draft_model'" in r.stderr
    assert {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # untouched

    summary = run_job(job_config(tiny_models, str(tmp_path / "in"), str(out), method="draft_model",
                                 overrides=["generation.max_new_tokens=8", "output.overwrite=true"]), progress=False)
    assert summary["this_run"]["units_skipped"] == [] and summary["rows"] == 5
    assert set(pq.read_table(out).column("method").to_pylist()) == {"draft_model"}
    assert summary["config"]["method"]["name"] == "draft_model"


def test_resume_under_another_config_is_refused_on_s3(tiny_models, moto_s3, tmp_path):
    client = moto_s3["client"]
    client.create_bucket(Bucket="fingerprints")
    client.put_object(Bucket="fingerprints", Key="in/a.jsonl", Body=json.dumps({"id": 1, "text": TEXTS[0]}).encode() + b"\n")
    opts = moto_s3["options_json"]
    cfg = lambda *o: job_config(tiny_models, "s3://fingerprints/in/", "s3://fingerprints/out", overrides=[
        f"input.storage_options={opts}", f"output.storage_options={opts}", *o])
    w = OutputWriter(cfg().output)
    shards = resolve_shards(cfg().input)
    w.on_write_start(shards, config_identity(cfg()))
    w.write_part(shards[0], pa.Table.from_pylist([{"id": f"1{i}", "source_row": i} for i in range(shards[0].num_rows)],
                                                schema=OUTPUT_SCHEMA))
    entry = committed("s3://fingerprints/out", opts)["part-00000-u00000.parquet"]
    assert entry.config_fingerprint == config_fingerprint(config_identity(cfg()))
    assert OutputWriter(cfg().output).on_write_start(resolve_shards(cfg().input), config_identity(cfg())).done == ["part-00000-u00000.parquet"]
    with pytest.raises(OutputError, match="generation.max_new_tokens: 12 -> 5"):
        OutputWriter(cfg().output).on_write_start(resolve_shards(cfg().input),
                                           config_identity(cfg("generation.max_new_tokens=5")))


# ------------------------------------------------------------ no more than decides the output
def _run_identity(cfg):
    """The identity the job's preflight records: with the resolved generation settings and the shards."""
    from pipeline.processor import check_generation
    from pipeline.run import run_identity

    return run_identity(cfg, check_generation(cfg), resolve_shards(cfg.input))


def _commit_as_run(cfg):
    w = OutputWriter(cfg.output, retry=cfg.retry)
    shards = resolve_shards(cfg.input)
    assert w.on_write_start(units_of(shards), _run_identity(cfg)).done == []
    rows = [{"id": str(i), "source_row": i} for i in range(shards[0].num_rows)]
    w.write_part(shards[0], pa.Table.from_pylist(rows, schema=OUTPUT_SCHEMA))
    w.on_write_complete({"rows": len(rows)})


def _resume_as_run(cfg):
    return OutputWriter(cfg.output, retry=cfg.retry).on_write_start(units_of(resolve_shards(cfg.input)), _run_identity(cfg))


SAME_OUTPUT = [  # (the first run's settings, the resumed run's): nothing that decides an output changed
    ([], ["input.format=jsonl"]),
    (['generation.stop_strings=["cat", "dog"]'], ['generation.stop_strings=["dog", "cat", "dog"]']),
    (["generation.suppress_tokens=[5, 7]"], ["generation.suppress_tokens=[7, 5]"]),
    (["generation.do_sample=false", "generation.seed=1"], ["generation.do_sample=false", "generation.seed=2"]),
    ([], ["generation.seed=3", "generation.temperature=0.5", "generation.top_k=4"]),  # greedy by the checkpoint
    (["method.name=plain"], ["method.name=plain", "method.draft_vocab_size=64", "method.num_mtp_layers=1"]),
    (["method.name=prompt_lookup"], ["method.name=prompt_lookup", "method.num_assistant_tokens=2",
                                     "method.assistant_confidence_threshold=0.3"]),
]


@pytest.mark.parametrize("first, then", SAME_OUTPUT, ids=[" ".join(t) for _, t in SAME_OUTPUT])
def test_changes_that_cannot_change_an_output_resume(tiny_models, inputs, tmp_path, first, then):
    out = str(tmp_path / "out")
    _commit_as_run(job_config(tiny_models, str(inputs), out, overrides=first))
    assert _resume_as_run(job_config(tiny_models, str(inputs), out, overrides=then)).done == ["part-00000-u00000.parquet"]


OTHER_OUTPUT = [  # ... and their neighbours that do change it are still refused, naming the change
    (['generation.stop_strings=["cat", "dog"]'], ['generation.stop_strings=["cat"]'], "generation.stop_strings"),
    (["generation.do_sample=true", "generation.seed=1"], ["generation.do_sample=true", "generation.seed=2"],
     "generation.seed: 1 -> 2"),
    (["generation.do_sample=true"], ["generation.do_sample=true", "generation.temperature=0.5"],
     "generation.temperature"),
    (["method.name=prompt_lookup"], ["method.name=prompt_lookup", "method.prompt_lookup_num_tokens=3"],
     "method.prompt_lookup_num_tokens: (unset) -> 3"),
    (["method.name=draft_model"], ["method.name=draft_model", "method.assistant_confidence_threshold=0.3"],
     "method.assistant_confidence_threshold"),
]


@pytest.mark.parametrize("first, then, named", OTHER_OUTPUT, ids=[" ".join(t) for _, t, _ in OTHER_OUTPUT])
def test_changes_that_change_an_output_are_still_refused(tiny_models, inputs, tmp_path, first, then, named):
    out = str(tmp_path / "out")
    _commit_as_run(job_config(tiny_models, str(inputs), out, overrides=first))
    with pytest.raises(OutputError, match="another config") as e:
        _resume_as_run(job_config(tiny_models, str(inputs), out, overrides=then))
    assert named in str(e.value)


def test_a_config_may_keep_other_methods_settings_and_the_engine_gets_only_its_own(tiny_models, tmp_path):
    from pipeline.config import ConfigError, load_config

    cfg = load_config(REPO / "configs" / "real" / "smollm2-xsum-eagle.yaml", ["method.name=plain"])
    assert cfg.method.params["draft_vocab_size"] == 4096  # kept in the config (and its summary)
    assert cfg.method.speculation_settings().draft_vocab_size is None  # not the engine's
    cfg = job_config(tiny_models, "unused", str(tmp_path / "o"), method="prompt_lookup",
                     overrides=["method.draft_vocab_size=64", "method.num_mtp_layers=2"])
    spec = cfg.method.speculation_settings()
    assert (spec.method, spec.draft_vocab_size, spec.num_mtp_layers) == ("prompt_lookup", None, None)
    # their values are still checked, naming the key
    with pytest.raises(ConfigError, match="draft_vocab_size .* must be a positive integer, got -3"):
        job_config(tiny_models, "unused", str(tmp_path / "o"), method="plain", overrides=["method.draft_vocab_size=-3"])
    with pytest.raises(ConfigError, match="unknown key method.draft_vocab_sise"):
        job_config(tiny_models, "unused", str(tmp_path / "o"), method="plain", overrides=["method.draft_vocab_sise=3"])
