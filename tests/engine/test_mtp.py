"""Method ``mtp``: the MTP layers of DeepSeek-V3 / GLM-4.5 checkpoints draft.

Checkpoints are tiny random models written in the released layout (mtp_models.py) and
loaded through the real paths: ``from_pretrained`` and transformers' MTP loader.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers.cache_utils import MtpCache

from pipeline.engine import GenerationSettings, SpeculationSettings, SpeculativeEngine
from pipeline.engine.proposers.base import DraftRequest
from pipeline.engine.proposers.mtp import MTPProposer, load_mtp
from pipeline.engine.runner import ModelRunner, prefill
from pipeline.engine.sampling import LogitsShaper

from mtp_models import load_target, write_mtp_checkpoint
from test_sampling import V, chi_square_p_value, exact_two_token_distribution, sample_first_two_tokens
from tiny_models import check_stats

VOCAB = 96


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(arch, MTP layers) -> checkpoint dir."""
    out = {}
    for arch, num_mtp in [("deepseek_v3", 1), ("deepseek_v3", 2), ("glm4_moe", 1), ("glm4_moe", 2)]:
        out[arch, num_mtp] = write_mtp_checkpoint(
            tmp_path_factory.mktemp(f"{arch}-{num_mtp}"), arch, vocab=VOCAB, num_mtp=num_mtp, initializer_range=0.2
        )
    return out


@pytest.fixture(scope="module")
def loaded(checkpoints):
    cache = {}

    def get(arch, num_mtp):
        if (arch, num_mtp) not in cache:
            target = load_target(checkpoints[arch, num_mtp])
            cache[arch, num_mtp] = target, load_mtp(target)
        return cache[arch, num_mtp]

    return get


def _prompt(length, seed):
    return torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch,num_mtp", [("deepseek_v3", 1), ("deepseek_v3", 2), ("glm4_moe", 1), ("glm4_moe", 2)])
def test_greedy_equals_plain_and_generate_use_mtp(loaded, arch, num_mtp):
    target, mtp = loaded(arch, num_mtp)
    engine = SpeculativeEngine(target, SpeculationSettings(method="mtp"), drafter=mtp)
    plain = SpeculativeEngine(target)
    for length, seed in [(9, 1), (1, 2), (4, 3)]:
        prompt = _prompt(length, seed)
        result = engine.generate(prompt, GenerationSettings(max_new_tokens=24))
        assert result.token_ids == plain.generate(prompt, GenerationSettings(max_new_tokens=24)).token_ids
        if length > 1 or num_mtp == 1:
            # transformers 5.24's generate(use_mtp=True) raises with two or more MTP layers
            # on a one-token prompt (a size mismatch in MtpLayer); our engine handles it
            reference = target.generate(prompt, max_new_tokens=24, do_sample=False, use_mtp=True)
            assert result.token_ids == reference[0, length:].tolist()
        check_stats(result, k=num_mtp)
        s = result.stats
        assert s.finish_reason == "length" and s.new_tokens == 24
        assert len(s.drafted_per_position) == num_mtp  # each step drafts one token per MTP layer
        # every step drafts (but the first of a one-token prompt, which has no hidden state yet)
        assert s.drafted_per_position[0] >= s.verify_steps - 1 - (length == 1)


