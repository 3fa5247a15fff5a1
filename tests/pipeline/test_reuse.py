"""Nightly reuse (pipeline/reuse.py, ``output.previous`` / ``--previous``): a row is copied from
the previous output, not decoded, only when every fingerprinted input matches; a killed previous
run's files are never read; ``auto`` finds the latest earlier complete night; a folder that is
not a job output is refused (exit 2, named); reused rows are audited, counted apart and name
where they came from.

Night 1 is decoded by a real actor (tiny models); night 2 is another actor whose config, models
or rows changed one thing at a time, given night 1's rows as the driver gives them (a
:class:`ReuseTable`)."""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from actors.generate import GenerateActor
from pipeline.config import ConfigError, OutputConfig, load_config
from pipeline.fingerprint import reuse_fingerprint
from pipeline.units import Shard, Split, Unit
from pipeline.output import OutputWriter
from pipeline.output.reader import RUN_COLUMN
from pipeline.processor import check_generation
from pipeline.reuse import ReuseTable, plan_reuse, read_previous, row_reuse_key, share_previous
from pipeline.run import run_identity
from pipeline.schema import INPUT_SCHEMA, OUTPUT_SCHEMA
from pipeline.summary import RunTotals
from pipeline_testkit import TEXTS, job_config, killed_inside_commit, write_jsonl

SOURCE = "/in/articles.jsonl"
ROWS = [{"source_file": SOURCE, "source_row": i, "id": f"r{i}", "text": t, "input_error": None}
        for i, t in enumerate(TEXTS[:3])]
SAMPLED = ["generation.do_sample=true", "generation.seed=1", "generation.temperature=1.0"]


def _fingerprint(cfg) -> str:
    """The run's reuse fingerprint, as the driver computes it (pipeline.run.preflight)."""
    generation = check_generation(cfg)
    return reuse_fingerprint(run_identity(cfg, generation, []), greedy=not generation.do_sample)


def _actor(cfg, table=None) -> GenerateActor:
    return GenerateActor(cfg.model_dump(), device="cpu", reuse={"fingerprint": _fingerprint(cfg), "table": table})


def _decode(actor, rows=ROWS) -> list[dict]:
    return actor(pa.Table.from_pylist(rows, schema=INPUT_SCHEMA)).to_pylist()


def _table(outs: list[dict], run="run1", where="night1") -> ReuseTable:
    """Night 1's rows as the driver hands them to the actors (pipeline.reuse.read_previous)."""
    t = pa.Table.from_pylist(outs, schema=OUTPUT_SCHEMA).append_column(RUN_COLUMN, pa.array([run] * len(outs)))
    table, counts = ReuseTable.from_batches(t.to_batches(max_chunksize=2), lambda r: f"{where}#{r}")
    assert counts["rows"] == len(outs)
    return table


def _night1(tiny_models, tmp, *sets):
    cfg = job_config(tiny_models, "unused", str(tmp / "o"), overrides=list(sets))
    outs = _decode(_actor(cfg))
    assert all(o["error"] is None and o["reuse_key"] and o["output_token_ids"] for o in outs)
    assert [o["reused_from"] for o in outs] == [None] * 3  # nothing to copy: decoded, keys written
    return outs, _table(outs)


@pytest.fixture(scope="module")
def greedy_night(tiny_models, tmp_path_factory):
    return _night1(tiny_models, tmp_path_factory.mktemp("greedy"))


@pytest.fixture(scope="module")
def sampled_night(tiny_models, tmp_path_factory):
    return _night1(tiny_models, tmp_path_factory.mktemp("sampled"), *SAMPLED)


