"""bench/bench_scale.py cannot rot: its quick mode (the engine stub, 200 and 800 rows in one
file) runs the benchmark end to end: the job, the engine alone, a resume of the complete
output and of a 99 %-complete one, a SIGTERM in the middle of the 200-row file, and writes
its report."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_scale_quick_mode_writes_its_report(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_scale.py"), "--quick", "--layouts", "one",
                          "--output", str(tmp_path / "report")], capture_output=True, text=True, env=env, timeout=1200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["meta"]["stub"].startswith("engine stub") and "engine stub" in run.stdout
    runs = report["runs"]
    assert [(r["engine"], r["rows"], r["layout"]) for r in runs] == [("stub", 200, "one file"), ("stub", 800, "one file")]
    for r in runs:
        assert r["units"] >= 1 and r["manifest_bytes"] > 0 and r["driver_peak_rss_mb"] > 100
        assert r["job_rows_per_s"] > 0 and r["engine_rows_per_s"] > 0 and r["resume_complete_s"] > 0
    small = runs[0]  # quick mode sends the SIGTERM to the 200-row file only
    assert small["sigterm_rc"] in (0, 143) and 0 <= small["sigterm_rows_committed"] <= small["rows"]
    assert small["sigterm_rows_lost"] == max(0, small["sigterm_rows_done"] - small["sigterm_rows_committed"])
    assert "sigterm_rc" not in runs[1]
    (g,) = report["growth"]
    assert g["rows_ratio"] == 4 and all(math.isfinite(f["exponent"]) for f in g["figures"].values())
    assert "driver_rss_growth_mb" in g
    md = (tmp_path / "report" / "report.md").read_text()
    assert "| stub | 800 | one file |" in md and "## Growth" in md and "## Goals" in md