def test_engine_loads_mtp_from_the_checkpoint(checkpoints):
    """No drafter given: the engine loads the MTP layers itself, through transformers' loader."""
    target = load_target(checkpoints["deepseek_v3", 2])
    engine = SpeculativeEngine(target, SpeculationSettings(method="mtp", num_mtp_layers=1))
    assert type(engine.proposer.mtp).__name__ == "MtpModel" and engine.proposer.num_layers == 1
    prompt = _prompt(7, 5)
    result = engine.generate(prompt, GenerationSettings(max_new_tokens=16))
    assert result.token_ids == SpeculativeEngine(target).generate(prompt, GenerationSettings(max_new_tokens=16)).token_ids
    check_stats(result, k=1)
    assert result.stats.drafted_per_position == [result.stats.verify_steps - 1]


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_incremental_drafts_equal_transformers_mtp_from_scratch(loaded, arch):
    """Drive the proposer through many verify/rollback patterns (every accepted count),
    for three rows drafting together (ragged lengths, different acceptances), and compare
    each row's draft and its distribution with transformers' own ``MtpModel`` forward
    recomputed from scratch on that row's committed sequence."""
    target, mtp = loaded(arch, 2)
    proposer = MTPProposer(target, mtp)
    runner = ModelRunner(target, 3)
    proposer.bind(3, runner)
    rng = random.Random(0)
    seqs = [_prompt(6, 7), _prompt(2, 8), _prompt(11, 9)]
    slots = [0, 1, 2]
    shaper = LogitsShaper(GenerationSettings())
    with torch.inference_mode():
        proposer.admit(slots, seqs)
        prefill(lambda *a, **kw: proposer.target_forward(runner, *a, **kw), slots, seqs)
        for step in range(14):
            drafts = proposer.propose([DraftRequest(s, seq, 2, shaper, None, True) for s, seq in zip(slots, seqs)])
            tokens, starts = [], []
            for row, (seq, draft) in enumerate(zip(seqs, drafts)):
                L = seq.shape[1]
                hidden = target(seq[:, :-1], output_hidden_states=-1).hidden_states[-1]
                ref_tokens, ref_logits, _ = mtp(
                    input_ids=seq[:, 1:], last_hidden_states=hidden, attention_mask=None,
                    position_ids=torch.arange(1, L).view(1, -1), mtp_cache=MtpCache(config=mtp.config),
                )
                assert draft.tokens.tolist() == ref_tokens[0].tolist(), (step, row)
                torch.testing.assert_close(draft.probs, torch.softmax(ref_logits[0], -1))
                tokens.append(torch.cat([seq[0, -1:], draft.tokens]))
                starts.append(L - 1)
            # one verification pass for all rows; each keeps `a` draft tokens, then adds one of its own
            proposer.target_forward(runner, slots, tokens, starts, 3)
            for row, (seq, draft) in enumerate(zip(seqs, drafts)):
                a = [0, 1, 2, 0, 2, 1, 1, 0, 2, 2, 0, 0, 1, 2][(step + row) % 14]
                proposer.rollback(slots[row], seq.shape[1] + a)
                bonus = torch.tensor([[rng.randrange(VOCAB)]])
                seqs[row] = torch.cat([seq, draft.tokens[:a].view(1, -1), bonus], dim=1)


@pytest.mark.slow
def test_sampling_follows_target_distribution(tmp_path):
    """Chi-square test of the first two tokens (both from one verification of a
    two-token MTP draft) against the exact target distribution, as in test_sampling."""
    path = write_mtp_checkpoint(
        tmp_path / "v16", "deepseek_v3", vocab=V, layers=1, num_mtp=2, seed=11, initializer_range=0.3,
        n_routed_experts=2, num_experts_per_tok=1,
    )
    target = load_target(path)
    exact = exact_two_token_distribution(target)
    assert len(exact) > 20
    engine = SpeculativeEngine(target, SpeculationSettings(method="mtp", num_assistant_tokens=2))
    samples, drafted, accepted = sample_first_two_tokens(engine)
    assert 50 < accepted < drafted - 50  # acceptance and rejection paths both ran
    assert chi_square_p_value(samples, exact) > 1e-3


def test_checkpoint_without_mtp_weights_is_a_clear_error(tmp_path):
    path = write_mtp_checkpoint(tmp_path / "plain", "deepseek_v3", vocab=VOCAB, with_mtp=False)
    target = load_target(path)
    assert target.config.num_mtp_layers == 1  # the config still declares one
    with pytest.raises(ValueError, match="no MTP weights"):
        SpeculativeEngine(target, SpeculationSettings(method="mtp"))


def test_config_without_mtp_layers_is_a_clear_error(loaded):
    target, _ = loaded("glm4_moe", 1)
    target.config.num_mtp_layers = 0
    try:
        with pytest.raises(ValueError, match="num_mtp_layers"):
            SpeculativeEngine(target, SpeculationSettings(method="mtp"))
    finally:
        target.config.num_mtp_layers = 1


