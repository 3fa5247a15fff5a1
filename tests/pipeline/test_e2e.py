"""End to end with a local Ray: shards in, Parquet out, one row per input row, statistics
equal to the engine's for the same row; bad rows kept with an error; failed runs publish nothing."""

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

from pipeline_testkit import TEXTS, job_config, write_jsonl
from pipeline.engine import SpeculativeEngine
from pipeline.models import ModelError, load_models
from pipeline.prompts import PromptBuilder
from pipeline.input import InputError
from pipeline.run import run_job
from pipeline.config import OutputConfig
from pipeline.output import is_complete
from pipeline.output import OutputWriter
from pipeline.schema import OUTPUT_SCHEMA

STAT_COLUMNS = ("prompt_tokens", "new_tokens", "verify_steps", "draft_tokens", "accepted_tokens",
                "acceptance_rate", "mean_accepted_length", "drafted_per_position", "accepted_per_position",
                "draft_steps", "tokens_per_step", "finish_reason")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Three shards: two JSONL (one with bad rows) and one Parquet; 11 rows in all."""
    d = tmp_path_factory.mktemp("in")
    write_jsonl(d / "s0.jsonl", [{"id": i, "text": t} for i, t in enumerate(TEXTS[:4])])
    too_long = " ".join(["the cat sat on the mat"] * 60)
    write_jsonl(d / "s1.jsonl", [
        {"id": "n", "text": None}, {"id": "e", "text": ""}, {"id": "i", "text": 123},
        {"id": "long", "text": too_long}, {"id": "ok", "text": TEXTS[4]},
    ])
    pq.write_table(pa.table({"id": ["p0", "p1"], "text": TEXTS[5:7]}), d / "s2.parquet")
    return d


@pytest.fixture(scope="module")
def result(ray_local, tiny_models, inputs, tmp_path_factory):
    out = tmp_path_factory.mktemp("out") / "run"
    # a fixed draft length: the per-row statistics are then those of each row alone (the
    # measured-cost policy would cut k by this machine's timings; outputs never change)
    cfg = job_config(tiny_models, str(inputs), str(out), overrides=["compute.draft_length=fixed"])
    summary = run_job(cfg, progress=False)
    return cfg, out, summary


def test_one_output_row_per_input_row(result, inputs):
    cfg, out, summary = result
    assert is_complete(str(out))
    run = summary["run_id"]
    assert sorted(p.name for p in out.iterdir()) == ["_SUCCESS", "_manifest", "_summary.json"] + [
        f"part-{i:05d}-u00000.{run}.parquet" for i in range(3)]
    table = pq.read_table(out)
    assert table.schema.equals(OUTPUT_SCHEMA, check_metadata=False)
    assert table.num_rows == 11
    # shard i -> part i, rows in input order
    for i, (name, ids) in enumerate([("s0.jsonl", ["0", "1", "2", "3"]),
                                     ("s1.jsonl", ["n", "e", "i", "long", "ok"]),
                                     ("s2.parquet", ["p0", "p1"])]):
        part = pq.read_table(out / f"part-{i:05d}-u00000.{run}.parquet")
        assert part.column("id").to_pylist() == ids
        assert set(part.column("source_file").to_pylist()) == {str(inputs / name)}
    assert table.schema.field("error").type == pa.string()


def test_bad_rows_have_an_error_and_the_rest_succeed(result):
    _, out, summary = result
    rows = {r["id"]: r for r in pq.read_table(out).to_pylist()}
    assert "null" in rows["n"]["error"]
    assert "empty" in rows["e"]["error"]
    assert "not a string" in rows["i"]["error"]
    assert "context" in rows["long"]["error"].lower()
    ok = [r for r in rows.values() if r["id"] not in ("n", "e", "i", "long")]
    assert len(ok) == 7 and all(r["error"] is None and r["new_tokens"] > 0 for r in ok)
    assert summary["rows"] == 11 and summary["errors"] == 4


def test_statistics_equal_the_engine_in_process(result):
    cfg, out, _ = result
    m = load_models(cfg.models, cfg.uses_drafter, "cpu")
    engine = SpeculativeEngine(m.target, cfg.method.speculation_settings(), drafter=m.drafter, tokenizer=m.tokenizer,
                               draft_length=cfg.compute.draft_length)  # the job's (fixed k)
    builder = PromptBuilder(m.tokenizer, cfg.task)
    texts = dict(zip(["0", "1", "2", "3", "ok", "p0", "p1"], TEXTS[:7]))
    for row in pq.read_table(out).to_pylist():
        if row["id"] not in texts:
            continue
        prompt, ids = builder.build(texts[row["id"]])
        res = engine.generate(ids, cfg.generation.generation_settings())
        st = res.stats.to_dict()
        assert row["prompt"] == prompt
        for k in STAT_COLUMNS:
            assert row[k] == st[k], (row["id"], k)
        assert row["output_text"] == m.tokenizer.decode(res.token_ids, skip_special_tokens=True)
        assert row["wall_time_s"] > 0 and row["verify_time_s"] > 0 and row["prefill_time_s"] > 0
        assert row["method"] == "draft_model" and row["draft_model"] == cfg.models.drafter


def test_summary_sums_before_dividing(result):
    cfg, out, summary = result
    on_disk = json.loads((out / "_summary.json").read_text())
    assert on_disk["run_id"] == summary["run_id"] and on_disk["config"]["method"]["name"] == "draft_model"
    # the resolved generation settings: the job's keys, the checkpoint's defaults for the rest
    assert on_disk["generation"]["max_new_tokens"] == 12 and on_disk["generation"]["do_sample"] is False
    t = pq.read_table(out).to_pydict()
    ok = [i for i, e in enumerate(t["error"]) if e is None]
    new = sum(t["new_tokens"][i] for i in ok)
    drafted = sum(t["draft_tokens"][i] for i in ok)
    accepted = sum(t["accepted_tokens"][i] for i in ok)
    steps = sum(t["verify_steps"][i] for i in ok)
    draft_steps = sum(t["draft_steps"][i] for i in ok)
    assert 0 < draft_steps <= steps
    assert on_disk["new_tokens"] == new and on_disk["draft_tokens"] == drafted
    assert on_disk["draft_steps"] == draft_steps
    assert on_disk["acceptance_rate"] == pytest.approx(accepted / drafted)
    assert on_disk["mean_accepted_length"] == pytest.approx(1 + accepted / draft_steps)
    assert on_disk["tokens_per_step"] == pytest.approx(new / steps)
    assert on_disk["tokens_per_s"] == pytest.approx(new / on_disk["generate_elapsed_s"])
    assert [p["part"] for p in on_disk["parts"]] == ["part-00000-u00000.parquet", "part-00001-u00000.parquet", "part-00002-u00000.parquet"]
    assert sum(on_disk["drafted_per_position"]) == drafted


def test_prompt_lookup_run_has_no_drafter(ray_local, tiny_models, inputs, tmp_path):
    cfg = job_config(tiny_models, str(inputs / "s2.parquet"), str(tmp_path / "o"), method="prompt_lookup")
    summary = run_job(cfg, progress=False)
    t = pq.read_table(tmp_path / "o").to_pylist()
    assert summary["rows"] == 2 and all(r["draft_model"] is None and r["method"] == "prompt_lookup" for r in t)


def test_errors_before_any_model_loads(tiny_models, inputs, tmp_path, monkeypatch):
    """Missing input, missing model path: a clear error, no actor, no output."""
    import pipeline.loading

    def boom(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(pipeline.loading, "load_models", boom)
    with pytest.raises(InputError, match="input not found"):
        run_job(job_config(tiny_models, str(tmp_path / "missing.jsonl"), str(tmp_path / "o1")), progress=False)
    bad = dict(tiny_models, drafter=str(tmp_path / "no-such-drafter"))
    with pytest.raises(ModelError, match="models.drafter.*does not exist"):
        run_job(job_config(bad, str(inputs), str(tmp_path / "o2")), progress=False)
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


def test_failed_run_publishes_nothing(ray_local, tiny_models, inputs, tmp_path):
    """The actors cannot load the weights (readable files, but of a model of another size:
    only loading finds out): the run fails, no part and no _SUCCESS is published."""
    from tiny import make_model_pair

    broken = tmp_path / "broken-target"
    shutil.copytree(tiny_models["target"], broken)
    other, _ = make_model_pair(tmp_path / "other", hidden=32)
    shutil.copy(Path(other) / "model.safetensors", broken / "model.safetensors")
    out = tmp_path / "out"
    # an earlier complete run in the same place
    old = OutputWriter(OutputConfig(uri=str(out)))
    old.on_write_start()
    old.write_part(0, pa.Table.from_pylist([{"id": "old", "source_row": 0}], schema=OUTPUT_SCHEMA))
    old.on_write_complete({"rows": 1})
    assert is_complete(str(out))
    cfg = job_config(dict(tiny_models, target=str(broken)), str(inputs / "s2.parquet"), str(out),
                     overrides=["output.overwrite=true"])
    with pytest.raises(Exception) as e:
        run_job(cfg, progress=False)
    assert not isinstance(e.value, (ModelError, InputError)), e.value  # it failed in the actor
    assert not is_complete(str(out))
    assert not (out / "_staging").exists()


def test_the_summary_names_the_cpu_kernels_each_actor_chose(result):
    """Each actor posts its models' CPU plans at load; the summary groups identical choices and
    keeps the slowest actor's compile time; the printed headline names them."""
    _, out, summary = result
    cpu = json.loads((out / "_summary.json").read_text())["cpu"]
    assert cpu == summary["cpu"] and cpu["actors"] >= 1 and sum(p["actors"] for p in cpu["plans"]) == cpu["actors"]
    roles = cpu["plans"][0]["roles"]
    assert set(roles) == {"target", "drafter"}  # the job's method drafts with a draft model
    for plan in roles.values():
        assert plan["options"]["kernels"] is True and "linear_kernels" in plan and "compile_s" not in plan
    assert cpu["compile_s_max"] >= 0 and cpu["prepare_s_max"] > 0
    assert cpu["headline"].startswith("target: ")
