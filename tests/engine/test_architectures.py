"""Architectures the engine runs exactly, and those it refuses (issue "Engine correctness,
round two", items 1-4).

- Sliding-window attention, all layers (Mistral) or mixed with full layers (Qwen2 with
  ``use_sliding_window``, Gemma 2 and Gemma 3 layouts), as target and as drafter, with
  prompts longer than the window: every method equals plain greedy and ``generate()``.
- Position-dependent RoPE: a Phi-3 LongRoPE target whose verification passes would
  straddle the switch at ``original_max_position_embeddings`` (k = 1 .. 8, and rows on
  both sides of it in one batch); a YaRN target past its original length, whose context
  comes from the scaling; the ``context`` finish reason.
- A drafter whose context is shorter than the target's: drafting stops where it ends.
- Recurrent, linear-attention and hybrid layers, and ``dynamic`` RoPE: refused when the
  engine is built, naming the layer type and the method.

All models are tiny, random and float64.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from pipeline.engine import GenerationSettings, SpeculationSettings, SpeculativeEngine

from coverage import REFUSED, SLIDING_ARCHS, SLIDING_METHODS
from tiny_models import NO_SPECIAL, VOCAB, check_stats, perturbed_copy, prompt_of

SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, **NO_SPECIAL)
K = 3


def _make(cls, config, seed=0):
    torch.manual_seed(seed)
    return cls(config).double().eval()


SLIDING = {
    # every layer slides over 4 positions
    "mistral": lambda: _make(MistralForCausalLM, MistralConfig(num_hidden_layers=3, sliding_window=4, **SMALL)),
    # two full layers, then two sliding ones
    "qwen2_mixed": lambda: _make(Qwen2ForCausalLM, Qwen2Config(num_hidden_layers=4, use_sliding_window=True,
                                                              sliding_window=5, max_window_layers=2, **SMALL)),
    # sliding and global layers alternating; eager attention, logit soft-capping
    "gemma2": lambda: _make(Gemma2ForCausalLM, Gemma2Config(num_hidden_layers=4, sliding_window=5, head_dim=8, **SMALL)),
    # five sliding layers to one global, two RoPE bases, scaled embeddings
    "gemma3": lambda: _make(Gemma3ForCausalLM, Gemma3TextConfig(num_hidden_layers=6, sliding_window=5, head_dim=8, **SMALL)),
}


def hf_generate(model, prompt, max_new_tokens, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False, **kw)
    return out[0, prompt.shape[1]:].tolist()


def engines(target, drafter, k=K):
    yield "plain", SpeculativeEngine(target)
    yield "draft_model", SpeculativeEngine(target, SpeculationSettings(method="draft_model", num_assistant_tokens=k),
                                           drafter=drafter)
    yield "prompt_lookup", SpeculativeEngine(target, SpeculationSettings(method="prompt_lookup",
                                                                         prompt_lookup_num_tokens=k))
    yield "early_exit", SpeculativeEngine(target, SpeculationSettings(method="early_exit", assistant_early_exit=2,
                                                                      num_assistant_tokens=k))


assert sorted(SLIDING) == SLIDING_ARCHS


@pytest.fixture(scope="module", params=SLIDING_ARCHS)
def sliding_pair(request):
    target = SLIDING[request.param]()
    return request.param, target, perturbed_copy(target, 0.3)  # the drafter has the same sliding layers


def test_sliding_window_layers_are_read(sliding_pair):
    """The fixtures really slide: a target whose window covered the whole prompt would
    predict differently."""
    name, target, _ = sliding_pair
    types = getattr(target.config, "layer_types", None) or ["sliding_attention"] * target.config.num_hidden_layers
    assert "sliding_attention" in types, name
    prompt = prompt_of(20, seed=1)
    wide = copy.deepcopy(target)
    wide.config.sliding_window = 1000
    with torch.no_grad():
        assert not torch.allclose(target(prompt).logits, wide(prompt).logits)


@pytest.mark.parametrize("prompt_len", [1, 7, 23])
def test_sliding_window_targets_and_drafters_are_lossless(sliding_pair, prompt_len):
    """Prompts shorter and longer than the window, rows running far past it, rejected
    drafts (a noisy drafter with the same sliding layers), early exit on the target's
    own sliding layers: every method equals plain greedy and generate()."""
    name, target, drafter = sliding_pair
    prompt = prompt_of(prompt_len, seed=prompt_len)
    reference = hf_generate(target, prompt, 30)
    drafted = accepted = 0
    assert [m for m, _ in engines(target, drafter)] == SLIDING_METHODS
    for method, engine in engines(target, drafter):
        result = engine.generate(prompt, GenerationSettings(max_new_tokens=30))
        assert result.token_ids == reference, (name, method)
        check_stats(result, K)
        if method in ("draft_model", "early_exit"):
            drafted += result.stats.draft_tokens
            accepted += result.stats.accepted_tokens
    assert 0 < accepted < drafted  # rollback after rejections happened


def test_sliding_window_drafter_for_a_full_attention_target():
    """The issue's crash: a full-attention target with a sliding-window drafter."""
    target = _make(LlamaForCausalLM, LlamaConfig(num_hidden_layers=2, **SMALL))
    drafter = _make(MistralForCausalLM, MistralConfig(num_hidden_layers=2, sliding_window=4, **SMALL), seed=3)
    engine = SpeculativeEngine(target, SpeculationSettings(method="draft_model", num_assistant_tokens=4), drafter=drafter)
    for n in (3, 12):
        prompt = prompt_of(n, seed=n)
        assert engine.generate(prompt, GenerationSettings(max_new_tokens=25)).token_ids == hf_generate(target, prompt, 25)