@pytest.fixture(scope="module")
def changed_models(tiny_models, tmp_path_factory):
    """Copies of the tiny pair with one thing changed each: a weight of the target (same shape),
    the target's tokenizer files (same ids), a chat template, and a weight of the drafter."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("changed")
    out = {}
    for name, src in (("weights", "target"), ("tokenizer", "target"), ("chat", "target"), ("drafter", "drafter")):
        dst = root / name
        shutil.copytree(tiny_models[src], dst)
        if name in ("weights", "drafter"):
            tensors = load_file(str(dst / "model.safetensors"))
            tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1e-3
            save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
        else:
            tok = json.loads((dst / "tokenizer_config.json").read_text())
            if name == "tokenizer":
                tok["model_max_length"] = 4096
            else:
                tok["chat_template"] = "{% for m in messages %}user: {{ m['content'] }}\n{% endfor %}summary:"
            (dst / "tokenizer_config.json").write_text(json.dumps(tok))
        out[name] = str(dst)
    return out


def _row(i, **changed):
    return [dict(r, **changed) if r["source_row"] == i else r for r in ROWS]


#: (what changes in night 2, its config sets, its models, its rows, whether row 0 is copied)
GREEDY_CASES = {
    "nothing": ([], {}, ROWS, True),
    "the method": (["method.name=prompt_lookup"], {}, ROWS, True),
    "the draft length": (["method.num_assistant_tokens=2"], {}, ROWS, True),
    "the drafter's weights": ([], {"drafter": "drafter"}, ROWS, True),
    "the row's id and file": ([], {}, _row(0, id="renamed", source_file="/in/moved.jsonl", source_row=7), True),
    "a weight of the target": ([], {"target": "weights"}, ROWS, False),
    "the tokenizer's files": ([], {"target": "tokenizer"}, ROWS, False),
    "the chat template": ([], {"target": "chat"}, ROWS, False),
    "the task template": (["task.prompt_template='Summary of {text}:'"], {}, ROWS, False),
    "a generation setting": (["generation.repetition_penalty=1.2"], {}, ROWS, False),
    "the prompt": ([], {}, _row(0, text=TEXTS[5]), False),
}
SAMPLED_CASES = {
    "nothing (sampled)": ([], {}, ROWS, True),
    "the seed (sampled)": (["generation.seed=2"], {}, ROWS, False),
    "the row's id (sampled)": ([], {}, _row(0, id="renamed"), False),
    "the method (sampled: it draws otherwise)": (["method.name=prompt_lookup"], {}, ROWS, False),
}


@pytest.mark.parametrize("case", list(GREEDY_CASES) + list(SAMPLED_CASES))
def test_a_row_is_copied_only_when_every_fingerprinted_input_matches(case, tiny_models, changed_models, tmp_path,
                                                                      request):
    sampled = case in SAMPLED_CASES
    sets, models, rows, copied = (SAMPLED_CASES if sampled else GREEDY_CASES)[case]
    night1, table = request.getfixturevalue("sampled_night" if sampled else "greedy_night")
    pair = {role: changed_models[models[role]] if role in models else path for role, path in tiny_models.items()}
    cfg = job_config(pair, "unused", str(tmp_path / "o"), overrides=(SAMPLED if sampled else []) + sets)
    actor = _actor(cfg, table)
    night2 = _decode(actor, rows)
    first = night2[0]
    if copied:
        assert first["reused_from"] == "night1#run1"
        assert first["output_token_ids"] == night1[0]["output_token_ids"]
        assert first["output_text"] == night1[0]["output_text"] and first["finish_reason"] == night1[0]["finish_reason"]
        assert first["verify_steps"] is None and first["wall_time_s"] is None  # not decoded: no decode statistics
        assert first["new_tokens"] == len(night1[0]["output_token_ids"]) and first["reuse_key"] == night1[0]["reuse_key"]
    else:
        assert first["reused_from"] is None and first["verify_steps"] is not None and first["wall_time_s"] > 0
        assert first["reuse_key"] != night1[0]["reuse_key"]
    if case == "the prompt":  # the rows around it did not change
        assert [o["reused_from"] for o in night2[1:]] == ["night1#run1"] * 2
        # the hook of reference drafting: the edited row's previous output, found by its id
        assert actor.reuse.reference_for("r0") == night1[0]["output_token_ids"]
        assert actor.reuse.reference_for("r9") is None


def test_the_audit_re_decodes_copied_rows_and_finds_a_wrong_copy(greedy_night, tiny_models, tmp_path):
    """Every copied row is decoded again with plain decoding (audit.fraction 1): the copies of a
    lossless night are identical; a previous output whose ids were altered is caught."""
    night1, _ = greedy_night
    cfg = job_config(tiny_models, "unused", str(tmp_path / "o"), overrides=["audit.fraction=1.0"])
    tampered = [dict(o) for o in night1]
    ids = tampered[1]["output_token_ids"]
    tampered[1]["output_token_ids"] = ids[:-1] + [(ids[-1] + 1) % 50]  # the last token altered
    outs = _decode(_actor(cfg, _table(tampered)))
    assert [o["reused_from"] for o in outs] == ["night1#run1"] * 3
    assert [o["audit"] for o in outs] == [True, False, True]
    assert all(o["audit_plain_time_s"] > 0 for o in outs)
    totals = RunTotals()
    totals.add(pa.Table.from_pylist(outs, schema=OUTPUT_SCHEMA))
    assert (totals.audit_rows, totals.audit_mismatches, totals.reused_rows) == (3, 1, 3)
    assert totals.audit_time_s == 0  # no decode time of theirs: not in audit_speedup


def test_the_summary_counts_copied_rows_apart_and_rates_count_decoded_rows_only(greedy_night, tiny_models, tmp_path):
    night1, table = greedy_night
    cfg = job_config(tiny_models, "unused", str(tmp_path / "o"))
    outs = pa.Table.from_pylist(_decode(_actor(cfg, table), _row(2, text=TEXTS[6])), schema=OUTPUT_SCHEMA)
    totals = RunTotals()
    totals.add(outs)
    decoded = outs.slice(2)
    summary = totals.to_dict(generate_elapsed_s=2.0)
    assert summary["rows"] == 3 and summary["reused_rows"] == 2 and summary["ok_rows"] == 3
    assert summary["reused_tokens"] == sum(len(o["output_token_ids"]) for o in night1[:2])
    assert summary["new_tokens"] == decoded.column("new_tokens")[0].as_py()
    assert summary["tokens_per_s"] == decoded.column("new_tokens")[0].as_py() / 2.0
    assert summary["engine_time_s"] == pytest.approx(decoded.column("wall_time_s")[0].as_py())
    assert sum(summary["finish_reasons"].values()) == 3
    restored = RunTotals()
    restored.merge(totals.state())  # a resumed run's totals from the manifest entries
    assert restored.to_dict()["reused_rows"] == 2


def test_the_table_finds_every_key_and_no_other(tmp_path):
    """Binary search over the two 64-bit halves: keys sharing their first half, equal keys (the
    first kept), keys absent; ``reference_for`` by row id; rows that cannot be copied left out."""
    rng = np.random.default_rng(0)
    keys = [f"{rng.integers(2**63):016x}{rng.integers(2**63):016x}" for _ in range(200)]
    keys += [keys[0][:16] + f"{k:016x}" for k in (1, 2, 3)]  # the same first half
    rows = [{"reuse_key": k, "id": f"r{i}", "output_token_ids": [i, i + 1], "finish_reason": "length", "error": None,
             RUN_COLUMN: "a" if i % 2 else "b"} for i, k in enumerate(keys)]
    rows += [dict(rows[5], id="dup", output_token_ids=[9])]  # a second row with key 5: the first wins
    rows += [dict(rows[6], reuse_key=None, id="old"), dict(rows[7], error="ValueError: x", id="failed")]
    batches = pa.Table.from_pylist(rows).to_batches(max_chunksize=37)
    table, counts = ReuseTable.from_batches(batches, lambda run: f"prev#{run}")
    assert counts == {"rows": len(rows), "usable": len(keys) + 1, "keyless": 1, "rejected_rows": 0, "rejected": {}}
    for i, k in enumerate(keys):
        hit = table.output(table.find(k))
        assert hit.token_ids == [i, i + 1] and hit.reused_from == f"prev#{'a' if i % 2 else 'b'}"
    for absent in (keys[0][:16] + f"{4:016x}", "f" * 32, "0" * 32, None):
        assert table.find(absent) is None
    assert table.reference_for("r17") == [17, 18] and table.reference_for("old") is None
    assert table.reference_for("nope") is None and table.reference_for("failed") is None
    assert table.tokens.dtype == np.int32 and len(table.tokens) == 2 * len(keys) + 1
    assert table.nbytes == 45 * len(table) + 8 + 4 * len(table.tokens)  # the bound the module docstring gives


def test_a_sampled_row_without_a_seed_has_no_key():
    from pipeline.engine import GenerationSettings

    greedy, sampled = GenerationSettings(do_sample=False), GenerationSettings(do_sample=True, seed=3)
    assert row_reuse_key("fp", [1, 2], GenerationSettings(do_sample=True, seed=None)) is None
    assert row_reuse_key("fp", [1, 2], greedy) == row_reuse_key("fp", [1, 2], greedy) != row_reuse_key("fp", [1, 3], greedy)
    assert row_reuse_key("fp", [1, 2], sampled) != row_reuse_key("fp", [1, 2], GenerationSettings(do_sample=True, seed=4))
    # a row's own settings (the processor's per-row max_new_tokens) are in its key
    own = GenerationSettings(do_sample=False, max_new_tokens=5)
    assert row_reuse_key("fp", [1, 2], own, greedy) != row_reuse_key("fp", [1, 2], greedy, greedy)


def test_the_ensemble_weight_is_fingerprinted_the_method_is_not(tiny_models, tmp_path):
    """Static ensemble verification is lossy: its weight (and the drafter) shape a greedy
    output; a lossless method's settings do not."""
    base = job_config(tiny_models, "unused", str(tmp_path / "o"))
    fps = {name: _fingerprint(job_config(tiny_models, "unused", str(tmp_path / "o"), overrides=sets)) for name, sets in {
        "plain": ["method.name=plain"], "draft k=2": ["method.num_assistant_tokens=2"],
        "ensemble 0.5": ["method.assistant_ensemble_weight=0.5"],
        "ensemble 0.6": ["method.assistant_ensemble_weight=0.6"]}.items()}
    assert fps["plain"] == fps["draft k=2"] == _fingerprint(base)
    assert len({fps["plain"], fps["ensemble 0.5"], fps["ensemble 0.6"]}) == 3


