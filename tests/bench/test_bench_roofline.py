"""bench/bench_roofline.py cannot rot: its bytes and FLOPs follow the model's sizes, its limit is
the slower of memory and arithmetic, and it runs end to end on the tiny demo model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

FACTS = {"layers": 2, "hidden": 8, "q_heads": 4, "kv_heads": 2, "head_dim": 2, "vocab": 10, "bytes_per_element": 4,
         "linear_params": 1000, "lm_head_params": 80}


def test_a_pass_reads_its_weights_once_whatever_its_tokens_and_its_flops_grow_with_them():
    from bench_roofline import part_costs

    one, four = part_costs(FACTS, 1, 1, 50), part_costs(FACTS, 2, 2, 50)
    assert one["linear"] == (4000, 2000) and four["linear"] == (4000, 8000)
    assert one["lm_head"] == (320, 160) and four["lm_head"] == (320, 640)
    # keys and values of every row, layer and KV head: rows x layers x 2 x kv_heads x head_dim x context x 4 bytes
    assert one["attention"][0] == 1 * 2 * 2 * 2 * 2 * 50 * 4 and four["attention"][0] == 2 * one["attention"][0]
    # 4 FLOPs a (query head, key) pair and head dimension: 2 for the scores, 2 for the values
    assert one["attention"][1] == 4 * 2 * 4 * 2 * 50 and four["attention"][1] == 4 * one["attention"][1]
    assert four["logits and sampling"] == (4 * 10 * 4, 40.0)
    prefill = part_costs(FACTS, 1, 50, 50, prefill=True)
    assert prefill["attention"][1] == 4 * 2 * 4 * 2 * (50 * 51 / 2)  # the causal half of the scores
    assert prefill["lm_head"][1] == 160  # the last position's logits only


def test_the_limit_is_the_slower_of_reading_and_computing():
    from bench_roofline import limit_s

    limits = {"read_gbs": 10.0, "gemm_gflops": 100.0}
    assert limit_s((1e9, 1e9), limits) == pytest.approx(0.1)  # bound by memory
    assert limit_s((1e6, 1e11), limits) == pytest.approx(1.0)  # bound by arithmetic


@pytest.mark.slow
def test_it_runs_on_the_demo_model_and_reports_every_pass(tmp_path):
    import bench_roofline

    # the compiled parts off: the test checks the bench, not inductor (minutes on a busy machine)
    rc = bench_roofline.main(["--config", str(ROOT / "configs" / "demo-summarize.yaml"), "--set", "cpu.rowdot=false",
                              "--set", "cpu.compiled_layer=false", "--context", "24", "--widths", "1,3",
                              "--rows", "1,2", "--repeats", "1", "--output", str(tmp_path)])
    assert rc == 0
    report = json.loads((tmp_path / "report.json").read_text())
    facts = report["facts"]
    # the demo target's decoder linear layers: q, k, v, o (320 x 320) and gate, up, down (864 x 320), 8 layers
    assert facts["linear_params"] == 8 * (4 * 320 * 320 + 3 * 864 * 320)
    assert [(p["rows"], p["tokens"]) for p in report["passes"]] == [(1, 1), (1, 3), (2, 1), (2, 3)]
    for p in report["passes"]:
        assert p["ms"]["total"] > 0 and p["limit_ms"] > 0
        assert sum(p["ms"][k] for k in bench_roofline.PARTS) == pytest.approx(p["ms"]["total"], rel=1e-6, abs=1e-6)
        assert p["ms"]["linear"] > 0 and p["ms"]["attention"] > 0  # the lean pass's parts were timed
    assert report["prefill"]["tokens"] == 24 and report["prefill"]["limit_ms"] > 0
    assert (tmp_path / "report.md").read_text().count("| B=") == 4