# ---------------------------------------------------------------------------- RoPE
def _phi3_longrope(seed=0):
    head_dim = 8
    config = Phi3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, original_max_position_embeddings=16,
        rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.3 * i for i in range(head_dim // 2)],
                      "long_factor": [2.0 + 1.5 * i for i in range(head_dim // 2)]},
        **NO_SPECIAL,
    )
    return _make(Phi3ForCausalLM, config, seed)


def _uncached_greedy(model, prompt, n):
    """Greedy decoding that recomputes the whole sequence every token: the model as a
    function of its prefix, which is what generate() reproduces for LongRoPE."""
    seq = prompt.clone()
    out = []
    with torch.no_grad():
        for _ in range(n):
            token = int(model(seq).logits[0, -1].argmax())
            out.append(token)
            seq = torch.cat([seq, torch.tensor([[token]])], dim=1)
    return out


@pytest.fixture(scope="module")
def longrope():
    model = _phi3_longrope()
    prompt = prompt_of(12, seed=3)
    return model, prompt, _uncached_greedy(model, prompt, 20)


def test_longrope_plain_decoding_matches_generate_across_the_switch(longrope):
    model, prompt, reference = longrope
    assert hf_generate(model, prompt, 20) == reference
    assert SpeculativeEngine(model).generate(prompt, GenerationSettings(max_new_tokens=20)).token_ids == reference


@pytest.mark.parametrize("k", range(1, 9))
def test_longrope_speculation_is_lossless_across_the_switch(longrope, k):
    """An oracle drafter (the target itself) would draft past the switch at position 16;
    the verification pass must not straddle it, and the row's cache is recomputed under
    the long factors when it crosses, as generate() does."""
    model, prompt, reference = longrope
    oracle = copy.deepcopy(model)
    for spec, drafter in [(SpeculationSettings(method="draft_model", num_assistant_tokens=k), oracle),
                          (SpeculationSettings(method="prompt_lookup", prompt_lookup_num_tokens=k), None)]:
        result = SpeculativeEngine(model, spec, drafter=drafter).generate(prompt, GenerationSettings(max_new_tokens=20))
        assert result.token_ids == reference, (spec.method, k)
        check_stats(result, k)
    assert result.token_ids  # prompt lookup ran too


def test_longrope_rows_on_both_sides_of_the_switch_in_one_batch(longrope):
    """Rows below, at and past the switch share batches; one row's length never changes
    another row's RoPE factors."""
    model, _, _ = longrope
    prompts = [prompt_of(n, seed=n) for n in (3, 12, 15, 16, 17, 30)]
    references = [_uncached_greedy(model, p, 20) for p in prompts]
    engine = SpeculativeEngine(model, SpeculationSettings(method="draft_model", num_assistant_tokens=4),
                               drafter=copy.deepcopy(model))
    results = engine.generate_batch(prompts, GenerationSettings(max_new_tokens=20), max_batch_size=4)
    assert [r.token_ids for r in results] == references


def _yarn(seed=1):
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
                         **NO_SPECIAL)
    return _make(LlamaForCausalLM, config, seed)


def test_yarn_context_comes_from_the_scaling():
    """Factor 4 over 32 original positions: 128 positions, not the raw 32."""
    model = _yarn()
    engine = SpeculativeEngine(model, SpeculationSettings(method="prompt_lookup", prompt_lookup_num_tokens=3))
    assert engine.context == 128
    for n in (28, 40):  # a budget that crosses 32, a prompt that starts past it
        prompt = prompt_of(n, seed=5)
        result = engine.generate(prompt, GenerationSettings(max_new_tokens=20))
        assert result.token_ids == hf_generate(model, prompt, 20)
        assert result.finish_reason == "length" and result.stats.new_tokens == 20
    near_end = engine.generate(prompt_of(120, seed=5), GenerationSettings(max_new_tokens=20))
    assert near_end.finish_reason == "context" and near_end.stats.new_tokens == 8


# ---------------------------------------------------------------------------- drafter context
def test_drafter_with_a_shorter_context_stops_drafting_where_it_ends():
    """A GPT-2 drafter with 32 learned positions drafts for a target with 256: past
    position 32 every step is a plain target step, and the row is not lost."""
    target = _make(LlamaForCausalLM, LlamaConfig(num_hidden_layers=2, **SMALL))
    drafter = _make(GPT2LMHeadModel, GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                                **NO_SPECIAL), seed=4)
    engine = SpeculativeEngine(target, SpeculationSettings(method="draft_model", num_assistant_tokens=4), drafter=drafter)
    for n in (10, 31, 40):
        prompt = prompt_of(n, seed=n)
        result = engine.generate(prompt, GenerationSettings(max_new_tokens=40))
        assert result.token_ids == hf_generate(target, prompt, 40)
        check_stats(result, 4)
        assert (result.stats.draft_tokens > 0) == (n < 32)  # it drafts while the row fits it
    positions = []
    hook = drafter.transformer.wpe.register_forward_hook(lambda m, args, out: positions.append(int(args[0].max())))
    try:
        engine.generate(prompt_of(20, seed=2), GenerationSettings(max_new_tokens=40))
    finally:
        hook.remove()
    assert positions and max(positions) == 31  # it ran up to its last position, never past it