# ------------------------------------------------------------------ the previous output, in the driver
SHARD = Shard(index=0, url=SOURCE, format="jsonl", num_rows=4, fingerprint="size=40;mtime=1")
UNITS = [Unit(SHARD, k, Split(2 * k, 2)) for k in range(2)]


def _committed_rows(unit: Unit) -> pa.Table:
    return pa.Table.from_pylist([{"id": f"r{i}", "output_text": f"o{i}", "finish_reason": "length", "error": None,
                                  "source_file": SOURCE, "source_row": i, "output_token_ids": [i, 40 + i],
                                  "reuse_key": f"{i:032x}"} for i in range(unit.split.start, unit.split.start + 2)],
                                schema=OUTPUT_SCHEMA)


def _identity(cfg) -> dict:
    return run_identity(cfg, check_generation(cfg), [])


def _night(cfg, root, day: str, *, finished: bool = True, killed: bool = False) -> str:
    """A night of the job ``cfg`` under ``root``/date=``day``: both units committed and finished;
    or unit 0 committed and, ``killed``, unit 1's data file published but its record never
    appended (the seam test_reader.py kills a run at).  Returns the run id."""
    w = OutputWriter(OutputConfig(uri=str(root), partition_by_date=True, run_date=day))
    w.on_write_start(UNITS, _identity(cfg))
    w.write_part(UNITS[0], _committed_rows(UNITS[0]))
    if killed:
        killed_inside_commit(w, UNITS[1], _committed_rows(UNITS[1]))
    elif finished:
        w.write_part(UNITS[1], _committed_rows(UNITS[1]))
        w.on_write_complete({"rows": 4})
    return w.run_id


