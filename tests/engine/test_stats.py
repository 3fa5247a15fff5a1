"""Per-row statistics follow docs/metrics.md: ``mean_accepted_length`` is vLLM's mean
acceptance length, 1 + accepted / draft_steps (steps without a draft left out), and
``tokens_per_step`` = new_tokens / verify_steps counts every step."""

from __future__ import annotations

import pytest

from pipeline.engine import GenerationSettings, RowStats, SpeculationSettings, SpeculativeEngine

from tiny_models import build, check_stats, perturbed_copy, prompt_of


def test_row_stats_definitions():
    s = RowStats(new_tokens=9, verify_steps=5)
    s.record_draft(3, 3)  # fully accepted: 4 tokens from one step
    s.record_draft(2, 0)  # rejected at once: 1 token
    # three more steps without a draft (prompt-lookup misses): 1 token each
    assert s.draft_steps == 2
    assert s.mean_accepted_length == pytest.approx(1 + 3 / 2)
    assert s.tokens_per_step == pytest.approx(9 / 5)
    d = s.to_dict()
    assert d["draft_steps"] == 2 and d["mean_accepted_length"] == 2.5 and d["tokens_per_step"] == 1.8
    assert d["drafted_per_position"] == [2, 2, 1] and d["accepted_per_position"] == [1, 1, 1]


def test_plain_row_has_no_accepted_length_and_one_token_per_step():
    target = build("llama", seed=0)
    result = SpeculativeEngine(target).generate(prompt_of(9), GenerationSettings(max_new_tokens=12))
    d = result.stats.to_dict()
    assert d["draft_steps"] == 0 and d["mean_accepted_length"] is None and d["tokens_per_step"] == 1.0


def test_prompt_lookup_misses_are_not_draft_steps():
    """A prompt-lookup miss is a plain step: it counts in tokens_per_step, not in the mean
    accepted length, which therefore exceeds tokens_per_step."""
    target = build("llama", seed=0)
    engine = SpeculativeEngine(target, SpeculationSettings(method="prompt_lookup", prompt_lookup_num_tokens=4))
    drafts = []
    propose = engine.proposer.propose

    def counting(requests):
        out = propose(requests)
        drafts.extend(len(d) for d in out)
        return out

    engine.proposer.propose = counting
    prompt = prompt_of(12, seed=1)
    result = engine.generate(prompt, GenerationSettings(max_new_tokens=60))
    s = result.stats
    check_stats(result, 4)
    assert s.draft_steps == sum(1 for n in drafts if n) and 0 < s.draft_steps < s.verify_steps
    assert s.accepted_tokens > 0
    assert s.mean_accepted_length == pytest.approx(1 + s.accepted_tokens / s.draft_steps)
    assert s.mean_accepted_length > s.tokens_per_step == pytest.approx(s.new_tokens / s.verify_steps)


def test_draft_model_drafts_every_step():
    """A draft model drafts at every step but the last (budget), so both figures nearly agree."""
    target = build("llama", seed=0)
    engine = SpeculativeEngine(target, SpeculationSettings(method="draft_model", num_assistant_tokens=3),
                               drafter=perturbed_copy(target, 0.3))
    result = engine.generate(prompt_of(9), GenerationSettings(max_new_tokens=40))
    check_stats(result, 3)
    s = result.stats
    assert s.verify_steps - 1 <= s.draft_steps <= s.verify_steps


def _row(drafts, new, steps, prefill=0.5, wall=2.0):
    s = RowStats(prompt_tokens=4, new_tokens=new, verify_steps=steps, prefill_time_s=prefill, wall_time_s=wall,
                 draft_time_s=0.25, verify_time_s=1.0)
    for drafted, accepted in drafts:
        s.record_draft(drafted, accepted)
    return s


def test_rows_add_up_and_the_rates_follow_the_sums():
    """``+``, merge and total sum counts, times and per-position lists; every rate is of the
    sums (never a mean of per-row rates)."""
    a = _row([(3, 3), (3, 0)], new=7, steps=4)  # 4 + 1 tokens from two drafts, two plain steps
    b = _row([(2, 1)], new=3, steps=2, prefill=1.5, wall=3.0)
    t = a + b
    assert (t.new_tokens, t.verify_steps, t.draft_tokens, t.accepted_tokens, t.draft_steps) == (10, 6, 8, 4, 3)
    assert t.drafted_per_position == [3, 3, 2] and t.accepted_per_position == [2, 1, 1]
    assert t.prompt_tokens == 8 and t.wall_time_s == 5.0 and t.prefill_time_s == 2.0 and t.finish_reason is None
    assert t.acceptance_rate == pytest.approx(4 / 8) and t.mean_accepted_length == pytest.approx(1 + 4 / 3)
    assert t.tokens_per_step == pytest.approx(10 / 6) != (a.tokens_per_step + b.tokens_per_step) / 2
    assert t.acceptance_by_position == pytest.approx([2 / 3, 1 / 3, 1 / 2])
    assert t.token_acceptance_by_position == pytest.approx([2 / 3, 1 / 2, 1])  # evaluated 3, min(2, 3), min(1, 2)
    assert t.token_acceptance == pytest.approx(4 / (3 + 2 + 1))
    assert t.accepted_length_steps == [6 - 2, 1, 0, 1] and sum(t.accepted_length_steps) == t.verify_steps
    assert t.tokens_per_s == pytest.approx(10 / 5) and t.decode_tokens_per_s == pytest.approx(10 / 3)
    assert RowStats.total([a, b]) == t and RowStats().merge(a).merge(b) == t
    assert a.new_tokens == 7 and a.drafted_per_position == [2, 2, 2]  # + leaves its operands alone
    assert RowStats.total([]) == RowStats() and RowStats().acceptance_rate is None
    unknown = a + RowStats(new_tokens=1, prefill_time_s=None)  # a row of an older output: no prefill time
    assert unknown.prefill_time_s is None and unknown.decode_tokens_per_s is None and unknown.tokens_per_s is not None


