"""The run report: figures recomputed from synthetic per-row Parquet, files written."""

import json
import posixpath
import subprocess
import sys
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.report import load_run, speedup_bound, summarize_runs, write_report
from pipeline.schema import OUTPUT_SCHEMA

REPO = Path(__file__).resolve().parents[1]


def _row(id_, method, out, new, steps, drafted=0, accepted=0, dpp=(), app=(), wall=1.0, error=None, draft_time=0.0,
         prefill=None, draft_steps=None):
    """One output row; ``draft_steps`` None leaves the column null, as in outputs written
    before it existed (the report derives it from ``drafted_per_position``)."""
    ok = error is None
    return {
        "id": id_, "prompt": f"p{id_}", "output_text": out if ok else None, "finish_reason": "length" if ok else None,
        "prompt_tokens": 5 if ok else None, "new_tokens": new if ok else None, "verify_steps": steps if ok else None,
        "draft_tokens": drafted if ok else None, "accepted_tokens": accepted if ok else None,
        "acceptance_rate": (accepted / drafted if drafted else None) if ok else None,
        "mean_accepted_length": (1 + accepted / dpp[0] if dpp else None) if ok else None,
        "tokens_per_step": new / steps if ok else None, "draft_steps": draft_steps if ok else None,
        "drafted_per_position": list(dpp) if ok else None, "accepted_per_position": list(app) if ok else None,
        "draft_time_s": draft_time, "prefill_time_s": prefill if ok else None, "verify_time_s": 0.0, "wall_time_s": wall if ok else None, "method": method,
        "target_model": "t", "draft_model": None, "error": error, "source_file": "in.jsonl", "source_row": 0,
    }


PLAIN = [_row("a", "plain", "x y", 10, 10, wall=1.0), _row("b", "plain", "u v", 20, 20, wall=2.0),
         _row("c", "plain", "w", 30, 30, wall=3.0)]
# k = 3.  Row a: 4 drafts, accepted prefixes 3,2,1,0 -> per position accepted [3,2,1].
# Row b: 8 drafts, accepted prefixes 3,3,2,2,1,1,0,0 -> [6,4,2].  Row c failed.
DRAFT = [_row("a", "draft_model", "x y", 10, 4, 12, 6, [4, 4, 4], [3, 2, 1], wall=0.5, draft_time=0.1),
         _row("b", "draft_model", "DIFFERENT", 20, 8, 24, 12, [8, 8, 8], [6, 4, 2], wall=1.0, draft_time=0.2),
         _row("c", "draft_model", None, 0, 0, error="RuntimeError: boom")]


def _write_run(fs, root, rows, summary=None, split=False):
    """A committed job output at ``root`` of ``fs``, written by the output package's writer
    (one unit per chunk), finished (``_SUCCESS``) with ``summary`` (or ``{}``); then a
    leftover staging part and an orphan (a data file tagged with the run's id that no record
    of the commit log names, as a killed run leaves), which the report must not read."""
    from pipeline.config import OutputConfig
    from pipeline.output import OutputWriter

    url = fs.unstrip_protocol(root) if fs.protocol != "file" and "file" not in fs.protocol else root
    w = OutputWriter(OutputConfig(uri=url))
    w.on_write_start([])
    chunks = [rows[:1], rows[1:]] if split else [rows]
    for n, chunk in enumerate(chunks):
        w.write_part(n, pa.Table.from_pylist(chunk, schema=OUTPUT_SCHEMA))
    w.on_write_complete(summary or {})
    for name in ("_staging/old/part-00000.parquet", f"part-00007-u00000.{w.run_id}.parquet"):
        fs.makedirs(posixpath.dirname(f"{root}/{name}"), exist_ok=True)
        with fs.open(f"{root}/{name}", "wb") as f:
            pq.write_table(pa.Table.from_pylist(rows[:1], schema=OUTPUT_SCHEMA), f)


