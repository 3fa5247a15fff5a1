"""The public processor (``pipeline.processor.build_processor``) in a local Ray.

Over Datasets built here (``ray.data.from_items``; ``read_parquet`` of a Hive-partitioned
folder), with chat-message preprocess and a postprocess: the outputs and statistics equal
what the job writes for the same rows and settings (greedy), a bad row is an error row,
per-row settings apply, and a pool of one actor per CPU behind a CPU-using read does not
hang.  Four dataset runs in all, on the tiny model pair.
"""

from __future__ import annotations

import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline_testkit import TEXTS, job_config, write_jsonl
from pipeline.prompts import fill_template
from pipeline.run import run_job, stall_guard

CHAT = "{% for m in messages %}<s> {{ m['content'] }} {% endfor %}summary"
COUNTS = ("prompt_tokens", "new_tokens", "verify_steps", "draft_tokens", "accepted_tokens", "acceptance_rate",
          "mean_accepted_length", "drafted_per_position", "accepted_per_position", "draft_steps",
          "tokens_per_step", "finish_reason", "output_text", "prompt", "method", "target_model", "draft_model",
          "error", "audit")
ROWS = [{"id": f"r{i}", "text": t} for i, t in enumerate(TEXTS[:6])]


@pytest.fixture(scope="module")
def chat_models(tiny_models, tmp_path_factory):
    """The tiny pair, the target's tokenizer given a chat template (the job then uses it)."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("chat")
    target = shutil.copytree(tiny_models["target"], root / "target")
    tok = AutoTokenizer.from_pretrained(target)
    tok.chat_template = CHAT
    tok.save_pretrained(target)
    return {"target": str(target), "drafter": tiny_models["drafter"]}


def _cfg(models, tmp, *sets):
    # a fixed draft length: a row's statistics are then those of the row alone, whatever
    # shares its batch, so the job's and the processor's can be compared exactly
    return job_config(models, "unused", str(tmp / "unused-out"),
                      overrides=["compute.draft_length=fixed", *sets])


@pytest.fixture(scope="module")
def job_rows(ray_local, chat_models, tmp_path_factory):
    """What the job writes for ROWS: {id: row}."""
    tmp = tmp_path_factory.mktemp("job")
    write_jsonl(tmp / "in.jsonl", ROWS)
    cfg = job_config(chat_models, str(tmp / "in.jsonl"), str(tmp / "out"),
                     overrides=["compute.draft_length=fixed", "audit.fraction=1"])
    run_job(cfg, progress=False)
    return {r["id"]: r for r in pq.read_table(tmp / "out").to_pylist()}


def _check_stats(row):
    """The statistics record of a decoded row, consistent in itself."""
    assert row["error"] is None and row["new_tokens"] > 0
    assert sum(row["drafted_per_position"]) == row["draft_tokens"]
    assert sum(row["accepted_per_position"]) == row["accepted_tokens"]
    assert row["tokens_per_step"] == row["new_tokens"] / row["verify_steps"]
    if row["draft_tokens"]:
        assert row["acceptance_rate"] == row["accepted_tokens"] / row["draft_tokens"]
        assert row["mean_accepted_length"] == 1 + row["accepted_tokens"] / row["draft_steps"]
    for t in ("draft_time_s", "prefill_time_s", "verify_time_s", "wall_time_s"):
        assert row[t] >= 0


def test_chat_preprocess_and_postprocess_equal_the_job(ray_local, chat_models, job_rows, tmp_path):
    import ray

    from pipeline.processor import build_processor

    cfg = _cfg(chat_models, tmp_path, "audit.fraction=1")
    task = cfg.task

    def preprocess(row):
        if row["doc"] == "ids":
            return {}  # keeps its prompt_token_ids
        if row["doc"] == "r3":
            raise ValueError("no body")
        out = {"messages": [{"role": "user", "content": fill_template(row["body"], task)}]}
        if row["doc"] == "r4":
            out["max_new_tokens"] = 2  # a per-row setting
        if row["doc"] == "r5":
            out["max_new_tokens"] = -1  # a bad per-row setting: an error row
        return out

    def postprocess(row):
        kept = {k: v for k, v in row.items() if k != "body"}  # the output row is what it returns
        return {**kept, "summary_words": len((row["output_text"] or "").split())}

    items = [{"doc": r["id"], "body": r["text"], "lang": "en"} for r in ROWS]
    items.append({"doc": "ids", "body": "", "lang": "xx"})
    processor = build_processor(cfg.model_dump(), preprocess=preprocess, postprocess=postprocess)
    # a row given as token ids (preprocess merges into the row; this one keeps its own)
    ds = ray.data.from_items(items).map(
        lambda r: {**r, "prompt_token_ids": [5, 6, 7] if r["doc"] == "ids" else None}, num_cpus=0)
    with stall_guard(120, lambda: "the processor stalled"):
        out = {r["doc"]: r for r in processor(ds).take_all()}
    assert len(out) == 7
    for doc in ("r0", "r1", "r2"):  # chat messages == the job's text through its chat template
        got, want = out[doc], job_rows[doc]
        _check_stats(got)
        assert {k: got[k] for k in COUNTS} == {k: want[k] for k in COUNTS}, doc
        assert got["lang"] == "en" and got["messages"][0]["role"] == "user"  # input columns kept
        assert got["summary_words"] == len(got["output_text"].split()) and "body" not in got  # postprocess
        assert got["audit"] is True  # lossless audit, as in the job
    assert out["r3"]["error"] == "ValueError: preprocess: ValueError: no body"
    assert out["r3"]["new_tokens"] is None and out["r3"]["output_text"] is None
    assert out["r4"]["new_tokens"] == 2 and out["r4"]["finish_reason"] == "length"
    assert "max_new_tokens must be a positive integer" in out["r5"]["error"]
    assert out["ids"]["error"] is None and out["ids"]["prompt_tokens"] == 3


@pytest.mark.slow
def test_partitioned_parquet_with_one_actor_per_cpu_equals_the_job(ray_local, tiny_models, tmp_path):
    """``read_parquet`` (its read tasks need a CPU) + a filter + a pool of as many actors as
    the cluster has CPUs: finishes; the partition column is kept; rows equal the job's."""
    import ray

    from pipeline.processor import build_processor
    from pipeline.ray_setup import pool_plan

    table = pa.table({"id": [r["id"] for r in ROWS], "text": [r["text"] for r in ROWS],
                      "lang": ["de", "en", "de", "en", "fr", "fr"]})
    pq.write_to_dataset(table, str(tmp_path / "ds"), partition_cols=["lang"])
    cpus = int(ray.cluster_resources()["CPU"])
    cfg = _cfg(tiny_models, tmp_path, f"compute.num_actors={cpus}", "compute.rows_per_batch=2")
    assert pool_plan(cfg, embedded=True).cpus == pytest.approx((cpus - 1) / cpus, abs=1e-4)  # one CPU left for reads
    ds = ray.data.read_parquet(str(tmp_path / "ds")).filter(lambda r: r["lang"] != "fr")
    with stall_guard(180, lambda: "the processor stalled behind its own actor pool"):
        got = {r["id"]: r for r in build_processor(cfg)(ds).take_all()}
    assert sorted(got) == ["r0", "r1", "r2", "r3"] and {r["lang"] for r in got.values()} == {"de", "en"}
    # the job over the same folder: the partition column kept on output, the same rows
    job_cfg = job_config(tiny_models, str(tmp_path / "ds"), str(tmp_path / "out"),
                         overrides=["compute.draft_length=fixed", "compute.stall_timeout_s=240"])
    run_job(job_cfg, progress=False)
    written = pq.read_table(tmp_path / "out")
    assert written.column_names[-1] == "lang"
    job = {r["id"]: r for r in written.to_pylist()}
    assert {i: r["lang"] for i, r in job.items()} == dict(zip(table["id"].to_pylist(), table["lang"].to_pylist()))
    for i, row in got.items():
        _check_stats(row)
        assert {k: row[k] for k in COUNTS} == {k: job[i][k] for k in COUNTS}, i
        assert row["text"] == job_rows_text(i)  # the text column is kept too