def _plan(cfg):
    return plan_reuse(cfg, _identity(cfg), greedy=True, own_url=cfg.output.location())


def test_a_killed_previous_runs_files_are_never_copied(tiny_models, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="specbatch")
    root, night = tmp_path / "nightly", tmp_path / "nightly" / "date=2026-01-01"
    cfg = job_config(tiny_models, "unused", str(root), overrides=[
        "output.run_date=2026-01-02", "output.partition_by_date=true", f"output.previous={night}"])
    run = _night(cfg, root, "2026-01-01", killed=True)
    assert (night / f"part-00000-u00001.{run}.parquet").exists()  # published, but no record names it
    assert pq.read_table(night).num_rows == 4  # what reading every part file would give
    plan = _plan(cfg)
    assert plan.previous == str(night) and plan.finished is False and "unfinished" in plan.note
    assert "only its committed units are read" in caplog.text
    table, counts = read_previous(plan.previous)
    assert counts == {"rows": 2, "usable": 2, "keyless": 0, "rejected_rows": 0, "rejected": {}, "unverified_files": 0}
    assert [table.find(f"{i:032x}") is not None for i in range(4)] == [True, True, False, False]
    assert table.output(table.find(f"{1:032x}")).reused_from == f"{night}#{run}"


def test_previous_auto_is_the_latest_earlier_complete_night(tiny_models, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="specbatch")
    root = tmp_path / "nightly"

    def cfg_on(day, *sets):
        return job_config(tiny_models, "unused", str(root), overrides=[
            f"output.run_date={day}", "output.partition_by_date=true", "output.previous=auto", *sets])

    first = _plan(cfg_on("2026-01-01"))
    assert first.previous is None and "no complete date= partition" in first.note and first.note in caplog.text
    _night(cfg_on("2026-01-01"), root, "2026-01-01")
    _night(cfg_on("2026-01-02"), root, "2026-01-02", finished=False)  # never finished: passed over
    run3 = _night(cfg_on("2026-01-03"), root, "2026-01-03")
    assert _plan(cfg_on("2026-01-03")).previous == str(root / "date=2026-01-01")
    plan = _plan(cfg_on("2026-01-05"))
    assert plan.previous == str(root / "date=2026-01-03") and plan.finished is True
    assert plan.facts()["output"] == plan.previous
    table, _ = read_previous(plan.previous)
    assert len(table) == 4 and table.output(0).reused_from == f"{root / 'date=2026-01-03'}#{run3}"
    # a previous night of another config: nothing reused, the log says what changed
    plan = _plan(cfg_on("2026-01-05", "generation.max_new_tokens=5"))
    assert plan.previous is None and "generation.max_new_tokens: 12 -> 5" in plan.note


