"""bench/bench_roofline.py cannot rot: its bytes and FLOPs follow the model's sizes, its limit is
the slower of memory and arithmetic, it reads llama-batched-bench's table (``--peer``) and runs
nothing beside us without it, and it runs end to end on the tiny demo model."""

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


#: llama-batched-bench's output (llama.cpp 0c1e57098, vendored in llama-cpp-python 0.3.36's sdist), captured whole
#: on this project's loaded 2-core machine: SmolLM2-135M-Instruct F32, -t 1 -tb 1 -c 3728 -npp 900 -ntg 32 -npl 1,4
PEER_SAMPLE = """\
0.01.958.303 W llama_context: n_ctx is not divisible by n_seq_max - rounding down to 4096

llama_batched_bench: n_kv_max = 4096, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0, is_tg_separate = 0, n_gpu_layers = -1, n_threads = 1, n_threads_batch = 1

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|   900 |     32 |    1 |    932 |   18.952 |    47.49 |    6.143 |     5.21 |   25.095 |    37.14 |
|   900 |     32 |    4 |   3728 |   67.024 |    53.71 |   13.844 |     9.25 |   80.868 |    46.10 |

"""


def test_the_peers_table_is_parsed_into_its_runs_and_settings():
    from bench_roofline import parse_peer

    peer = parse_peer(PEER_SAMPLE)
    assert [r["rows"] for r in peer["runs"]] == [1, 4]
    assert peer["runs"][0] == {"prompt_tokens": 900, "new_tokens": 32, "rows": 1, "kv_positions": 932,
                               "prompt_s": 18.952, "prompt_tokens_per_s": 47.49, "generation_s": 6.143,
                               "generation_tokens_per_s": 5.21, "total_s": 25.095, "tokens_per_s": 37.14}
    assert peer["runs"][1]["generation_tokens_per_s"] == 9.25 and peer["runs"][1]["kv_positions"] == 3728
    assert peer["settings"]["n_threads"] == 1 and peer["settings"]["flash_attn"] == -1
    assert peer["settings"]["n_kv_max"] == 4096 and peer["settings"]["is_pp_shared"] == 0
    assert peer["build"] is None  # this build logs no "build:" line at its default verbosity
    with pytest.raises(ValueError, match="no table"):
        parse_peer("main: error: unable to load model\n")


def test_the_peers_command_holds_every_sequence_on_one_thread():
    from bench_roofline import peer_command

    cmd = peer_command("bin/llama-batched-bench", "m.gguf", 900, 32, [1, 4, 16])
    assert cmd[0] == "bin/llama-batched-bench" and cmd[-1] == "-pps"  # one prompt, its cache copied to each sequence
    args = dict(zip(cmd[1:-1:2], cmd[2:-1:2]))
    assert args["-m"] == "m.gguf" and args["-t"] == "1" and args["-tb"] == "1"
    assert args["-npp"] == "900" and args["-ntg"] == "32" and args["-npl"] == "1,4,16"
    assert args["-c"] == str(16 * (900 + 32))  # 16 sequences of the prompt and their new tokens


def _data(rows=(1, 4, 16), context=900):
    """bench_roofline.measure's data, made up: one-token passes of 50 ms a row, a 3 s prefill."""
    from bench_roofline import PARTS

    def t(total):
        return {**{p: 0.0 for p in PARTS}, "total": total}

    return {"facts": FACTS, "limits": {"read_gbs": 10.0, "gemm_gflops": 100.0}, "load_s": 0.0, "context": context,
            "widths": [1], "rows": list(rows), "prefill": t(3.0), "passes": {(b, 1): t(0.05 * b) for b in rows},
            "plan": "made up", "lean": True, "target": "made-up"}


def test_ours_beside_the_peer_is_rows_over_our_step_and_the_prompt_over_our_prefill():
    from bench_roofline import limit_s, parse_peer, part_costs, peer_report

    data = _data()  # rows 1, 4 and 16: the peer ran 1 and 4
    table, figures = peer_report(data, parse_peer(PEER_SAMPLE))
    assert [f["rows"] for f in figures] == [1, 4] and table.count("\n") == 3
    one, four = figures
    assert one["ours_generation_tokens_per_s"] == pytest.approx(1 / 0.05)
    assert one["generation_ours_over_peer"] == pytest.approx(20.0 / 5.21)
    assert one["ours_prompt_tokens_per_s"] == pytest.approx(300.0)
    assert one["prompt_ours_over_peer"] == pytest.approx(300.0 / 47.49)
    assert four["ours_generation_tokens_per_s"] == pytest.approx(4 / 0.2)
    assert four["peer_step_ms"] == pytest.approx(1e3 * 13.844 / 32)  # a step generates one token in each row
    assert four["prompt_ours_over_peer"] is None  # our prefill is measured at one row only
    weights = (FACTS["linear_params"] + FACTS["lm_head_params"]) * 4
    assert one["ours_weights_gbs"] == pytest.approx(weights / 0.05 / 1e9)
    lim = sum(limit_s(c, data["limits"]) for c in part_costs(FACTS, 4, 1, 900).values())
    assert four["limit_ms"] == pytest.approx(1e3 * lim)


def test_without_peer_nothing_runs_beside_us_and_bad_peer_input_stops_before_any_work(tmp_path, monkeypatch, capsys):
    import bench_roofline

    measured = []
    monkeypatch.setattr(bench_roofline, "measure", lambda args: measured.append(args) or _data(rows=(1,), context=24))

    def no_peer(cmd):
        raise AssertionError(f"the peer ran: {cmd}")

    monkeypatch.setattr(bench_roofline, "run_peer", no_peer)
    assert bench_roofline.main(["--rows", "1", "--widths", "1", "--output", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert "peer" not in report and "peer" not in report["meta"]
    assert "llama" not in capsys.readouterr().out and "llama" not in (tmp_path / "report.md").read_text()
    assert len(measured) == 1

    for argv, field in ((["--peer", str(tmp_path / "missing")], "--peer"),
                        (["--peer", sys.executable, "--peer-gguf", str(tmp_path / "none.gguf")], "--peer-gguf"),
                        (["--peer", sys.executable, "--peer-gguf", str(tmp_path / "report.md"), "--widths", "2,3"],
                         "--widths")):
        assert bench_roofline.main(argv) == 2
        assert field in capsys.readouterr().err
    assert len(measured) == 1  # no work started


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