def _commit_by_hand(folder: Path, table: pa.Table) -> None:
    """An output of an older version: ``part-00000.parquet`` (whatever its schema) and its
    manifest entry in the layout before units, ``_SUCCESS``."""
    folder.mkdir()
    pq.write_table(table, folder / "part-00000.parquet")
    (folder / "_manifest").mkdir()
    (folder / "_manifest" / "part-00000.json").write_text(json.dumps(
        {"part": "part-00000.parquet", "files": ["part-00000.parquet"], "rows": table.num_rows, "run_id": "old"}))
    (folder / "_SUCCESS").write_text("old\n")


@pytest.fixture
def runs(tmp_path):
    fs = fsspec.filesystem("file")
    _write_run(fs, str(tmp_path / "plain"), PLAIN, {"tokens_per_s": 7.5})
    _write_run(fs, str(tmp_path / "draft"), DRAFT, {"tokens_per_s": 12.5}, split=True)
    return [str(tmp_path / "plain"), str(tmp_path / "draft")]


def test_figures_are_recomputed_from_rows(runs):
    loaded = [load_run(u) for u in runs]
    assert [r.table.num_rows for r in loaded] == [3, 3]  # staging part skipped
    res = summarize_runs(loaded)
    plain, draft = res["runs"]
    assert res["baseline"] == "plain" and res["common_rows"] == 2
    assert plain["method"] == "plain" and draft["method"] == "draft_model"
    assert plain["acceptance_rate"] is None
    assert plain["mean_accepted_length"] is None and plain["draft_steps"] == 0  # nothing drafted
    assert plain["tokens_per_step"] == pytest.approx(1.0)
    assert plain["tokens_per_s"] == pytest.approx(60 / 6)
    assert draft["errors"] == 1
    assert draft["acceptance_rate"] == pytest.approx(18 / 36)  # sums first, then divide
    # every step drafted (12 draft steps from drafted_per_position[0]): both figures agree
    assert draft["draft_steps"] == 12
    assert draft["mean_accepted_length"] == pytest.approx(1 + 18 / 12)
    assert draft["tokens_per_step"] == pytest.approx(30 / 12)
    assert draft["tokens_per_s"] == pytest.approx(30 / 1.5)
    # Speedup over the common rows a, b only: plain 30 tokens / 3 s.
    assert draft["speedup"] == pytest.approx((30 / 1.5) / (30 / 3.0))
    assert plain["speedup"] == pytest.approx(1.0)
    assert draft["same_output"] == 1 and plain["same_output"] == 2
    # Bound S(α, k, c) from the common rows.  Per-token α: 18 accepted of 12 + 9 + 6 = 27
    # evaluated (position 2 is evaluated only after position 1 was accepted, ...), so α = 2/3
    # (the acceptance rate 18/36 also counts tokens after a rejection).  k = 3, c = (0.3 s / 36
    # draft tokens) / (plain's 3.0 s / 30 steps) = 1/12  ->  (1 − (2/3)⁴) / (1/3) / (3/12 + 1).
    s_common = draft["common"]
    assert s_common.token_acceptance == pytest.approx(2 / 3)
    assert draft["k"] == 3 and draft["cost_ratio"] == pytest.approx(1 / 12)
    assert draft["speedup_bound"] == pytest.approx((1 - (2 / 3) ** 4) * 3 / 1.25)
    assert draft["efficiency"] == pytest.approx(2.0 / ((1 - (2 / 3) ** 4) * 3 / 1.25))
    assert plain["speedup_bound"] is None and plain["efficiency"] is None
    assert draft["job_tokens_per_s"] == 12.5
    s = draft["stats"]
    assert s.acceptance_by_position == pytest.approx([9 / 12, 6 / 12, 3 / 12])
    # Accepted prefix lengths over the 12 drafts: 0,1,2,3 three times each.
    assert s.accepted_length_steps == [3, 3, 3, 3]
    assert plain["stats"].accepted_length_steps == [60]


