"""Lossless audit: a sampled fraction of rows is decoded again with plain decoding; 0
mismatches for a lossless method with greedy decoding, mismatches when verification is
deliberately corrupted.  The speed comparison is fair: both engines are warmed up at actor
start, and the sampled rows of a batch are one group that both engines decode in turn, the
first alternating by batch."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import pipeline.engine.verify
from actors.generate import GenerateActor, audit_selected
from pipeline_testkit import TEXTS, job_config, write_jsonl
from pipeline.engine import SpeculativeEngine
from pipeline.schema import INPUT_SCHEMA
from pipeline.run import run_job


def _rows(texts):
    return pa.Table.from_pylist(
        [{"source_file": "f", "source_row": i, "id": f"r{i}", "text": t, "input_error": None} for i, t in enumerate(texts)],
        schema=INPUT_SCHEMA,
    )


@pytest.fixture(scope="module")
def audited_actor(tiny_models, tmp_path_factory):
    cfg = job_config(tiny_models, "unused", str(tmp_path_factory.mktemp("o")),
                     overrides=["audit.fraction=1.0", "generation.max_new_tokens=16",
                                "compute.draft_length=fixed"])  # drafts every step: the corrupted
    # verification below must meet drafts (by expected gain the engine stops drafting for a weak drafter)
    return GenerateActor(cfg.model_dump(), device="cpu")


def test_audit_matches_for_a_lossless_method(audited_actor):
    out = audited_actor(_rows(TEXTS[:6] + [None])).to_pylist()
    assert [r["audit"] for r in out[:6]] == [True] * 6
    assert out[6]["audit"] is None and out[6]["error"]  # a failed row is not audited
    assert all(r["audit_plain_time_s"] > 0 for r in out[:6]) and out[6]["audit_plain_time_s"] is None
    assert sum(r["accepted_tokens"] for r in out[:6]) < sum(r["draft_tokens"] for r in out[:6])  # drafts were rejected


def test_audit_reports_mismatches_when_verification_is_corrupted(audited_actor, monkeypatch):
    """Verification that accepts every draft token (wrong): the speculative output departs
    from plain decoding wherever the drafter disagrees with the target."""
    def accept_everything(draft, choice):
        return len(draft), choice[len(draft)]  # plain decoding (no draft) stays right

    # greedy decoding without logits processors verifies through greedy_accept
    monkeypatch.setattr(pipeline.engine.verify, "greedy_accept", accept_everything)
    out = audited_actor(_rows(TEXTS[:6])).to_pylist()
    audits = [r["audit"] for r in out]
    assert None not in audits and audits.count(False) >= 1, audits


def test_both_engines_warm_up_at_start_and_the_audit_interleaves_them(tiny_models, tmp_path, monkeypatch):
    """At construction, before any batch: the job's engine and the audit's plain engine each
    decode the warm-up at the job's rows in flight.  Then per batch, A B B A: the sampled rows in
    two halves (5 rows, 2 in flight: 2 + 3), both engines on each, the one that went first on the
    first half going second on the second, the first alternating by batch; then the other rows by
    the job's engine alone.  The warm-up's seconds ride on the actor's first output row."""
    calls: list[tuple[str, object, int]] = []
    warm_up, generate_batch = SpeculativeEngine.warm_up, SpeculativeEngine.generate_batch

    def warming(engine, max_rows=None, **kw):
        calls.append(("warm_up", engine, max_rows))
        return warm_up(engine, max_rows, **kw)

    def decoding(engine, prompts, settings=None, max_batch_size=None):
        calls.append(("decode", engine, len(prompts)))
        return generate_batch(engine, prompts, settings, max_batch_size)

    monkeypatch.setattr(SpeculativeEngine, "warm_up", warming)
    cfg = job_config(tiny_models, "unused", str(tmp_path), overrides=[
        "audit.fraction=0.5", "audit.seed=1", "generation.max_new_tokens=6", "compute.max_batch_size=2"])
    actor = GenerateActor(cfg.model_dump(), device="cpu")
    spec, plain = actor.engine, actor.plain_engine
    assert calls == [("warm_up", spec, 2), ("warm_up", plain, 2)]
    assert actor.warm_up_time_s > 0
    monkeypatch.setattr(SpeculativeEngine, "generate_batch", decoding)
    batch = _rows(TEXTS[:8])
    picked = [i for i in range(8) if audit_selected("f", i, 0.5, 1)]
    assert len(picked) == 5
    outs = []
    for first, second in ((spec, plain), (plain, spec)):
        calls.clear()
        outs.append(actor(batch).to_pylist())
        assert [(c[1], c[2]) for c in calls] == [(first, 2), (second, 2), (second, 3), (first, 3), (spec, 3)]
    assert outs[0][0]["warm_up_time_s"] == actor.warm_up_time_s
    assert all(r["warm_up_time_s"] is None for r in outs[0][1:] + outs[1])
    for out in outs:
        assert [r["audit"] for r in out] == [True if i in picked else None for i in range(8)]
        assert [r["audit_plain_time_s"] is not None for r in out] == [i in picked for i in range(8)]
    assert [r["output_text"] for r in outs[0]] == [r["output_text"] for r in outs[1]]