def test_auto_needs_date_partitions():
    with pytest.raises(ConfigError, match="output.previous: auto picks the latest earlier date= partition"):
        load_config(None, ["output.previous=auto"])
    assert load_config(None, ["output.previous=auto", "output.partition_by_date=true"]).output.previous == "auto"


@pytest.mark.parametrize("what", ["missing", "empty", "own"])
def test_a_previous_folder_that_is_not_a_job_output_is_refused_naming_it(what, tiny_models, tmp_path, capsys):
    from pipeline.cli import main

    write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "text": TEXTS[0]}])
    previous = {"missing": tmp_path / "no-such-night", "empty": tmp_path / "empty", "own": tmp_path / "out"}[what]
    if what == "empty":
        previous.mkdir()
    if what == "own":
        _night(job_config(tiny_models, str(tmp_path / "in.jsonl"), str(tmp_path / "x")), tmp_path / "x", "2026-01-01")
        shutil.copytree(tmp_path / "x" / "date=2026-01-01", previous)
    args = ["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out"), "--target",
            tiny_models["target"], "--drafter", tiny_models["drafter"], "--previous", str(previous), "--no-progress",
            "--set", "output.partition_by_date=false"]
    assert main("summarize", args) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    said = {"missing": "does not exist", "empty": "is an empty folder", "own": "this run's own output folder"}[what]
    assert len(err) == 1 and str(previous) in err[0] and said in err[0], err
    assert err[0].startswith("error: output.previous")


