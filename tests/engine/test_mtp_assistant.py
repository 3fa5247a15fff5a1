"""Method ``mtp_assistant``: a Gemma 4 ``*-assistant`` checkpoint drafts from the target's
last hidden state and shared KV states.

The target is a tiny text-only ``Gemma4ForConditionalGeneration`` (the class of
``google/gemma-4-E4B-it``; no vision or audio tower) with per-layer embeddings, KV-shared
layers and a 6-token sliding window, so rows run well past the window.  Both checkpoints
are written with ``save_pretrained`` and loaded with ``from_pretrained``.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    Gemma4AssistantConfig,
    Gemma4AssistantForCausalLM,
    Gemma4Config,
    Gemma4ForConditionalGeneration,
    Gemma4TextConfig,
)

from pipeline.engine import GenerationSettings, SpeculationSettings, SpeculativeEngine
from pipeline.engine.proposers.base import DraftRequest
from pipeline.engine.proposers.mtp_assistant import MTPAssistantProposer
from pipeline.engine.runner import ModelRunner, prefill
from pipeline.engine.sampling import LogitsShaper

from tiny_models import build, check_stats

VOCAB = 96
COMMON = dict(
    num_attention_heads=2, num_key_value_heads=1, head_dim=8, global_head_dim=16, sliding_window=6,
    max_position_embeddings=256, bos_token_id=None, eos_token_id=None, initializer_range=0.2,
)


def write_gemma4_pair(root, seed=0, backbone=32, vocab=VOCAB, layers=4):
    """A Gemma 4 target (``layers`` layers, the second half KV-shared) and its assistant,
    saved as checkpoints; returns their dirs."""
    text = Gemma4TextConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        layer_types=["sliding_attention", "full_attention"] * (layers // 2),
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=vocab, num_kv_shared_layers=layers // 2 if layers > 2 else 0,
        vocab_size=vocab, pad_token_id=0, **COMMON,
    )
    assistant_text = Gemma4TextConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
        hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, vocab_size=vocab, pad_token_id=None, **COMMON,
    )
    torch.manual_seed(seed)
    target_dir, assistant_dir = root / "gemma-4-tiny", root / "gemma-4-tiny-assistant"
    Gemma4ForConditionalGeneration(Gemma4Config(text_config=text, vision_config=None, audio_config=None)).save_pretrained(target_dir)
    assistant = Gemma4AssistantForCausalLM(
        Gemma4AssistantConfig(text_config=assistant_text, backbone_hidden_size=backbone, use_ordered_embeddings=False)
    )
    # as in the released assistants' generation_config: a fixed draft length (transformers reads it there)
    assistant.generation_config.num_assistant_tokens = 3
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    assistant.save_pretrained(assistant_dir)
    return target_dir, assistant_dir


@pytest.fixture(scope="module")
def gemma_pair(tmp_path_factory):
    target_dir, assistant_dir = write_gemma4_pair(tmp_path_factory.mktemp("gemma4"))
    target = Gemma4ForConditionalGeneration.from_pretrained(target_dir, dtype=torch.float64).eval()
    assistant = Gemma4AssistantForCausalLM.from_pretrained(assistant_dir, dtype=torch.float64).eval()
    return target, assistant


def _prompt(length, seed):
    return torch.randint(1, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def test_greedy_equals_plain_and_generate_with_assistant(gemma_pair):
    target, assistant = gemma_pair
    engine = SpeculativeEngine(target, SpeculationSettings(method="mtp_assistant", num_assistant_tokens=3), drafter=assistant)
    plain = SpeculativeEngine(target)
    for length, seed in [(9, 1), (1, 2), (3, 3)]:  # the window is 6 tokens: every row runs past it
        prompt = _prompt(length, seed)
        result = engine.generate(prompt, GenerationSettings(max_new_tokens=24))
        assert result.token_ids == plain.generate(prompt, GenerationSettings(max_new_tokens=24)).token_ids
        reference = target.generate(prompt, max_new_tokens=24, do_sample=False, assistant_model=assistant)
        assert result.token_ids == reference[0, length:].tolist()
        check_stats(result, k=3)
        s = result.stats
        assert s.new_tokens == 24 and s.finish_reason == "length"
        assert s.drafted_per_position[0] >= s.verify_steps - 1 - (length == 1)


def _draft_from_scratch(target, assistant, seq, k):
    """The assistant's greedy draft recomputed without any state: one uncached target pass
    over the committed tokens but the last, then the assistant loop."""
    out = target(input_ids=seq[:, :-1], output_hidden_states=-1, return_shared_kv_states=True)
    hidden = out.hidden_states[-1][:, -1:]
    kv = dict(out.shared_kv_states)
    token, pos = seq[:, -1:], torch.tensor([[seq.shape[1] - 1]])
    tokens, probs = [], []
    for _ in range(k):
        embeds = torch.cat([target.get_input_embeddings()(token), hidden], dim=-1)
        o = assistant(inputs_embeds=embeds, position_ids=pos, shared_kv_states=kv, use_cache=False)
        hidden, logits = o.last_hidden_state, o.logits[:, -1]
        token = logits.argmax(-1, keepdim=True)
        tokens.append(int(token))
        probs.append(torch.softmax(logits, -1))
    return tokens, torch.cat(probs)


def test_incremental_state_equals_recomputation(gemma_pair):
    """Through every accepted count and past the sliding window, for three rows drafting
    together (ragged lengths, each its own acceptances), each row's draft (and its
    distribution) equals one recomputed from scratch on that row alone: the kept hidden
    state and the shared KV read up to the committed length are exactly the committed
    ones, and the padding of the batch changes nothing."""
    target, assistant = gemma_pair
    proposer = MTPAssistantProposer(target, assistant)
    runner = ModelRunner(target, 3)
    proposer.bind(3, runner)
    seqs = [_prompt(4, 7), _prompt(1, 8), _prompt(9, 9)]
    slots = [0, 1, 2]
    shaper = LogitsShaper(GenerationSettings())
    gen = torch.Generator().manual_seed(0)
    pattern = [0, 3, 1, 2, 0, 3, 3, 1, 0, 2, 1, 0]
    with torch.inference_mode():
        proposer.admit(slots, seqs)
        prefill(lambda *a, **kw: proposer.target_forward(runner, *a, **kw), slots, seqs)
        for step in range(12):
            drafts = proposer.propose([DraftRequest(s, seq, 3, shaper, None, True) for s, seq in zip(slots, seqs)])
            tokens, starts = [], []
            for row, (seq, draft) in enumerate(zip(seqs, drafts)):
                if seq.shape[1] == 1:
                    assert len(draft) == 0  # no target pass yet: nothing to draft from
                else:
                    ref, probs = _draft_from_scratch(target, assistant, seq, 3)
                    assert draft.tokens.tolist() == ref, (step, row)
                    torch.testing.assert_close(draft.probs, probs)
                tokens.append(torch.cat([seq[0, -1:], draft.tokens]))
                starts.append(seq.shape[1] - 1)
            proposer.target_forward(runner, slots, tokens, starts, 4)
            for row, (seq, draft) in enumerate(zip(seqs, drafts)):
                a = min(pattern[(step + 2 * row) % 12], len(draft))
                proposer.rollback(slots[row], seq.shape[1] + a)
                bonus = torch.randint(1, VOCAB, (1, 1), generator=gen)
                seqs[row] = torch.cat([seq, draft.tokens[:a].view(1, -1), bonus], dim=1)
    assert min(seq.shape[1] for seq in seqs) > 3 * COMMON["sliding_window"]


def test_sampling_is_reproducible_and_stats_filled(gemma_pair):
    target, assistant = gemma_pair
    engine = SpeculativeEngine(target, SpeculationSettings(method="mtp_assistant", num_assistant_tokens=2), drafter=assistant)
    settings = dict(do_sample=True, temperature=0.8, top_k=20, max_new_tokens=16)
    runs = [engine.generate(_prompt(5, 1), GenerationSettings(seed=s, **settings)) for s in (3, 3, 4)]
    assert runs[0].token_ids == runs[1].token_ids != runs[2].token_ids
    for r in runs:
        check_stats(r, k=2)
        assert r.stats.draft_tokens > 0


def test_bad_drafters_are_clear_errors(gemma_pair, tmp_path):
    target, assistant = gemma_pair
    with pytest.raises(ValueError, match="needs the Gemma 4 assistant"):
        SpeculativeEngine(target, SpeculationSettings(method="mtp_assistant"))
    with pytest.raises(ValueError, match="Gemma 4 assistant"):
        SpeculativeEngine(target, SpeculationSettings(method="mtp_assistant"), drafter=build("llama", vocab=VOCAB))
    with pytest.raises(ValueError, match="shared KV states"):
        SpeculativeEngine(build("llama", vocab=VOCAB), SpeculationSettings(method="mtp_assistant"), drafter=assistant)
    _, other_dir = write_gemma4_pair(tmp_path, backbone=48)
    other = Gemma4AssistantForCausalLM.from_pretrained(other_dir, dtype=torch.float64)
    with pytest.raises(ValueError, match="backbone_hidden_size"):
        SpeculativeEngine(target, SpeculationSettings(method="mtp_assistant"), drafter=other)


@pytest.mark.slow
def test_sampling_follows_target_distribution(tmp_path):
    """Chi-square test of the first two tokens (one verification of a two-token draft)
    against the exact target distribution, as in test_sampling."""
    from test_sampling import V, chi_square_p_value, exact_two_token_distribution, sample_first_two_tokens

    target_dir, assistant_dir = write_gemma4_pair(tmp_path, seed=11, vocab=V, layers=2)  # 2 layers: cheaper
    target = Gemma4ForConditionalGeneration.from_pretrained(target_dir, dtype=torch.float64).eval()
    assistant = Gemma4AssistantForCausalLM.from_pretrained(assistant_dir, dtype=torch.float64).eval()
    exact = exact_two_token_distribution(target)
    assert len(exact) > 20
    engine = SpeculativeEngine(target, SpeculationSettings(method="mtp_assistant", num_assistant_tokens=2), drafter=assistant)
    samples, drafted, accepted = sample_first_two_tokens(engine)
    assert 50 < accepted < drafted - 50  # acceptance and rejection paths both ran
    assert chi_square_p_value(samples, exact) > 1e-3


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_batched_rows_equal_plain(gemma_pair, batch):
    """The assistant drafts for every row at once from each row's own committed KV
    (left-padded with a padding mask): each row equals its single-row plain output,
    rows running past the 6-token window."""
    target, assistant = gemma_pair
    plain = SpeculativeEngine(target, max_batch_size=1)
    engine = SpeculativeEngine(target, SpeculationSettings(method="mtp_assistant", num_assistant_tokens=3),
                               drafter=assistant, max_batch_size=batch, draft_length="fixed")
    prompts = [_prompt(n, seed) for seed, n in enumerate((9, 1, 3, 20, 2, 7, 14, 5, 1))]
    settings = [GenerationSettings(max_new_tokens=[24, 1, 2][i % 3]) for i in range(len(prompts))]
    expected = [plain.generate(p, s).token_ids for p, s in zip(prompts, settings)]
    results = engine.generate_batch(prompts, settings)
    assert [r.token_ids for r in results] == expected
    assert sum(r.stats.draft_tokens for r in results) > 0