def test_audit_sample_is_deterministic():
    keys = [("s3://b/shard-1.jsonl", i) for i in range(2000)]
    picked = [audit_selected(f, r, 0.1, seed=7) for f, r in keys]
    assert picked == [audit_selected(f, r, 0.1, seed=7) for f, r in keys]
    assert 140 < sum(picked) < 260
    assert picked != [audit_selected(f, r, 0.1, seed=8) for f, r in keys]
    assert not any(audit_selected(f, r, 0.0, 0) for f, r in keys[:50])
    assert all(audit_selected(f, r, 1.0, 0) for f, r in keys[:50])


def test_audit_end_to_end(ray_local, tiny_models, tmp_path):
    write_jsonl(tmp_path / "in.jsonl", [{"id": i, "text": t} for i, t in enumerate(TEXTS)])
    cfg = job_config(tiny_models, str(tmp_path / "in.jsonl"), str(tmp_path / "out"),
                     overrides=["audit.fraction=0.5", "audit.seed=3", "generation.max_new_tokens=8"])
    summary = run_job(cfg, progress=False)
    t = pq.read_table(tmp_path / "out")
    audited = [a for a in t.column("audit").to_pylist() if a is not None]
    expected = [audit_selected(f, r, 0.5, 3) for f, r in zip(t.column("source_file").to_pylist(),
                                                              t.column("source_row").to_pylist())]
    assert [a is not None for a in t.column("audit").to_pylist()] == expected
    assert summary["audit_rows"] == len(audited) == sum(expected) > 0
    assert summary["audit_mismatches"] == 0 and all(audited)
    assert summary["audit"] == {"fraction": 0.5, "seed": 3, "greedy": True}
    # the measured speedup over plain decoding: plain's time over the method's, on the audited rows
    plain_s = [p for p in t.column("audit_plain_time_s").to_pylist() if p is not None]
    spec_s = [w for w, a in zip(t.column("wall_time_s").to_pylist(), t.column("audit").to_pylist()) if a is not None]
    assert len(plain_s) == len(audited) and summary["audit_speedup"] == pytest.approx(sum(plain_s) / sum(spec_s))
    # the actors' warm-up, apart from the rows' times: on one row per actor
    warm = [w for w in t.column("warm_up_time_s").to_pylist() if w is not None]
    assert 1 <= len(warm) <= cfg.compute.num_actors and sum(warm) > 0
    assert summary["warm_up_time_s"] == pytest.approx(sum(warm))


def test_the_speedup_line_says_what_was_measured(capsys):
    from pipeline.cli import speedup_line

    base = {"audit_rows": 8, "audit_mismatches": 0, "config": {"method": {"name": "eagle"}}}
    speedup_line({**base, "audit_speedup": 1.73})
    speedup_line({**base, "audit_speedup": 0.91})
    speedup_line({**base, "audit_rows": 0, "audit_speedup": None})
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2
    assert "eagle decoded 1.73x as fast as plain decoding, measured on the 8 audited rows" in lines[0]
    assert lines[1].startswith("speculation: plain decoding was faster: eagle ran at 0.91x plain")
