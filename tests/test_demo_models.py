"""The bundled demo checkpoints load as standard Hugging Face models and keep their promises."""

from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "models"
NAMES = ("demo-target", "demo-drafter", "demo-drafter-othertok")


def _load(name):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = MODELS / name
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


def _cost(model):
    """~2 x (non-embedding weights + LM head) per token (tied embeddings)."""
    total = sum(p.numel() for p in model.parameters())
    return 2 * (total - model.model.embed_tokens.weight.numel() + model.lm_head.weight.numel())


def test_size_and_cards():
    files = [p for name in NAMES for p in (MODELS / name).rglob("*") if p.is_file()]  # not models/cache/
    assert sum(p.stat().st_size for p in files) <= 40 * 2**20
    for name in NAMES:
        card = (MODELS / name / "README.md").read_text()
        assert "final training loss" in card and "steps:" in card and "## Data" in card


def test_pair_loads_and_agrees_on_greedy_prefix():
    target, tok = _load("demo-target")
    drafter, dtok = _load("demo-drafter")
    other, otok = _load("demo-drafter-othertok")
    assert target.config.model_type == "llama" and 10e6 <= sum(p.numel() for p in target.parameters()) <= 30e6
    assert target.config.early_exit_layer == 2 and target.config.num_hidden_layers == 8
    assert dtok.get_vocab() == tok.get_vocab()  # the drafter shares the tokenizer
    assert otok.get_vocab() != tok.get_vocab() and len(otok) == 2048  # universal assisted decoding
    assert _cost(drafter) <= _cost(target) / 8
    assert target.generation_config.eos_token_id == tok.eos_token_id == 1
    ids = tok("Article: The council voted to build a new park.\nSummary:", return_tensors="pt")["input_ids"]
    assert ids[0, 0].item() == tok.bos_token_id
    out = target.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape[1] > ids.shape[1]
    text = otok.decode(otok("Der Stadtrat hat 2024 entschieden.", add_special_tokens=False)["input_ids"])
    assert text == "Der Stadtrat hat 2024 entschieden."  # byte-level: lossless round trip


@pytest.mark.parametrize("name", NAMES)
def test_weights_are_bf16_on_disk(name):
    import json

    assert json.loads((MODELS / name / "config.json").read_text())["dtype"] == "bfloat16"


def test_smollm2_drafter_ships_within_25_mb_with_its_card():
    """models/smollm2-135m-drafter (tests/real/ checks it against its target)."""
    folder = MODELS / "smollm2-135m-drafter"
    assert sum(p.stat().st_size for p in folder.iterdir() if p.is_file()) <= 25_000_000
    card = (folder / "README.md").read_text()
    for needed in ("## Data", "final training loss", "acceptance rate", "measured cost ratio", "load average"):
        assert needed in card, needed