# ------------------------------------------------------------------ two nights, end to end
@pytest.mark.slow
def test_two_nights_the_second_copies_the_unchanged_rows(ray_local, tiny_models, tmp_path, capsys):
    """The nightly recipe (``--run-date D --previous auto``) on a local Ray: night 1 has no
    earlier night (said) and decodes everything; night 2, with one row edited and one new,
    copies the other three from night 1 through the shared table, audits every row (the copies
    included: identical), counts the copies apart and names night 1's run on them; its method,
    suffix, seeds its job-wide draft pool with night 1's four outputs (said)."""
    from pipeline.cli import main
    from pipeline.output.reader import CommittedOutput

    out = tmp_path / "nightly"
    texts = TEXTS[:4]
    write_jsonl(tmp_path / "in1" / "a.jsonl", [{"id": f"r{i}", "text": t} for i, t in enumerate(texts)])
    edited = [texts[0], TEXTS[6], texts[2], texts[3], TEXTS[7]]
    write_jsonl(tmp_path / "in2" / "a.jsonl", [{"id": f"r{i}", "text": t} for i, t in enumerate(edited)])

    def night(day, folder, *more):
        args = ["--input", str(tmp_path / folder), "--output", str(out), "--target", tiny_models["target"],
                "--drafter", tiny_models["drafter"], "--method", "draft_model", "--max-new-tokens", "10",
                "--num-actors", "1", "--run-date", day, "--previous", "auto", "--no-progress",
                "--set", "compute.cpus_per_actor=1", *more]
        assert main("summarize", args) == 0
        return json.loads((out / f"date={day}" / "_summary.json").read_text()), capsys.readouterr().err

    s1, err1 = night("2026-01-01", "in1", "--audit-fraction", "0")
    assert s1["reused_rows"] == 0 and "no complete date= partition" in s1["previous"]["note"]
    assert "reuse: no row reused: output.previous: auto: no complete date= partition" in err1
    s2, err2 = night("2026-01-02", "in2", "--audit-fraction", "1", "--method", "suffix")  # (greedy: still copies)
    first = str(out / "date=2026-01-01")
    assert s2["previous"]["output"] == first and s2["previous"]["usable"] == 4 and s2["previous"]["finished"]
    assert s1["previous"].get("pool_seeded_rows") is None and s2["previous"]["pool_seeded_rows"] == 4
    assert "4 previous rows seeded the draft pool" in err2  # suffix's job-wide pool: night 1's outputs
    assert s2["reused_rows"] == s2["this_run"]["reused_rows"] == 3 and s2["rows"] == 5
    assert f"reuse: 3 rows reused from {first} (copied, not decoded" in err2
    assert s2["audit_rows"] == 5 and s2["audit_mismatches"] == 0
    rows1 = {r["id"]: r for r in CommittedOutput.open(first).rows()}
    rows2 = {r["id"]: r for r in CommittedOutput.open(str(out / "date=2026-01-02")).rows()}
    for rid in ("r0", "r2", "r3"):
        assert rows2[rid]["reused_from"] == f"{first}#{s1['run_id']}" and rows2[rid]["audit"] is True
        assert rows2[rid]["output_token_ids"] == rows1[rid]["output_token_ids"]
        assert rows2[rid]["output_text"] == rows1[rid]["output_text"] and rows2[rid]["verify_steps"] is None
    decoded = [rows2[rid] for rid in ("r1", "r4")]
    assert all(r["reused_from"] is None and r["verify_steps"] for r in decoded)
    assert s2["new_tokens"] == sum(r["new_tokens"] for r in decoded)  # tokens/s counts these only
    assert s2["reused_tokens"] == sum(len(rows1[rid]["output_token_ids"]) for rid in ("r0", "r2", "r3"))


