"""Self-speculative early exit (``method="early_exit"``, ``assistant_early_exit=L``).

A LayerSkip-style Llama checkpoint in miniature, saved with ``save_pretrained`` and
loaded with ``from_pretrained``.  Greedy equals plain decoding and ``generate(
assistant_early_exit=L)``; the draft's first ``L`` layers are never recomputed by the
verifier (KV reuse); sampling keeps the target's distribution (chi-square).
"""

from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch
from transformers import DynamicCache

import test_sampling as ts
from pipeline.engine import GenerationSettings, SpeculationSettings, SpeculativeEngine
from tiny_checkpoints import layerskip_llama
from tiny_models import build, check_stats, prompt_of

K = 3
LAYERS = 4


@pytest.fixture(scope="module")
def layerskip(tmp_path_factory):
    model = layerskip_llama(tmp_path_factory.mktemp("layerskip"), layers=LAYERS)
    cfg = model.generation_config  # generate() reads the early-exit draft settings from the target's own config
    cfg.num_assistant_tokens, cfg.num_assistant_tokens_schedule, cfg.assistant_confidence_threshold = K, "constant", 0.0
    return model


def engine(target, layers, **kw):
    return SpeculativeEngine(target, SpeculationSettings(method="early_exit", assistant_early_exit=layers,
                                                         num_assistant_tokens=K, **kw))


def hf_generate(target, prompt, max_new_tokens, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = target.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False, **kw)
    return out[0, prompt.shape[1]:].tolist()


def test_checkpoint_is_layerskip_style(layerskip):
    assert type(layerskip).__name__ == "LlamaForCausalLM"
    assert layerskip.config.tie_word_embeddings and layerskip.config.rope_parameters["rope_type"] == "llama3"
    assert layerskip.dtype == torch.float64


@pytest.mark.parametrize("layers", [1, 2, 3])
@pytest.mark.parametrize("prompt_len, budget", [(1, 30), (3, 2), (17, 1), (17, 40)])
def test_greedy_matches_plain_and_generate(layerskip, layers, prompt_len, budget):
    prompt = prompt_of(prompt_len, seed=prompt_len)
    plain = SpeculativeEngine(layerskip).generate(prompt, GenerationSettings(max_new_tokens=budget)).token_ids
    result = engine(layerskip, layers).generate(prompt, GenerationSettings(max_new_tokens=budget))
    assert result.token_ids == plain
    assert result.token_ids == hf_generate(layerskip, prompt, budget, assistant_early_exit=layers)
    assert result.finish_reason == "length"
    check_stats(result, K)


def test_repetition_penalty_and_heuristic_schedule(layerskip):
    prompt = prompt_of(9, seed=3)
    ref = hf_generate(layerskip, prompt, 30, repetition_penalty=1.5)
    for schedule in ("constant", "heuristic"):
        result = engine(layerskip, 2, num_assistant_tokens_schedule=schedule).generate(
            prompt, GenerationSettings(max_new_tokens=30, repetition_penalty=1.5))
        assert result.token_ids == ref, schedule
        check_stats(result)


def test_partial_acceptance_and_statistics(layerskip):
    """The early exit is neither always right nor always wrong; deeper exits agree more."""
    rates = {}
    for layers in (1, 2):
        results = [engine(layerskip, layers).generate(prompt_of(12, seed=s), GenerationSettings(max_new_tokens=40))
                   for s in range(4)]
        for r in results:
            check_stats(r, K)
            assert r.stats.verify_steps > 0 and r.stats.draft_time_s > 0 and r.stats.verify_time_s > 0
        drafted = sum(r.stats.draft_tokens for r in results)
        accepted = sum(r.stats.accepted_tokens for r in results)
        assert 0 < accepted < drafted
        rates[layers] = accepted / drafted
    assert rates[2] > rates[1]


def test_verifier_reuses_the_draft_layers(layerskip):
    """KV reuse: every position goes through layer 0 exactly as often as through the last
    layer (once), although the first L layers also draft; the shared cache stays aligned."""
    eng = engine(layerskip, 2)  # built first: its split check runs a probe through every layer
    counts = Counter()
    hooks = [layer.register_forward_hook(lambda m, a, out, i=i: counts.update({i: a[0].shape[1]}))
             for i, layer in enumerate(layerskip.model.layers)]
    try:
        result = eng.generate(prompt_of(10, seed=1), GenerationSettings(max_new_tokens=40))
    finally:
        for h in hooks:
            h.remove()
    s = result.stats
    assert 0 < s.accepted_tokens < s.draft_tokens
    # prefill of prompt[:-1], then one position per drafted token plus the committed one per step
    expected = 10 - 1 + s.draft_tokens + s.verify_steps
    assert [counts[i] for i in range(LAYERS)] == [expected] * LAYERS
    # the shared cache holds, in every layer, exactly the keys and values of the committed
    # tokens (all but the last) that one uncached pass of the full model computes
    prompt = prompt_of(10, seed=1)
    seq = torch.cat([prompt, torch.tensor([result.token_ids[:-1]])], dim=1)
    reference = DynamicCache(config=layerskip.config)
    with torch.no_grad():
        layerskip(input_ids=seq, cache=reference, use_cache=True)
    shared = eng.runner.cache
    for i in range(LAYERS):
        torch.testing.assert_close(shared.layers[i].keys[0, :, : seq.shape[1]], reference.layers[i].keys[0])
        torch.testing.assert_close(shared.layers[i].values[0, :, : seq.shape[1]], reference.layers[i].values[0])


@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
def test_other_architectures(arch):
    """Qwen2 splits like Llama (lossless); a model it cannot split is refused up front."""
    target = build(arch, layers=3, seed=2)
    prompt = prompt_of(7, seed=2)
    if arch == "gpt2":
        with pytest.raises(ValueError, match="early_exit"):
            engine(target, 1)
        return
    plain = SpeculativeEngine(target).generate(prompt, GenerationSettings(max_new_tokens=20)).token_ids
    result = engine(target, 1).generate(prompt, GenerationSettings(max_new_tokens=20))
    assert result.token_ids == plain
    check_stats(result, K)


@pytest.mark.parametrize("bad", [0, LAYERS, LAYERS + 3, -1, None, 1.5])
def test_layer_out_of_range_is_a_clear_error(layerskip, bad):
    with pytest.raises(ValueError, match="assistant_early_exit"):
        engine(layerskip, bad)


def test_early_exit_setting_belongs_to_early_exit(layerskip):
    with pytest.raises(ValueError, match="assistant_early_exit"):
        SpeculativeEngine(layerskip, SpeculationSettings(method="draft_model", assistant_early_exit=2),
                          drafter=layerskip)


@pytest.mark.slow
def test_sampling_follows_target_distribution():
    """The chi-square test of test_sampling.py, with the early exit as the drafter."""
    target = build("llama", vocab=ts.V, hidden=32, layers=3, seed=11, initializer_range=0.3)
    exact = ts.exact_two_token_distribution(target)
    assert len(exact) > 20
    eng = SpeculativeEngine(target, SpeculationSettings(method="early_exit", assistant_early_exit=1,
                                                        num_assistant_tokens=2))
    samples, drafted, accepted = ts.sample_first_two_tokens(eng)
    assert 50 < accepted < drafted - 50
    assert ts.chi_square_p_value(samples, exact) > 1e-3
