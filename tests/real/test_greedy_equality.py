"""Our engine on the real models, greedy, a few tokens: plain and prompt_lookup decoding give
exactly transformers ``generate()``'s tokens, with the prompts the jobs build (SmolLM2's chat
template; Gemma 3's base-model template), and for Gemma 3 also with a prompt longer than its
512-token sliding window."""

import json

import pytest
import torch
from realkit import REPO

from pipeline.config import load_config
from pipeline.engine import GenerationSettings, SpeculationSettings, SpeculativeEngine
from pipeline.prompts import PromptBuilder

NEW_TOKENS = 12
DEMO = [json.loads(line)["text"] for line in open(REPO / "data" / "demo_prompts.jsonl", encoding="utf-8")]
METHODS = [SpeculationSettings(method="plain"),
           SpeculationSettings(method="prompt_lookup", prompt_lookup_num_tokens=5, max_matching_ngram_size=2)]


def _long_article() -> str:
    rows = [json.loads(line) for line in open(REPO.parent / "shared" / "data" / "spec_bench" / "question.jsonl",
                                              encoding="utf-8")]
    return next(r["turns"][0] for r in rows if r["category"] == "summarization")[len("Summarize: "):]


@torch.inference_mode()
def _generate(model, ids: list[int]) -> list[int]:
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(ids):].tolist()


def _check(model, tokenizer, ids: list[int]):
    expected = _generate(model, ids)
    assert len(expected) > 0
    for spec in METHODS:
        got = SpeculativeEngine(model, spec, tokenizer=tokenizer).generate(ids, GenerationSettings(max_new_tokens=NEW_TOKENS))
        assert got.token_ids == expected, (spec.method, tokenizer.decode(got.token_ids), tokenizer.decode(expected))
    return expected


def test_smollm2_chat_prompt(smollm2):
    model, tok = smollm2
    task = load_config(REPO / "configs" / "real" / "smollm2-xsum-draft_model.yaml").task
    prompt, ids = PromptBuilder(tok, task).build(DEMO[0])
    assert prompt.startswith("<|im_start|>system") and prompt.endswith("<|im_start|>assistant\n")
    expected = _check(model, tok, ids)
    assert tok.decode(expected).strip()[:1].isalpha()  # an English answer, not padding or a special token


@pytest.mark.parametrize("which", ["short", "longer_than_the_window"])
@pytest.mark.slow
def test_gemma3_base_prompt(gemma3, which):
    model, tok = gemma3
    task = load_config(REPO / "configs" / "real" / "gemma3-spec-bench-prompt_lookup.yaml").task
    text = DEMO[1] if which == "short" else _long_article()
    _, ids = PromptBuilder(tok, task).build(text)
    window = model.config.sliding_window
    assert (len(ids) > window + 50) == (which != "short"), len(ids)
    assert ids[0] == tok.bos_token_id
    _check(model, tok, ids)


@pytest.mark.slow
def test_gemma3_as_draft_model_and_early_exit_past_the_window(gemma3):
    """The issue's regression: Gemma 3 270M (five sliding layers of 512 to one global) as a
    draft model (the target a copy of itself, so every draft is accepted and the verifier
    runs ahead of the window with rollbacks of nothing) and drafting with its own first six
    layers (early exit: rejections and rollbacks), on a prompt past the window, batched with
    a short one: outputs equal plain greedy."""
    import copy

    model, tok = gemma3
    task = load_config(REPO / "configs" / "real" / "gemma3-spec-bench-prompt_lookup.yaml").task
    builder = PromptBuilder(tok, task)
    prompts = [builder.build(_long_article())[1], builder.build(DEMO[1])[1]]
    assert len(prompts[0]) > model.config.sliding_window + 50
    settings = GenerationSettings(max_new_tokens=NEW_TOKENS)
    plain = [r.token_ids for r in SpeculativeEngine(model, tokenizer=tok).generate_batch(prompts, settings)]
    assert plain[0] == _generate(model, prompts[0])
    drafter = copy.deepcopy(model)
    for spec, d in [(SpeculationSettings(method="draft_model", num_assistant_tokens=4), drafter),
                    (SpeculationSettings(method="early_exit", assistant_early_exit=6, num_assistant_tokens=3), None)]:
        engine = SpeculativeEngine(model, spec, drafter=d, tokenizer=tok, max_batch_size=2, draft_length="fixed")
        results = engine.generate_batch(prompts, settings)
        assert [r.token_ids for r in results] == plain, spec.method
        assert sum(r.stats.draft_tokens for r in results) > 0
        if spec.method == "draft_model":
            assert all(r.stats.acceptance_rate == 1.0 for r in results)