class _FixedCosts:
    """A CPU-like cost curve for the draft-length controller, fixed (its choices do not follow the
    machine's load): a plain step of B rows 10 ms + 1 ms per row, a token of width 1.5 ms per row."""

    ready = True

    def observe(self, *args) -> None:
        pass

    observe_propose = observe

    def seconds(self, rows: int, width: int) -> float:
        return 0.010 + 0.001 * rows + 0.0015 * rows * (width - 1)

    def proposing(self, longest: int, total: int) -> float:
        return 0.0

    def propose_seconds(self, asked) -> float:
        return 0.0


def test_an_edited_row_drafts_from_its_previous_output_losslessly(greedy_night, tiny_models, tmp_path):
    """Night 2 asks for more tokens: no row is copied (a generation setting changed), each is
    decoded with its id's previous output as its reference; the output is plain decoding's (the
    audit re-decodes every row), the reference's tokens are accepted, and the summary counts them."""
    night1, table = greedy_night
    cfg = job_config(tiny_models, "unused", str(tmp_path / "o"),
                     overrides=["method.name=suffix", "generation.max_new_tokens=20", "audit.fraction=1.0"])
    actor = _actor(cfg, table)
    actor.engine.controller.curve = _FixedCosts()
    outs = _decode(actor)
    assert [o["reused_from"] for o in outs] == [None] * 3 and [o["audit"] for o in outs] == [True] * 3
    for o, prev in zip(outs, night1):
        if prev["finish_reason"] == "length":  # greedy: night 1's output is a prefix of night 2's
            assert o["output_token_ids"][:12] == prev["output_token_ids"]
    assert sum(o["accepted_from_reference"] for o in outs) >= 6
    totals = RunTotals()
    totals.add(pa.Table.from_pylist(outs, schema=OUTPUT_SCHEMA))
    summary = totals.to_dict()
    assert summary["accepted_from_reference"] == sum(o["accepted_from_reference"] for o in outs)
    assert summary["accepted_tokens"] == sum(summary[f"accepted_from_{s}"] for s in ("prompt", "pool", "reference",
                                                                                     "drafter"))


# ------------------------------------------------------------------ the persisted draft pool
def test_a_previous_night_seeds_the_suffix_pool_and_the_output_stays_plain(greedy_night, tiny_models, tmp_path):
    """Night 2 (suffix, more tokens: nothing copied) seeds each actor's job-wide pool with
    night 1's outputs after the warm-up's reset: the pool drafts night 1's tokens, which are
    accepted, and every row is still plain greedy decoding's (the audit re-decodes them all)."""
    night1, table = greedy_night
    cfg = job_config(tiny_models, "unused", str(tmp_path / "o"),
                     overrides=["method.name=suffix", "generation.max_new_tokens=20", "audit.fraction=1.0"])
    reuse = {"fingerprint": _fingerprint(cfg), "table": table, "copy": False, "pool": 3}
    actor = GenerateActor(cfg.model_dump(), device="cpu", reuse=reuse)
    assert actor.pool_seeded == 3 and len(actor.engine.proposer.cached) == 3
    actor.engine.controller.curve = _FixedCosts()
    outs = _decode(actor)
    assert [o["audit"] for o in outs] == [True] * 3 and [o["reused_from"] for o in outs] == [None] * 3
    for o, prev in zip(outs, night1):
        if prev["finish_reason"] == "length":  # greedy: night 1's output is a prefix of night 2's
            assert o["output_token_ids"][:12] == prev["output_token_ids"]
    assert sum(o["accepted_from_pool"] for o in outs) >= 6  # drafted from night 1's outputs
    assert sum(o["accepted_from_reference"] for o in outs) == 0  # copy=False: no references either
    actor.engine.reset_learning()  # the same rows without the pool: the same tokens
    assert [o["output_token_ids"] for o in _decode(actor)] == [o["output_token_ids"] for o in outs]