def job_rows_text(i):
    return next(r["text"] for r in ROWS if r["id"] == i)


def test_build_processor_checks_before_any_actor(tiny_models, tmp_path):
    from pipeline.config import ConfigError
    from pipeline.models import ModelError
    from pipeline.processor import build_processor

    with pytest.raises(ConfigError, match="unknown key generation.nope"):
        build_processor({"generation": {"nope": 1}})
    with pytest.raises(ModelError):
        build_processor({"models": {"target": str(tmp_path / "missing")}, "method": {"name": "plain"}})
    path = tmp_path / "p.yaml"
    path.write_text(f"models: {{target: {tiny_models['target']}, drafter: {tiny_models['drafter']}}}\n")
    assert build_processor(path).config.models.target == tiny_models["target"]


def test_the_documented_example_runs(ray_local, tmp_path, capsys):
    """examples/processor_parquet.py: read Parquet, filter, processor, ``write_parquet``."""
    import importlib.util

    from pipeline_testkit import REPO

    spec = importlib.util.spec_from_file_location("processor_parquet", REPO / "examples" / "processor_parquet.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--output", str(tmp_path / "out"), "--max-new-tokens", "4", "--min-words", "60"]) == 0
    table = pq.read_table(tmp_path / "out")
    assert 0 < table.num_rows < 20  # the filter dropped the short articles
    assert set(table.column_names) >= {"id", "lang", "text", "summary", "new_tokens", "acceptance_rate"}
    assert all(n <= 4 for n in table.column("new_tokens").to_pylist())  # the per-row budget
    assert set(table.column("lang").to_pylist()) == {"en"}