# ---------------------------------------------------------------------------- refusals
def _refused_models():
    from transformers import (
        JambaConfig, JambaForCausalLM, Lfm2Config, Lfm2ForCausalLM, MambaConfig, MambaForCausalLM,
        Qwen3NextConfig, Qwen3NextForCausalLM,
    )

    return {
        "lfm2 (conv)": (lambda: _make(Lfm2ForCausalLM, Lfm2Config(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, layer_types=["conv", "full_attention"], **NO_SPECIAL)), "conv"),
        "qwen3_next (linear attention)": (lambda: _make(Qwen3NextForCausalLM, Qwen3NextConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=2,
            linear_key_head_dim=8, linear_value_head_dim=8, num_experts=2, num_experts_per_tok=1,
            layer_types=["linear_attention", "full_attention"], **NO_SPECIAL)), "linear_attention"),
        "mamba": (lambda: _make(MambaForCausalLM, MambaConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=4, **NO_SPECIAL)), "linear_attention"),
        "jamba (hybrid)": (lambda: _make(JambaForCausalLM, JambaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_experts=2, num_experts_per_tok=1, attn_layer_period=2, attn_layer_offset=1,
            expert_layer_period=2, expert_layer_offset=1, mamba_d_state=4, mamba_dt_rank=4, **NO_SPECIAL)),
            "linear_attention"),
    }


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_recurrent_layers_are_refused_naming_the_layer_type_and_method(name):
    build_model, kind = _refused_models()[name]
    assert kind == REFUSED[name]
    model = build_model()
    ordinary = _make(LlamaForCausalLM, LlamaConfig(num_hidden_layers=2, **SMALL))
    with pytest.raises(ValueError, match=f"(?s){kind}.*'draft_model'"):
        SpeculativeEngine(ordinary, SpeculationSettings(method="draft_model"), drafter=model)
    with pytest.raises(ValueError, match=f"(?s){kind}.*'prompt_lookup'"):
        SpeculativeEngine(model, SpeculationSettings(method="prompt_lookup"))


def test_dynamic_rope_is_refused():
    config = LlamaConfig(num_hidden_layers=2, rope_scaling={"rope_type": "dynamic", "factor": 2.0}, **SMALL)
    with pytest.raises(ValueError, match="dynamic"):
        SpeculativeEngine(_make(LlamaForCausalLM, config), SpeculationSettings(method="prompt_lookup"))


def test_early_exit_refuses_a_target_it_cannot_split():
    """GPT-2 adds learned position embeddings to its input: its layers cannot run in two
    parts from hidden states, and the probe says so when the engine is built."""
    gpt2 = _make(GPT2LMHeadModel, GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=3, n_head=4, **NO_SPECIAL))
    with pytest.raises(ValueError, match="early_exit"):
        SpeculativeEngine(gpt2, SpeculationSettings(method="early_exit", assistant_early_exit=1))