@pytest.mark.parametrize("changed, refused", [("tokenizer", "tokenizer"), ("weights", "model"), (None, None)])
def test_a_pool_from_another_model_or_tokenizer_is_refused_by_name(changed, refused, tiny_models, changed_models,
                                                                   tmp_path, caplog):
    """The previous night was decoded with the tiny target; tonight's suffix job uses a copy
    with another tokenizer or weight (refused, named, the run goes on without the pool), or the
    same target with another generation setting (nothing copied, the pool still seeded)."""
    caplog.set_level(logging.INFO, logger="specbatch")
    root, night = tmp_path / "nightly", tmp_path / "nightly" / "date=2026-01-01"
    sets = ["output.run_date=2026-01-02", "output.partition_by_date=true", f"output.previous={night}"]
    _night(job_config(tiny_models, "unused", str(root), overrides=sets), root, "2026-01-01")
    pair = dict(tiny_models, target=changed_models[changed]) if changed else tiny_models
    cfg = job_config(pair, "unused", str(root), overrides=sets + ["method.name=suffix", "generation.max_new_tokens=6"])
    plan = _plan(cfg)
    assert plan.previous is None and plan.pool_size == 10_000  # another config: nothing copied either way
    line = f"the job-wide draft pool of {night} is refused: it was decoded with another {refused} (files changed"
    if refused:
        assert plan.pool_from is None and line in caplog.text and "run goes on without it" in caplog.text
        assert "tokenizer_config.json" in caplog.text if refused == "tokenizer" else "model.safetensors" in caplog.text
        reuse = share_previous(plan, cfg)
        assert reuse == {"fingerprint": plan.fingerprint, "table": None}  # no table to read (no Ray needed)
        if refused == "tokenizer":  # the run goes on: an actor without the pool decodes its rows
            actor = GenerateActor(cfg.model_dump(), device="cpu", reuse=reuse)
            assert actor.pool_seeded == 0 and all(o["error"] is None and o["new_tokens"] for o in _decode(actor, ROWS[:1]))
    else:
        assert plan.pool_from == str(night) and "is refused" not in caplog.text
    plain = job_config(tiny_models, "unused", str(root), overrides=sets + ["method.name=prompt_lookup"])
    assert _plan(plain).pool_from is None  # a method that learns nothing from outputs seeds nothing


def test_seed_pool_is_bounded_and_feeds_the_job_wide_tree():
    from pipeline.engine.proposers.suffix import SuffixProposer

    p = SuffixProposer(max_tree_depth=4, max_cached_requests=2)
    assert p.seed_pool([[1, 2, 3], [], [4, 5, 6], [7, 8, 9]]) == 3  # the empty one is not a document
    assert list(p.cached) == [[4, 5, 6], [7, 8, 9]]  # the bound holds: the oldest left
    assert p.global_tree.speculate([4, 5], 2, 1.0, 0.1).tokens == [6] and not p.global_tree.node_of([1])
    assert SuffixProposer(max_cached_requests=0).seed_pool([[1, 2]]) == 0