def test_columns_round_trip_and_older_outputs_take_their_defaults():
    from pipeline.engine.stats import COLUMNS

    s = _row([(3, 2), (1, 1)], new=6, steps=3)
    cols = s.to_columns()
    assert list(cols) == [c.name for c in COLUMNS]
    assert cols["tokens_per_step"] == 2.0 and cols["mean_accepted_length"] == pytest.approx(1 + 3 / 2)
    assert RowStats.from_columns(cols) == s
    old = {k: v for k, v in cols.items() if k not in ("draft_steps", "tokens_per_step", "prefill_time_s")}
    back = RowStats.from_columns(old)  # an output written before those columns existed
    assert back.draft_steps == s.drafted_per_position[0] == 2 and back.prefill_time_s is None
    assert back.tokens_per_step == s.tokens_per_step and back.new_tokens == 6
    assert RowStats.from_columns({}) == RowStats(prefill_time_s=None)


def test_every_copy_of_the_statistics_is_derived_from_row_stats():
    """A statistics field added in one place only fails here: every RowStats field is an
    output column (or the row's finish reason), and the output schema, the API's
    ``speculation`` object, the run summary and its manifest state, the report and the
    tuner's pilot all carry every column."""
    import dataclasses

    import pyarrow as pa

    from pipeline.engine.stats import COLUMNS, PER_POSITION, RATE_COLUMNS, SUMMED
    from pipeline.report import Stats
    from pipeline.schema import OUTPUT_SCHEMA
    from pipeline.serve.protocol import SPECULATION_KEYS, USAGE_COUNTS, speculation
    from pipeline.summary import RunTotals
    from pipeline.tune.measure import PilotRun

    names = [c.name for c in COLUMNS]
    stored = [f.name for f in dataclasses.fields(RowStats) if f.name != "finish_reason"]
    assert sorted(names) == sorted(stored + list(RATE_COLUMNS)) and len(set(names)) == len(names)
    assert set(SUMMED) | set(PER_POSITION) == set(stored)
    assert all(isinstance(getattr(RowStats, r), property) for r in RATE_COLUMNS)
    arrow = {"int": pa.int64(), "float": pa.float64(), "list[int]": pa.list_(pa.int64())}
    for c in COLUMNS:
        assert OUTPUT_SCHEMA.field(c.name).type == arrow[c.type], c.name
        after_audit = OUTPUT_SCHEMA.get_field_index(c.name) > OUTPUT_SCHEMA.get_field_index("audit")
        assert after_audit == c.appended, c.name
    s = _row([(2, 1)], new=3, steps=2)
    assert set(speculation(s, "draft_model", 2)) == {"method", "draft_length"} | set(names) - set(USAGE_COUNTS)
    assert set(SPECULATION_KEYS) == set(names) - set(USAGE_COUNTS)
    totals = RunTotals()
    totals.add(pa.Table.from_pylist([{**s.to_columns(), "id": "a", "finish_reason": "length"}], schema=OUTPUT_SCHEMA))
    assert totals.stats == RowStats.from_columns(s.to_columns())
    assert set(totals.state()["sums"]) == set(SUMMED) and all(k in totals.state() for k in PER_POSITION)
    summary = totals.to_dict()
    assert set(names) - {"wall_time_s"} <= set(summary) and summary["engine_time_s"] == s.wall_time_s
    merged = RunTotals()
    merged.merge(totals.state())
    assert merged.stats == totals.stats
    assert issubclass(Stats, RowStats)
    from pipeline.engine import GenerationResult

    pilot = PilotRun("draft_model", 2, 1, 1.0, [GenerationResult([1], None, "length", s)])
    assert pilot.stats == RowStats.from_columns(s.to_columns())


def test_vllm_names_are_the_same_counts():
    """vLLM's per-request names (docs/metrics.md) are derived from the counts: 10 steps, 6 of them
    draft steps of up to 3 tokens (drafted 6, 5, 3 at positions 1-3; accepted 4, 2, 1)."""
    s = RowStats(verify_steps=10, draft_steps=6, draft_tokens=14, accepted_tokens=7,
                 drafted_per_position=[6, 5, 3], accepted_per_position=[4, 2, 1])
    v = s.vllm_metrics()
    assert (v["num_spec_steps"], v["num_draft_tokens"], v["num_accepted_draft_tokens"]) == (6, 14, 7)
    assert v["draft_acceptance_rate"] == pytest.approx(0.5) and v["mean_acceptance_length"] == pytest.approx(1 + 7 / 6)
    # draft steps by accepted prefix 0..3: 6 - 4 with none, 4 - 2 with one, 2 - 1 with two, 1 with three
    assert v["acceptance_histogram"] == [2, 2, 1, 1] and sum(v["acceptance_histogram"]) == v["num_spec_steps"]
    assert RowStats(verify_steps=4).vllm_metrics()["acceptance_histogram"] == [0]
    assert RowStats(verify_steps=4).vllm_metrics()["mean_acceptance_length"] is None