def test_decode_figures_leave_the_prefill_out(tmp_path):
    fs = fsspec.filesystem("file")
    plain = [_row(r["id"], "plain", r["output_text"], r["new_tokens"], r["verify_steps"], wall=r["wall_time_s"],
                  prefill=p) for r, p in zip(PLAIN, (0.5, 1.0, 1.0))]
    draft = [_row("a", "draft_model", "x y", 10, 4, 12, 6, [4, 4, 4], [3, 2, 1], wall=0.5, draft_time=0.1, prefill=0.25),
             _row("b", "draft_model", "u v", 20, 8, 24, 12, [8, 8, 8], [6, 4, 2], wall=1.0, draft_time=0.2, prefill=0.5)]
    _write_run(fs, str(tmp_path / "plain"), plain)
    _write_run(fs, str(tmp_path / "draft"), draft)
    res = summarize_runs([load_run(str(tmp_path / "plain")), load_run(str(tmp_path / "draft"))])
    p, d = res["runs"]
    assert p["decode_tokens_per_s"] == pytest.approx(60 / (6.0 - 2.5))
    # Common rows a, b: plain decodes 30 tokens in (1 − 0.5) + (2 − 1) = 1.5 s, the drafter run in 0.75 s.
    assert d["decode_tokens_per_s"] == pytest.approx(30 / 0.75)
    assert d["decode_speedup"] == pytest.approx(2.0) and d["speedup"] == pytest.approx(2.0)
    # c = (0.3 s / 36 draft tokens) / (1.5 s / 30 target steps) = 1/6, α = 2/3, k = 3.
    bound = (1 - (2 / 3) ** 4) * 3 / (3 / 6 + 1)
    assert d["cost_ratio"] == pytest.approx(1 / 6) and d["speedup_bound"] == pytest.approx(bound)
    assert d["efficiency"] == pytest.approx(2.0 / bound)
    assert d["same_output"] == 2


def test_rows_a_nightly_run_copied_are_in_no_figure(tmp_path):
    """A night-2 output whose row a was copied from night 1 (``reused_from``, null decode
    statistics): the common rows are the rows every run decoded (b), the figures are b's."""
    fs = fsspec.filesystem("file")
    copied = dict(_row("a", "draft_model", "x y", 10, 4), **{k: None for k in (
        "verify_steps", "draft_tokens", "accepted_tokens", "acceptance_rate", "mean_accepted_length", "tokens_per_step",
        "drafted_per_position", "accepted_per_position", "draft_time_s", "prefill_time_s", "verify_time_s",
        "wall_time_s")}, reused_from="out/date=2026-01-01#0123456789ab")
    _write_run(fs, str(tmp_path / "plain"), PLAIN)
    _write_run(fs, str(tmp_path / "night2"), [copied, DRAFT[1]])
    res = summarize_runs([load_run(str(tmp_path / "plain")), load_run(str(tmp_path / "night2"))])
    p, d = res["runs"]
    assert res["common_rows"] == 1 and d["reused"] == 1 and p["reused"] == 0
    assert d["stats"].rows == 1 and d["tokens_per_s"] == pytest.approx(20 / 1.0)
    assert d["speedup"] == pytest.approx((20 / 1.0) / (20 / 2.0))  # row b against row b
    from pipeline.report import markdown_table

    assert "| draft_model | 1 + 1 copied |" in markdown_table(res) and "| plain | 3 |" in markdown_table(res)


# Prompt lookup with misses (k = 2).  Row a: 7 steps, 4 of them with a draft (accepted 2, 1, 0, 0);
# row b: 5 steps, 2 with a draft (1, 1).  Σ accepted 5, Σ draft steps 6, Σ new tokens 17, Σ steps 12.
PLD = [_row("a", "prompt_lookup", "x", 10, 7, 8, 3, [4, 4], [2, 1], draft_steps=4),
       _row("b", "prompt_lookup", "y", 7, 5, 4, 2, [2, 2], [1, 1], draft_steps=2)]


