"""bench/gpu_check.sh cannot rot: its CPU quick mode runs the real benchmark end to end
(both dtypes, every method whose drafter is there, two batch sizes) and writes its tables."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TARGET = ROOT / "models" / "cache" / "SmolLM2-135M-Instruct"


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.skipif(not (TARGET / "config.json").exists(), reason="the real models were not fetched (scripts/fetch_models.py)")
def test_gpu_check_runs_on_the_cpu_in_quick_mode(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--device", "cpu", "--quick", "--output", str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for dtype in ("bfloat16", "float32"):
        report = json.loads((tmp_path / dtype / "report.json").read_text())
        assert report["meta"]["dtype"] == dtype and report["meta"]["batch_sizes"] == [1, 2]
        assert {"plain", "prompt_lookup", "suffix", "prompt_lookup@method.num_candidates=4",
                "eagle@method.num_candidates=4"} <= set(report["runs"])
        for method, by_b in report["runs"].items():
            for b, r in by_b.items():
                assert r["identical"] + r["near_ties"] == r["rows"] == 2, (dtype, method, b)
        assert report["summary"][0].startswith("best speculative / plain at 1 row:")
    assert "== SmolLM2-135M-Instruct, float32, cpu" in run.stdout