def test_a_dataset_without_a_prompt_column_is_named_before_any_actor(ray_local, tiny_models, tmp_path):
    """A dataset with no text column at all: refused by name when its schema is known
    (``from_items``, ``read_parquet``), before any actor starts; with a preprocess (which
    might add one) or an unknown schema, each row's error names the column instead of
    "prompt is null".  The schema check runs nothing: no actor, no row decoded."""
    import ray

    from pipeline.config import ConfigError
    from pipeline.processor import Processor

    cfg = _cfg(tiny_models, tmp_path, "input.text_column=body")
    proc = Processor(cfg, generation=object())  # no model is loaded: the check comes first
    with pytest.raises(ConfigError, match=r"no column 'body' \(input.text_column\), nor prompt_token_ids, messages, "
                                          r"prompt: its columns are \['id', 'text'\]"):
        proc(ray.data.from_items([{"id": "a", "text": "x"}]))
    pq.write_table(pa.table({"id": ["a"], "article": ["x"]}), tmp_path / "a.parquet")
    with pytest.raises(ConfigError, match=r"its columns are \['id', 'article'\]"):
        proc(ray.data.read_parquet(str(tmp_path / "a.parquet")))
    for names in (["id", "body"], ["id", "prompt"], ["messages"], ["prompt_token_ids"]):
        Processor(cfg, generation=object())._check_prompt_columns(ray.data.from_items([dict.fromkeys(names, "x")]))


def test_a_batch_without_a_prompt_column_names_it_on_each_row():
    from pipeline.processor import _NameMissingPrompt, missing_prompt

    name = _NameMissingPrompt("text")
    bad = pa.table({"id": ["a", "b"], "input_error": ["preprocess: ValueError: boom", None]})
    got = name(bad).column("input_error").to_pylist()
    assert got[0] == "preprocess: ValueError: boom"  # a row's own error is kept
    assert got[1] == missing_prompt(["id", "input_error"], "text") and "no column 'text'" in got[1]
    assert name(pa.table({"id": ["a"]})).column("input_error").to_pylist() == [missing_prompt(["id"], "text")]
    ok = pa.table({"id": ["a"], "text": [None]})
    assert name(ok) is ok  # a null text is the row's own problem ("prompt is null"), the column is there
