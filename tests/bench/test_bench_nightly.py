"""bench/bench_nightly.py cannot rot: night 2's rows by kind, and a two-night run on the tiny demo
models (suffix, a few XSum articles, a few tokens) whose outputs with --previous are the plain
night's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT.parent / "shared" / "data"
sys.path.insert(0, str(ROOT / "bench"))


def test_night_2_holds_unchanged_edited_and_new_rows():
    from bench_nightly import edit_one_sentence, nights

    rows = [{"id": f"r{i}", "text": f"First {i}. Second {i}. Third {i}."} for i in range(10)]
    spare = [{"id": f"s{i}", "text": f"Other {i}. More {i}."} for i in range(10)]
    night1, night2 = nights(rows, spare, 0.7, 0.2)
    assert night1 == rows and [r["kind"] for r in night2] == ["unchanged"] * 7 + ["edited"] * 2 + ["new"]
    assert night2[:7] == [dict(r, kind="unchanged") for r in rows[:7]]
    edited = night2[7]
    assert edited["id"] == "r7" and edited["text"] != rows[7]["text"]
    assert edited["text"].startswith("First 7.") and edited["text"].count(".") == 3  # one sentence of three replaced
    assert night2[9]["id"] == "s9" and night2[9]["kind"] == "new"
    assert edit_one_sentence("Only one.", "Else. Two.", 0) == "Only one. Else."


@pytest.mark.slow
@pytest.mark.skipif(not (DATA / "xsum_helm_1000" / "xsum_0shot.jsonl").is_file(), reason="no XSum in ../shared/data")
def test_bench_nightly_runs_two_nights_on_the_demo_models(tmp_path):
    out = tmp_path / "report.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_nightly.py"), "--config",
                          str(ROOT / "configs" / "demo-summarize.yaml"), "--set", "method.name=suffix",
                          "--rows", "0:5", "--unchanged", "0.4", "--edited", "0.4", "--new-tokens", "8",
                          "--batch", "2", "--warm-up-prompt", "16", "--data", str(DATA), "--output", str(out)],
                         capture_output=True, text=True, timeout=600, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    assert [report["kinds"][k]["rows"] for k in ("unchanged", "edited", "new")] == [2, 2, 1]
    assert report["rows_differing"] == 0 and report["kinds"]["unchanged"]["cpu_s_previous"] < 0.5
    assert "goals: night 2 overall" in run.stdout
