"""The drafter shipped for SmolLM2-135M-Instruct (models/smollm2-135m-drafter) and the default job
that uses it (configs/summarize.yaml), on the real model."""

import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import torch
from realkit import DRAFTER, REPO

from pipeline.config import load_config
from pipeline.engine import GenerationSettings, SpeculationSettings, SpeculativeEngine
from pipeline.prompts import PromptBuilder

DEMO = [json.loads(line) for line in open(REPO / "data" / "demo_prompts.jsonl", encoding="utf-8")]


def test_drafter_checkpoint_is_small_and_shares_the_tokenizer(smollm2):
    model, tok = smollm2
    from transformers import AutoConfig, AutoTokenizer

    size = sum(p.stat().st_size for p in DRAFTER.iterdir() if p.is_file())
    assert size <= 25_000_000, size
    cfg = AutoConfig.from_pretrained(DRAFTER)
    assert cfg.dtype == "bfloat16" or str(cfg.dtype) == "torch.bfloat16"
    assert cfg.vocab_size == model.config.vocab_size and cfg.eos_token_id == model.config.eos_token_id
    dtok = AutoTokenizer.from_pretrained(DRAFTER)
    text = "The council voted 7-2 on Tuesday to build a £20m bridge."
    assert dtok(text)["input_ids"] == tok(text)["input_ids"] and dtok.chat_template == tok.chat_template
    card = (DRAFTER / "README.md").read_text()
    summary = json.loads((DRAFTER / "training_summary.json").read_text())
    assert summary["cost"]["ratio"] <= 1 / 8  # the measured per-token cost ratio recorded by the training run
    assert f"{summary['parameters']:,}" in card and "acceptance rate" in card


@pytest.mark.slow
def test_drafter_is_lossless_and_accepted(smollm2):
    """draft_model decoding with the shipped drafter equals plain greedy, and some of its drafts are
    accepted (an untrained drafter of this vocabulary agrees with the target on about 1 token in 100:
    see the card's figures before and after training)."""
    model, tok = smollm2
    from transformers import AutoModelForCausalLM

    drafter = AutoModelForCausalLM.from_pretrained(DRAFTER, dtype=torch.float32).eval()
    task = load_config(REPO / "configs" / "summarize.yaml").task
    gs = GenerationSettings(max_new_tokens=24)
    plain = SpeculativeEngine(model, SpeculationSettings(method="plain"), tokenizer=tok)
    spec = SpeculativeEngine(model, SpeculationSettings(method="draft_model", num_assistant_tokens=5),
                             drafter=drafter, tokenizer=tok, drafter_tokenizer=tok,
                             draft_length="fixed")  # drafts every step (by expected gain it may not)
    accepted = drafted = 0
    for row in DEMO[:2]:
        _, ids = PromptBuilder(tok, task).build(row["text"])
        a, b = plain.generate(ids, gs), spec.generate(ids, gs)
        assert b.token_ids == a.token_ids
        accepted += b.stats.accepted_tokens
        drafted += b.stats.draft_tokens
    assert drafted > 0 and accepted > 0, (accepted, drafted)


@pytest.mark.slow
def test_default_job_writes_readable_summaries(smollm2, tmp_path):
    """``python jobs/summarize.py`` as in the quick start (configs/summarize.yaml: SmolLM2, the
    method jobs/tune.py chose, chat template), on two demo articles, started in another directory (the config's relative model
    paths resolve against configs/)."""
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in DEMO[:2]))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTHONPATH")}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    r = subprocess.run([sys.executable, str(REPO / "jobs" / "summarize.py"), "--input", str(tmp_path / "in.jsonl"),
                        "--output", str(tmp_path / "out"), "--max-new-tokens", "24", "--no-progress"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)  # from another directory
    assert r.returncode == 0, r.stderr[-3000:]
    rows = pq.read_table(tmp_path / "out").to_pylist()
    assert len(rows) == 2
    method = load_config(REPO / "configs" / "summarize.yaml").method.name
    assert method != "plain"  # the default job speculates
    for row in rows:
        assert row["error"] is None and row["method"] == method  # jobs/tune.py's choice (configs/summarize.yaml)
        assert row["target_model"] == str(REPO / "models" / "cache" / "SmolLM2-135M-Instruct")  # config paths resolve against configs/
        assert row["prompt"].endswith("<|im_start|>assistant\n")
        words = row["output_text"].split()
        assert len(words) >= 5 and sum(w.isalpha() for w in words) >= 3, row["output_text"]
        assert "<|im_end|>" not in row["output_text"]
