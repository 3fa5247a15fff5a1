"""bench/bench_node.py cannot rot: one actor of the job's class on an embedded Ray, one article,
two tokens, one round at one row in flight, end to end: the report results_block reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TARGET = ROOT / "models" / "cache" / "SmolLM2-135M-Instruct"
sys.path.insert(0, str(ROOT / "bench"))


def test_each_actor_starts_elsewhere_and_never_sees_a_row_twice():
    from bench_node import slices

    rows = [{"id": i} for i in range(12)]
    work = slices(rows, actors=3, per_actor=2, rounds=2)
    for a in range(3):
        seen = [r["id"] for rnd in work for r in rnd[a]]
        assert len(seen) == len(set(seen)) == 4
    assert [work[0][a][0]["id"] for a in range(3)] == [0, 4, 8]


def test_a_methods_summary_line_gives_each_ratio_and_the_bounds_range():
    from bench_node import _summary_line

    by_b = {1: {"speedup_cpu": 1.031, "S": 1.99}, 2: {"speedup_cpu": 0.976, "S": 1.58}, 16: {"speedup_cpu": 1.0, "S": None}}
    assert _summary_line("suffix", by_b) == "suffix: 1.03 / 0.98 / 1.00× plain at 1 / 2 / 16 rows (bound 1.58-1.99×)"
    assert _summary_line("eagle", {"1": {"speedup_cpu": 0.97, "S": 1.1}}) == "eagle: 0.97× plain at 1 row (bound 1.10×)"


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.skipif(not (TARGET / "config.json").exists(),
                    reason="the real models were not fetched: run python scripts/fetch_models.py --only smollm2")
def test_bench_node_runs_the_jobs_actor_on_ray(tmp_path):
    from bench_real import XSUM

    if not XSUM.is_file():
        pytest.skip(f"no XSum articles at {XSUM} (../shared/data)")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_node.py"), "--actors", "1", "--batch-sizes", "1",
                          "--rows", "200:201", "--new-tokens", "2", "--rounds", "1", "--min-rows-per-actor", "1",
                          "--output", str(tmp_path)], capture_output=True, text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    entry = report["runs"]["suffix"]["1"]
    assert entry["rows"] == 1 and entry["identical"] + entry["near_ties"] == 1
    assert entry["speculative"]["new_tokens"] == entry["plain"]["new_tokens"] == 2
    assert report["summary"][0].startswith("suffix: ") and "× plain at 1 row" in report["summary"][0]
    assert report["title"].startswith("bench/bench_node.py")
    sys.path.insert(0, str(ROOT / "scripts"))
    import results_block

    line = results_block._line(tmp_path / "report.json", tmp_path.parent)
    assert line.startswith("- [bench/bench_node.py") and "suffix: " in line