def test_num_mtp_layers_setting(loaded):
    target, mtp = loaded("glm4_moe", 2)
    with pytest.raises(ValueError, match="num_mtp_layers=3"):
        SpeculativeEngine(target, SpeculationSettings(method="mtp", num_mtp_layers=3), drafter=mtp)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="num_mtp_layers"):
            SpeculationSettings(method="mtp", num_mtp_layers=bad).validate()
    with pytest.raises(ValueError, match="num_mtp_layers is a setting of method 'mtp'"):
        SpeculationSettings(method="draft_model", num_mtp_layers=1).validate()


def test_target_split_with_device_map(checkpoints):
    """The target dispatched over a device map (accelerate hooks; one layer offloaded to
    disk, so its weights live on "meta" between calls): the MTP layers go to the last
    layer's execution device and decoding is unchanged."""
    path = checkpoints["deepseek_v3", 1]
    reference = load_target(path)
    device_map = {
        "model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
        "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu",
    }
    target = load_target(path, device_map=device_map, offload_folder=str(path) + "-offload")
    assert set(target.hf_device_map.values()) == {"cpu", "disk"}
    engine = SpeculativeEngine(target, SpeculationSettings(method="mtp"))
    assert engine.proposer.device == torch.device("cpu")
    prompt = _prompt(8, 9)
    result = engine.generate(prompt, GenerationSettings(max_new_tokens=12))
    expected = SpeculativeEngine(reference).generate(prompt, GenerationSettings(max_new_tokens=12)).token_ids
    assert result.token_ids == expected
    check_stats(result, k=1)
    assert result.stats.draft_tokens >= result.stats.verify_steps - 1


def test_mtp_takes_no_separate_drafter(loaded):
    from tiny_models import build

    target, _ = loaded("deepseek_v3", 1)
    with pytest.raises(ValueError, match="drafter= must be None"):
        SpeculativeEngine(target, SpeculationSettings(method="mtp"), drafter=build("llama", vocab=VOCAB))


def test_example_job_configs():
    """configs/examples for the real checkpoints validate; mtp loads no drafter (its layers
    are in the target's checkpoint), mtp_assistant requires one."""
    from pathlib import Path

    from pipeline.config import ConfigError, load_config

    root = Path(__file__).resolve().parents[2] / "configs" / "examples"
    for name, target in [("glm-4.5-air-mtp", "zai-org/GLM-4.5-Air"), ("deepseek-v3-mtp", "deepseek-ai/DeepSeek-V3")]:
        cfg = load_config(root / f"{name}.yaml")
        assert cfg.method.speculation_settings().method == "mtp" and not cfg.uses_drafter
        assert cfg.models.target == target and cfg.models.device_map == "auto"
    cfg = load_config(root / "gemma-4-e4b-it-assistant.yaml")
    assert cfg.method.speculation_settings().method == "mtp_assistant" and cfg.uses_drafter
    assert cfg.models.drafter == "google/gemma-4-E4B-it-assistant"
    with pytest.raises(ConfigError, match="drafter"):
        load_config(root / "gemma-4-e4b-it-assistant.yaml", ["models.drafter=null"])
    with pytest.raises(ConfigError, match="num_mtp_layers"):
        load_config(root / "deepseek-v3-mtp.yaml", ["method.num_mtp_layers=0"])


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_batched_rows_equal_plain(loaded, arch, batch):
    """MTP layers draft for every row at once (ragged catch-up per layer): each row equals
    its single-row plain greedy output, with budgets of 1, 2 and 24 tokens."""
    target, mtp = loaded(arch, 2)
    plain = SpeculativeEngine(target, max_batch_size=1)
    engine = SpeculativeEngine(target, SpeculationSettings(method="mtp"), drafter=mtp, max_batch_size=batch)
    prompts = [_prompt(n, seed) for seed, n in enumerate((9, 1, 4, 30, 2, 17, 6, 11, 3))]
    settings = [GenerationSettings(max_new_tokens=[24, 1, 2][i % 3]) for i in range(len(prompts))]
    expected = [plain.generate(p, s).token_ids for p, s in zip(prompts, settings)]
    results = engine.generate_batch(prompts, settings)
    assert [r.token_ids for r in results] == expected
    for r in results:
        check_stats(r, k=2)