@pytest.mark.parametrize("schema", ["current", "null draft_steps", "no draft_steps column"])
def test_mean_accepted_length_leaves_steps_without_a_draft_out(tmp_path, schema):
    """docs/metrics.md: mean accepted length = 1 + accepted / draft steps (vLLM), tokens/step =
    new tokens / verify steps.  Outputs of an older schema give the same figures
    (draft_steps = drafted_per_position[0])."""
    rows = [dict(r) for r in PLD]
    table = pa.Table.from_pylist(rows, schema=OUTPUT_SCHEMA)
    if schema == "null draft_steps":
        table = table.set_column(table.schema.get_field_index("draft_steps"), "draft_steps",
                                 pa.nulls(table.num_rows, pa.int64()))
    elif schema == "no draft_steps column":
        table = table.drop_columns(["draft_steps", "tokens_per_step"])
    _commit_by_hand(tmp_path / "pld", table)
    d = summarize_runs([load_run(str(tmp_path / "pld"))])["runs"][0]
    assert d["draft_steps"] == 6
    assert d["mean_accepted_length"] == pytest.approx(1 + 5 / 6)
    assert d["tokens_per_step"] == pytest.approx(17 / 12)
    assert d["mean_accepted_length"] > d["tokens_per_step"]  # misses count only in tokens/step


def test_speedup_bound_follows_leviathan():
    # E = (1 − α^(k+1)) / (1 − α) tokens per target pass, divided by the cost k·c + 1.
    assert speedup_bound(0.8, 4, 0.0) == pytest.approx((1 - 0.8 ** 5) / 0.2)
    assert speedup_bound(0.8, 4, 0.1) == pytest.approx((1 - 0.8 ** 5) / 0.2 / 1.4)
    assert speedup_bound(0.0, 5, 0.1) == pytest.approx(1 / 1.5)  # nothing accepted: pure drafting cost
    assert speedup_bound(1.0, 4, 0.25) == pytest.approx(5 / 2)  # the α → 1 limit
    assert speedup_bound(None, 4, 0.1) is None and speedup_bound(0.5, 0, 0.1) is None


def test_report_files(runs, tmp_path):
    out = tmp_path / "report"
    write_report(runs, out, title="t")
    md = (out / "report.md").read_text()
    # No prefill_time_s in these rows (outputs of an older version): no decode columns.
    assert "| draft_model | 2 | 0.500 | 2.50 | 2.50 | 20.0 | 2.00× | – | – | 1.93× | 1.04 | 12.5 | 1/2 |" in md
    assert "| plain | 3 | – | – | 1.00 | 10.0 | 1.00× | – | – | – | – | 7.5 | 2/2 |" in md
    assert "30 new tokens in 12 verify steps (12 with a draft)" in md
    for name in ("accepted_length.png", "acceptance_by_position.png", "throughput.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
        assert f"({name})" in md
    rep = json.loads((out / "report.json").read_text())
    assert rep["runs"][1]["accepted_length_steps"] == [3, 3, 3, 3]


def test_fsspec_url_and_cli(tmp_path):
    fs = fsspec.filesystem("memory")
    _write_run(fs, "/rep/plain", PLAIN)
    _write_run(fs, "/rep/pld", [dict(r, method="prompt_lookup") for r in DRAFT])
    _write_run(fs, "/rep/dated/date=2026-01-01", PLAIN)  # a partitioned output: read below the root
    assert load_run("memory://rep/dated").table.num_rows == 3
    res = summarize_runs([load_run("memory://rep/plain"), load_run("memory://rep/pld")])
    assert res["runs"][1]["label"] == "prompt_lookup" and res["runs"][1]["speedup"] == pytest.approx(2.0)
    # The command line, on local copies (a subprocess does not share the memory filesystem).
    for name, rows in (("plain", PLAIN), ("pld", DRAFT)):
        _write_run(fsspec.filesystem("file"), str(tmp_path / name), rows)
    proc = subprocess.run([sys.executable, str(REPO / "jobs" / "report.py"), str(tmp_path / "plain"),
                           str(tmp_path / "pld"), "--out", str(tmp_path / "r")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "2.00×" in proc.stdout and (tmp_path / "r" / "throughput.png").exists()
    bad = subprocess.run([sys.executable, str(REPO / "jobs" / "report.py"), str(tmp_path / "nope"), "--out",
                          str(tmp_path / "r2")], capture_output=True, text=True)
    assert bad.returncode == 2 and "does not exist" in bad.stderr
