"""Run totals (pipeline.summary): sums over rows first, then docs/metrics.md's ratios; shards
committed by an older version (no draft_steps) merge with the same figures."""

import pyarrow as pa
import pytest

from pipeline.summary import RunTotals
from pipeline.schema import OUTPUT_SCHEMA


def _row(new, steps, drafted, accepted, dpp, app, draft_steps, error=None):
    return {"id": "x", "new_tokens": new, "verify_steps": steps, "draft_tokens": drafted, "accepted_tokens": accepted,
            "drafted_per_position": dpp, "accepted_per_position": app, "draft_steps": draft_steps,
            "prompt_tokens": 3, "wall_time_s": 1.0, "finish_reason": "length", "error": error}


# prompt lookup, k = 2: row 1 has 6 steps of which 3 drafted (accepted 2, 1, 0); row 2 has
# 4 steps, 1 drafted (accepted 2); a failed row counts nothing.
ROWS = [_row(9, 6, 6, 3, [3, 3], [2, 1], 3), _row(6, 4, 2, 2, [1, 1], [1, 1], 1),
        _row(None, None, None, None, None, None, None, error="ValueError: bad")]


def test_mean_accepted_length_and_tokens_per_step():
    t = RunTotals()
    t.add(pa.Table.from_pylist(ROWS, schema=OUTPUT_SCHEMA))
    d = t.to_dict()
    assert d["draft_steps"] == 4 and d["verify_steps"] == 10
    assert d["mean_accepted_length"] == pytest.approx(1 + 5 / 4)
    assert d["tokens_per_step"] == pytest.approx(15 / 10)
    empty = RunTotals()
    empty.add(pa.Table.from_pylist([_row(5, 5, 0, 0, [], [], 0)], schema=OUTPUT_SCHEMA))
    assert empty.to_dict()["mean_accepted_length"] is None and empty.to_dict()["tokens_per_step"] == 1.0


def test_older_outputs_derive_draft_steps():
    """A batch without the column, and a manifest state without the sum, count the same
    draft steps (drafted_per_position[0])."""
    old_table = pa.Table.from_pylist(ROWS, schema=OUTPUT_SCHEMA).drop_columns(["draft_steps", "tokens_per_step"])
    from_table = RunTotals()
    from_table.add(old_table)
    state = from_table.state()
    del state["sums"]["draft_steps"]
    merged = RunTotals()
    merged.merge(state)
    for t in (from_table, merged):
        d = t.to_dict()
        assert d["draft_steps"] == 4 and d["mean_accepted_length"] == pytest.approx(1 + 5 / 4)


def _post(host, rows_1, compile_s):
    plan = {"role": "target", "options": {"kernels": True}, "linear_kernels": [{"shape": [8, 4], "rows": {"1": rows_1}}],
            "compile_s": compile_s, "measure_s": 0.5, "prepare_s": compile_s + 1}
    return {"host": host, "pid": 1, "plans": {"target": plan}, "lines": {"target": f"target: {rows_1}"}}


def test_the_cpu_summary_groups_the_actors_choices_and_keeps_the_slowest_load():
    from pipeline.summary import cpu_summary

    assert cpu_summary([]) is None
    s = cpu_summary([_post("a", "onednn", 2.0), _post("b", "onednn", 5.0), _post("b", "mkl", 1.0)])
    assert s["actors"] == 3 and s["compile_s_max"] == 5.0 and s["prepare_s_max"] == 6.0
    assert [(p["actors"], p["hosts"]) for p in s["plans"]] == [(2, ["a", "b"]), (1, ["b"])]
    assert "compile_s" not in s["plans"][0]["roles"]["target"]  # choices, not costs
    assert s["headline"].startswith("target: onednn") and "1 other choice" in s["headline"]


def test_the_actors_warm_up_is_summed_apart_from_the_rows_times():
    """Each actor reports its warm-up on its first output row: the summary sums them (through a
    manifest state too), and no row's time, nor the engine time, holds them; an output written
    before the column existed counts 0."""
    rows = [{**ROWS[0], "warm_up_time_s": 4.5}, ROWS[1], {**ROWS[0], "warm_up_time_s": 5.5}]
    t = RunTotals()
    t.add(pa.Table.from_pylist(rows, schema=OUTPUT_SCHEMA))
    merged = RunTotals()
    merged.merge(t.state())
    for totals in (t, merged):
        d = totals.to_dict()
        assert d["warm_up_time_s"] == pytest.approx(10.0) and d["engine_time_s"] == pytest.approx(3.0)
    old = RunTotals()
    old.add(pa.Table.from_pylist(ROWS[:2], schema=OUTPUT_SCHEMA).drop_columns(["warm_up_time_s"]))
    old.merge({k: v for k, v in t.state().items() if k != "warm_up_time_s"})
    assert old.to_dict()["warm_up_time_s"] == 0.0
