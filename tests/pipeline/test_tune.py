"""The tuner: its prediction on synthetic acceptance and costs (known optima), the replay of
the actor's schedule, and jobs/tune.py end to end on tiny models."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
import yaml

from pipeline.report import speedup_bound
from pipeline.tune.predict import (
    MethodModel,
    PilotRow,
    interpolate,
    line_fit,
    predict_seconds,
    rank_candidates,
)
from pipeline.tune.tuner import VARIANT_MARGIN

REPO = Path(__file__).resolve().parents[2]

# Long rows of equal length: every batch runs full and drains at once, and ⌈N / E⌉ is N / E
# to a millionth, so the replay's optimum is the steady-state formula's.
LONG_ROWS = [PilotRow(prompt_tokens=100, new_tokens=1_000_000, prefill_s=0.0) for _ in range(16)]


def leviathan_e(alpha: float, k: int) -> float:
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def test_prediction_returns_leviathans_optimum_k():
    """α = 0.8 at every position, a verification that costs one step t whatever it verifies
    and a drafter at c = 0.05 t per token: the tuner's best k is the k that maximises
    Leviathan's S(α, k, c) (the report's implementation; 8 here)."""
    alpha, c, t, k_max = 0.8, 0.05, 0.010, 12
    model = MethodModel("draft_model", k_max=k_max, reach=[alpha ** i for i in range(1, k_max + 1)], draft_rate=1.0,
                        verify={1: {1: t, k_max + 1: t}}, propose={1: (0.0, c * t)}, overhead={1: 0.0})
    best = rank_candidates([model], LONG_ROWS, [1], configured_rows_per_batch=1)[0]
    want = max(range(1, k_max + 1), key=lambda k: speedup_bound(alpha, k, c))
    assert (best.k, want) == (8, 8)
    assert best.predicted_tokens_per_s * t == pytest.approx(speedup_bound(alpha, 8, c), rel=1e-5)


def test_prediction_with_per_position_acceptance_and_a_growing_verification_cost():
    """Acceptance falling by position (A = 0.9, 0.5, 0.05, 0.01) and t(n) = 1 + 0.2 (n − 1) ms
    (a CPU): E(k) / T(k) = 1, 1.58, 1.71, 1.53, 1.37 for k = 0 .. 4, so k = 2; plain is
    predicted at 1 token per ms."""
    verify = {1: {n: 1e-3 * (1 + 0.2 * (n - 1)) for n in range(1, 6)}}
    drafter = MethodModel("draft_model", k_max=4, reach=[0.9, 0.5, 0.05, 0.01], draft_rate=1.0, verify=verify,
                          propose={1: (0.0, 0.0)}, overhead={1: 0.0})
    plain = MethodModel("plain", verify=verify, overhead={1: 0.0})
    ranked = rank_candidates([plain, drafter], LONG_ROWS, [1], configured_rows_per_batch=1)
    assert [(c.method, c.k) for c in ranked[:3]] == [("draft_model", 2), ("draft_model", 1), ("draft_model", 3)]
    by = {(c.method, c.k): c.predicted_tokens_per_s for c in ranked}
    assert by[("draft_model", 2)] == pytest.approx(2.4 / 1.4e-3, rel=1e-5)
    assert by[("plain", 0)] == pytest.approx(1000, rel=1e-5)


def test_prediction_picks_draft_length_and_batch_size_together():
    """A GPU-like target: a pass costs 10 ms until it verifies 32 tokens in all, then grows
    in proportion (compute-bound); α = 0.8, drafting free.  tokens/s = B·E(k) / t(B(k+1)):
    the best (B, k) by brute force over the closed form is B = 16, k = 1 (28.8 tokens per
    10 ms, against 26.0 for k = 2 and 16 for plain at B = 16)."""
    alpha, k_max, sizes = 0.8, 6, [1, 2, 4, 8, 16]

    def t(b, n):
        return 0.010 * max(1.0, b * n / 32)

    verify = {b: {n: t(b, n) for n in range(1, k_max + 2)} for b in sizes}
    model = MethodModel("draft_model", k_max=k_max, reach=[alpha ** i for i in range(1, k_max + 1)], draft_rate=1.0,
                        verify=verify, propose={b: (0.0, 0.0) for b in sizes}, overhead={b: 0.0 for b in sizes})
    plain = MethodModel("plain", verify=verify, overhead={b: 0.0 for b in sizes})
    best = rank_candidates([plain, model], LONG_ROWS, sizes, configured_rows_per_batch=16)[0]
    brute = max(((b, k) for b in sizes for k in range(k_max + 1)),
                key=lambda bk: bk[0] * leviathan_e(alpha, bk[1]) / t(bk[0], bk[1] + 1))
    assert (best.method, best.batch_size, best.k) == ("draft_model", *brute) == ("draft_model", 16, 1)
    assert best.predicted_tokens_per_s == pytest.approx(16 * 1.8 / 0.010, rel=1e-4)


def test_replay_of_the_actors_schedule_by_hand():
    """Rows of 2, 4 and 6 tokens, plain decoding, 2 rows in flight, one batch of 3 rows; a
    step of b rows costs b seconds, each row's prefill 0.5 s and 0.1 s outside the steps:
    2 steps with 2 rows (4 s), the first row leaves, the third joins: 2 steps with 2 rows
    (4 s), then 4 steps alone (4 s) = 12 s + 3 × 0.6 s."""
    rows = [PilotRow(10, n, prefill_s=0.5, outside_s=0.1) for n in (2, 4, 6)]
    plain = MethodModel("plain", verify={1: {1: 1.0}, 2: {1: 2.0}}, overhead={1: 0.0, 2: 0.0})
    assert predict_seconds(plain, rows, 0, batch_size=2, rows_per_batch=3) == pytest.approx(13.8)
    # rows per batch 1: every row alone (12 steps of 1 s)
    assert predict_seconds(plain, rows, 0, batch_size=2, rows_per_batch=1) == pytest.approx(13.8)
    # a drafter with E(k) = 2 halves the steps (⌈N / 2⌉ = 1, 2, 3) and its admission costs per prompt token
    drafter = MethodModel("draft_model", k_max=1, reach=[1.0], draft_rate=1.0, verify={1: {1: 1.0, 2: 1.0}},
                          propose={1: (0.0, 0.5)}, overhead={1: 0.25}, admit_s_per_token=0.01)
    assert predict_seconds(drafter, rows, 1, batch_size=1, rows_per_batch=3) == pytest.approx(
        6 * (1.0 + 0.5 + 0.25) + 3 * (0.6 + 0.1))


def test_interpolation_and_cost_line():
    table = {1: 1.0, 4: 4.0, 8: 6.0}
    assert interpolate(table, 1) == 1.0 and interpolate(table, 0.5) == 1.0
    assert interpolate(table, 2) == pytest.approx(2.0)
    assert interpolate(table, 6) == pytest.approx(5.0)
    assert interpolate(table, 10) == pytest.approx(7.0)  # extended along the last segment
    assert line_fit([(1, 3.0), (5, 11.0), (10, 21.0)]) == pytest.approx((1.0, 2.0))
    assert line_fit([(4, 8.0)]) == pytest.approx((0.0, 2.0))
    assert line_fit([(1, 5.0), (10, 4.0)]) == pytest.approx((4.5, 0.0))  # never a falling cost
    # the drafting rate: a row drafts in 40 % of steps, so 2 rows verify k + 1 tokens in 64 % of steps
    m = MethodModel("prompt_lookup", k_max=3, reach=[0.1, 0.05, 0.0], draft_rate=0.4,
                    verify={2: {1: 1.0, 4: 2.0}}, propose={2: (0.1, 0.0)}, overhead={2: 0.0})
    assert m.step_time(2, 3) == pytest.approx(0.64 * 2.0 + 0.36 * 1.0 + 0.1)
    assert m.step_time(2, 0) == pytest.approx(1.0)


# ---------------------------------------------------------------------------- end to end
def _job(tmp_path: Path, tiny_models: dict[str, str], rows: int = 10) -> Path:
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from tiny import SENTENCES

    data = tmp_path / "in.jsonl"
    with data.open("w") as f:
        for i in range(rows):
            f.write(json.dumps({"id": f"r{i}", "text": " ".join(SENTENCES[(i + j) % 8] for j in range(3))}) + "\n")
        f.write(json.dumps({"id": "bad", "text": None}) + "\n")  # an error row: left out of the pilot
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump({
        "input": {"uri": str(data)}, "task": {"name": "summarize", "chat_template": False},
        "models": {"target": tiny_models["target"], "drafter": tiny_models["drafter"]},
        "method": {"name": "draft_model", "num_assistant_tokens": 2},
        "generation": {"max_new_tokens": 8}, "compute": {"rows_per_batch": 4, "num_actors": 1},
        "output": {"uri": str(tmp_path / "out")}}))
    return cfg


def test_tune_job_end_to_end_on_tiny_models(tmp_path, tiny_models, capsys):
    """jobs/tune.py on a tiny pair: every method the models allow is piloted and profiled, the
    candidates are predicted and the top ones confirmed (lossless), and the tuned config
    passes --print-config with the chosen method and compute filled in."""
    import importlib.util

    from pipeline.cli import main as job_main

    cfg = _job(tmp_path, tiny_models)
    spec = importlib.util.spec_from_file_location("tune_job", REPO / "jobs" / "tune.py")
    tune_job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune_job)
    out = tmp_path / "tune"
    rc = tune_job.main(["--config", str(cfg), "--rows", "11", "--batch-sizes", "1", "2", "--max-draft", "2",
                        "--repeats", "1", "--confirm", "2", "--confirm-rounds", "2", "--pilot-batch-size", "4",
                        "--out", str(out)])
    assert rc == 0
    headline = json.loads(capsys.readouterr().out)
    data = json.loads((out / "tune_report.json").read_text())

    # the pilot: the first 11 rows, the null text left out; every drafting method ran
    assert set(data["pilot"]) == {"draft_model", "prompt_lookup", "suffix"}
    for run in data["pilot"].values():
        assert run["k"] == 2 and run["verify_steps"] > 0 and len(run["drafted_per_position"]) <= 2
    assert data["mismatches"] == {"draft_model": 0, "prompt_lookup": 0, "suffix": 0}
    # every (method, k, B) predicted: plain at 2 batch sizes, 3 drafting methods x k 1..2 x 2
    assert len(data["candidates"]) == 2 + 3 * 2 * 2
    assert {c["method"] for c in data["candidates"]} == {"plain", "draft_model", "prompt_lookup", "suffix"}
    confirmed = data["confirmed"]
    ranked = [c for c in confirmed if c["params"].get("num_candidates", 1) == 1]
    assert 2 <= len(ranked) <= 3 and any(c["method"] == "plain" for c in ranked)
    # a chosen drafting method is measured again with token trees (every method here drafts them)
    trees = [c for c in confirmed if c["params"].get("num_candidates", 1) > 1]
    best = max(ranked, key=lambda c: c["measured_tokens_per_s"])
    assert len(trees) == (best["method"] != "plain")
    assert all(c["params"] == {**best["params"], "num_candidates": 4} and c["k"] == best["k"] for c in trees)
    for c in confirmed:  # confirmation runs are lossless and measured, in 2 rounds
        assert c["same_output"] == c["compared_rows"] == 10 and c["measured_tokens_per_s"] > 0
        assert len(c["round_s"]) == 2 and c["measured_s"] == pytest.approx(statistics.median(c["round_s"]))
    chosen = next(c for c in confirmed if c["label"] == headline["chosen"])
    if chosen in ranked:
        assert chosen is best
    else:  # the token trees beat the chosen candidate as measured again in their own rounds
        again = data["variant_reference"]
        assert again["label"] == best["label"] and again["same_output"] == again["compared_rows"] == 10
        assert chosen["measured_tokens_per_s"] > (1 + VARIANT_MARGIN) * again["measured_tokens_per_s"]
    assert data["summary"]["calibration"] > 0
    # the target's verification cost for n = 1 .. K+1 at each batch size
    assert {int(b): sorted(int(n) for n in row) for b, row in data["profiles"]["plain"]["verify_s"].items()} == \
        {1: [1, 2, 3], 2: [1, 2, 3]}

    # the tuned config: the input config with method and compute filled in, accepted by the job
    tuned = yaml.safe_load((out / "tuned.yaml").read_text())
    original = yaml.safe_load(cfg.read_text())
    assert {k: v for k, v in tuned.items() if k not in ("method", "compute")} == \
        {k: v for k, v in original.items() if k not in ("method", "compute")}
    assert tuned["method"]["name"] == chosen["method"]
    assert tuned["compute"] == {"rows_per_batch": chosen["rows_per_batch"], "num_actors": 1,
                                "max_batch_size": chosen["batch_size"],
                                "draft_length": "auto"}
    if chosen["method"] != "plain":
        key = "prompt_lookup_num_tokens" if chosen["method"] == "prompt_lookup" else "num_assistant_tokens"
        assert tuned["method"][key] == chosen["k"]
        assert {k: tuned["method"][k] for k in chosen["params"]} == chosen["params"]
    assert job_main("summarize", ["--config", str(out / "tuned.yaml"), "--print-config"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["method"]["name"] == chosen["method"]

    # the report: tuning time and its share, predicted vs measured, acceptance by position
    report = (out / "tune_report.md").read_text()
    assert f"**Chosen: {chosen['label']}**" in report and "10000" in report and "goal: under 10 %" in report
    assert math.isclose(headline["tuning_share_10000_rows"],
                        headline["tuning_s"] / headline["estimated_run_s_10000_rows"])
    for png in ("tune_predicted_vs_measured.png", "tune_acceptance_by_position.png", "tune_predicted_by_k.png",
                "tune_verify_cost.png"):
        assert png in report and (out / png).stat().st_size > 1000


def test_tune_job_refuses_bad_input_before_measuring(tmp_path, tiny_models, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("tune_job", REPO / "jobs" / "tune.py")
    tune_job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune_job)
    cfg = _job(tmp_path, tiny_models)
    assert tune_job.main(["--config", str(tmp_path / "missing.yaml"), "--out", str(tmp_path / "t")]) == 2
    assert "config file not found" in capsys.readouterr().err
    assert tune_job.main(["--config", str(cfg), "--methods", "mtp", "--out", str(tmp_path / "t")]) == 2
    assert "not allowed by the configured models" in capsys.readouterr().err
    assert tune_job.main(["--config", str(cfg), "--set", "models.target=/nope", "--out", str(tmp_path / "t")]) == 2
    assert "models.target" in capsys.readouterr().err
    assert not (tmp_path / "t").exists()


def test_tune_confirms_with_the_controller_on_warmed_engines_and_tries_the_winners_trees(tmp_path, tiny_models,
                                                                                        monkeypatch):
    """With only the drafter to choose from: the pilot runs a fixed k (acceptance by position
    for the prediction), every confirmation run has the draft-length controller on with the
    candidate's k as its cap, on a fresh engine warmed up before its timed rows; the chosen
    candidate's token trees are measured against it in their own rounds and kept only when
    VARIANT_MARGIN faster; the tuned config runs the controller."""
    from pipeline.config import load_config
    from pipeline.engine import SpeculativeEngine
    from pipeline.tune import confirm
    from pipeline.tune.tuner import TREE_CANDIDATES, TuneOptions, read_raw_config, tune

    events: list[tuple[str, int, str | None]] = []  # (what, engine, its draft length)
    engines: list = []  # every engine seen, kept alive: an id is unique only among living objects
    warm_up, measure = SpeculativeEngine.warm_up, confirm.measure_candidate

    def seen(engine) -> int:
        if not any(e is engine for e in engines):
            engines.append(engine)
        return next(i for i, e in enumerate(engines) if e is engine)

    def warming(self, *args, **kwargs):
        events.append(("warm", seen(self), self.controller and ("fixed" if self.controller.fixed else "auto")))
        return warm_up(self, *args, **kwargs)

    def measuring(engine, *args, **kwargs):
        events.append(("measure", seen(engine), engine.controller and ("fixed" if engine.controller.fixed else "auto")))
        return measure(engine, *args, **kwargs)

    monkeypatch.setattr(SpeculativeEngine, "warm_up", warming)
    monkeypatch.setattr(confirm, "measure_candidate", measuring)
    path = _job(tmp_path, tiny_models, rows=6)
    result = tune(load_config(path), TuneOptions(rows=6, batch_sizes=(1, 2), methods=("draft_model",), max_draft=3,
                                                 repeats=1, confirm=1, confirm_rounds=1), raw_config=read_raw_config(str(path), None),
                  log=lambda line: None)
    measured = [e for e in events if e[0] == "measure"]
    assert len(measured) == 3 and all(draft_length == "auto" for _, _, draft_length in measured)
    for i, e in enumerate(events):  # each measured engine was warmed up just before, and measured once
        if e[0] == "measure":
            assert events[i - 1] == ("warm", e[1], e[2])
    assert len({e[1] for e in measured}) == 3
    assert ("warm", events[1][1], "fixed") in events  # the pilot's engine: a fixed k, warmed up too
    ranked, trees = result.confirmed
    assert (ranked.method, trees.method) == ("draft_model",) * 2
    assert trees.k == ranked.k and trees.params == {**ranked.params, "num_candidates": TREE_CANDIDATES}
    assert "trees=4" in trees.label
    for c in result.confirmed:  # lossless, measured on the same rows
        assert c.same_output == c.compared_rows == 6 and c.measured_tokens_per_s > 0
    again = result.variant_reference  # the chosen measured again in the variant's rounds
    assert again is not ranked and again.label == ranked.label and again.same_output == 6
    if trees.measured_tokens_per_s > (1 + VARIANT_MARGIN) * again.measured_tokens_per_s:
        assert result.chosen is trees
    else:
        assert result.chosen is ranked and any("left out" in n for n in result.notes)
    method = result.tuned_config["method"]
    assert method["num_assistant_tokens"] == result.chosen.k and result.tuned_config["compute"]["draft_length"] == "auto"
    assert method["num_assistant_tokens_schedule"] == "constant"


def test_confirmation_rounds_are_interleaved_so_a_slowdown_meets_every_candidate(monkeypatch):
    """Another process starts after the first confirmation run and slows the machine 1.5x.
    Measured one after the other, the candidate that ran first wins although it is 10 %
    slower; in rotated rounds (B A, A B, B A) both medians fall in the slow time, and the
    faster one wins.  Each round builds its engine afresh (nothing learnt carries over)."""
    from types import SimpleNamespace

    from pipeline.tune import confirm as confirmation, tuner
    from pipeline.tune.predict import Candidate

    built: list[str] = []
    speed = {"A": 0.9, "B": 1.0}  # seconds per run on a quiet machine: A is the faster

    def fake_measure(engine, prompts, settings, batch_size, rows_per_batch, clock):
        seconds = speed[engine] * (1.0 if len(built) == 1 else 1.5)
        return seconds, [SimpleNamespace(error=None, token_ids=[7], stats=SimpleNamespace(new_tokens=10))]

    def fake_engine(choice, k, batch_size):
        built.append(choice.params["tag"])
        return choice.params["tag"]

    monkeypatch.setattr(confirmation, "measure_candidate", fake_measure)

    def confirm(rounds: int) -> tuple[Candidate, Candidate]:
        built.clear()
        choices = {"prompt_lookup": tuner.MethodChoice("prompt_lookup", 3)}
        bench = confirmation.Confirmation(fake_engine, lambda: 0.0, choices, lambda line: None, [[1]], [None], 0.0, [[7]])
        b, a = (Candidate("prompt_lookup", 3, 4, 16, params={"tag": t}) for t in "BA")
        bench.run_rounds([b, a], rounds)
        return a, b

    a, b = confirm(1)
    assert built == ["B", "A"] and b.measured_tokens_per_s > a.measured_tokens_per_s  # the slowdown decided
    a, b = confirm(3)
    assert built == ["B", "A", "A", "B", "B", "A"]
    assert a.round_s == [1.35, 1.35, 1.35] and b.round_s == [1.0, 1.5, 1.5]
    assert a.measured_tokens_per_s == pytest.approx(10 / 1.35) and b.measured_tokens_per_s == pytest.approx(10 / 1.5)
    assert a.same_output == a.compared_rows == 1
