"""Smoke test of train/train_smollm2_draft_head.py: every stage on a tiny target, a few
seconds each, then a killed-and-resumed run reuses the cached stages."""

from __future__ import annotations

import importlib.util
import json
import random
import string
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

WORDS = ("the council said a new park will open in the town next spring after years of work on the old site "
         "residents asked for homes but officials chose green space and a path for cyclists").split()


def _script():
    spec = importlib.util.spec_from_file_location("train_draft_head", ROOT / "train" / "train_smollm2_draft_head.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tiny_target(path: Path) -> None:
    """A 4-layer Llama over a character vocabulary (95 printable ASCII characters + unk)."""
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    chars = ["<unk>"] + [c for c in string.printable if c not in "\t\r\x0b\x0c"][:95]
    tok = Tokenizer(models.BPE({c: i for i, c in enumerate(chars)}, merges=[], unk_token="<unk>"))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)
    fast.save_pretrained(path)


def _fake_data(path: Path) -> None:
    rng = random.Random(0)

    def text(n):
        return " ".join(rng.choice(WORDS) for _ in range(n)) + "."

    (path / "xsum_helm_1000").mkdir(parents=True)
    with open(path / "xsum_helm_1000" / "xsum_0shot.jsonl", "w") as f:
        for _ in range(300):
            f.write(json.dumps({"article": "###\nArticle: " + text(rng.randint(5, 25)), "summary_gt": text(6)}) + "\n")
    (path / "wmt_newstest").mkdir()
    (path / "wmt_newstest" / "eng-deu.newstest2014.eng").write_text("\n".join(text(12) for _ in range(120)))


def test_training_script_smoke(tmp_path):
    script = _script()
    _tiny_target(tmp_path / "target")
    _fake_data(tmp_path / "data")
    args = ["--target", str(tmp_path / "target"), "--out", str(tmp_path / "head"), "--work", str(tmp_path / "work"),
            "--data", str(tmp_path / "data"), "--gen-minutes", "0.04", "--news-minutes", "0.01",
            "--train-minutes", "0.04", "--eval-rows", "2", "--eval-k", "1,2", "--max-new-tokens", "8",
            "--max-prompt", "200", "--draft-vocab", "48", "--feature-layers", "eagle3", "--no-tie",
            "--tokens-per-step", "256", "--max-len", "64", "--threads", "1", "--smoke", "--no-autocast",
            "--eval-vocab-sizes", "16,32", "--eval-drafter", ""]
    assert script.main(args) == 0
    out = tmp_path / "head"
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "specbatch_draft_head" and config["draft_vocab_size"] == 48
    assert config["feature_layers"] == [1, 2] and config["tie_lm_head"] is False
    summary = json.loads((out / "training_summary.json").read_text())
    assert summary["data"]["answer_sequences"] > 0 and summary["data"]["news_chunks"] > 0
    assert summary["training"]["steps"] > 0 and len(summary["heldout_top1_answers"]) == 4
    for k, row in summary["acceptance"]["by_k"].items():
        assert row["identical_to_plain"] == summary["acceptance"]["rows"], k  # lossless
    assert set(summary["cost"]) == {"1", "2"}
    assert set(summary["cost_by_draft_vocab_size"]) == {"16", "32"}
    other = summary["acceptance"]["other"]
    assert {"eagle k=2, N=16", "eagle k=2, N=32"} <= set(other)
    assert all(row["identical_to_plain"] == summary["acceptance"]["rows"] for row in other.values())
    card = (out / "README.md").read_text()
    assert "0-263" in card and "acceptance" in card.lower()
    # the XSum report and benchmark articles are in no training record
    from pipeline.engine.draft_head import load_draft_head

    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tmp_path / "target", dtype=torch.float32)
    assert load_draft_head(out, target).draft_vocab.numel() == 48
    # a second run finds every stage cached: it trains nothing new and only re-evaluates
    stamp = {p.name: p.stat().st_mtime for p in (tmp_path / "work" / "answers").glob("shard-*.safetensors")}
    assert stamp
    assert script.main(args + ["--resume"]) == 0
    assert {p.name: p.stat().st_mtime for p in (tmp_path / "work" / "answers").glob("shard-*.safetensors")} == stamp
    again = json.loads((out / "training_summary.json").read_text())
    assert again["training"]["steps"] >= summary["training"]["steps"]
