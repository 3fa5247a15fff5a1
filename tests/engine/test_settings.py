"""Bad settings are refused with a ValueError naming the setting, before any decoding."""

from __future__ import annotations

import math

import pytest

from pipeline.engine import GenerationSettings, SpeculationSettings, SpeculativeEngine

from tiny_models import bracket_tokenizer, build


class ForwardCounter:
    """Wraps a model's forward to prove no decoding happened."""

    def __init__(self, model):
        self.calls = 0
        self.model = model
        self.original = model.forward

        def counting(*args, **kwargs):
            self.calls += 1
            return self.original(*args, **kwargs)

        model.forward = counting

    def restore(self):
        self.model.forward = self.original


@pytest.mark.parametrize(
    "spec, name",
    [
        (dict(method="draft_model", num_assistant_tokens=0), "num_assistant_tokens"),
        (dict(method="draft_model", num_assistant_tokens=-2), "num_assistant_tokens"),
        (dict(method="beam_search"), "method"),
        (dict(method="prompt_lookup", prompt_lookup_num_tokens=0), "prompt_lookup_num_tokens"),
        (dict(method="prompt_lookup", max_matching_ngram_size=0), "max_matching_ngram_size"),
        (dict(method="draft_model", num_assistant_tokens_schedule="sometimes"), "num_assistant_tokens_schedule"),
        (dict(method="draft_model", assistant_confidence_threshold=1.5), "assistant_confidence_threshold"),
        (dict(method="prompt_lookup", assistant_ensemble_weight=0.7), "assistant_ensemble_weight"),
        (dict(method="draft_model", assistant_ensemble_weight=1.0), "assistant_ensemble_weight"),
    ],
)
def test_bad_speculation_settings(llama_pair, spec, name):
    target, drafter = llama_pair
    with pytest.raises(ValueError, match=name):
        SpeculativeEngine(target, SpeculationSettings(**spec), drafter=drafter)


@pytest.mark.parametrize(
    "gen, name",
    [
        (dict(do_sample=True, temperature=0.0), "temperature"),
        (dict(do_sample=True, temperature=-1.0), "temperature"),
        (dict(do_sample=True, temperature=math.nan), "temperature"),
        (dict(do_sample=True, top_p=0.0), "top_p"),
        (dict(do_sample=True, top_p=1.2), "top_p"),
        (dict(do_sample=True, top_p=math.nan), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(do_sample=True, min_p=1.5), "min_p"),
        (dict(do_sample=True, min_p=-0.1), "min_p"),
        (dict(no_repeat_ngram_size=-1), "no_repeat_ngram_size"),
        (dict(no_repeat_ngram_size=2.5), "no_repeat_ngram_size"),
        (dict(min_new_tokens=-3), "min_new_tokens"),
        (dict(bad_words_ids=[5, 6]), "bad_words_ids"),  # a flat list, not a list of sequences
        (dict(bad_words_ids=[[]]), "bad_words_ids"),
        (dict(bad_words_ids=[[1000]]), "bad_words_ids"),  # outside the vocabulary
        (dict(suppress_tokens=[-1]), "suppress_tokens"),
        (dict(suppress_tokens=[96]), "suppress_tokens"),  # the vocabulary is 0..95
        (dict(do_sample="yes"), "do_sample"),
        (dict(max_new_tokens=True), "max_new_tokens"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(stop_strings=[""]), "stop_strings"),
        (dict(stop_strings=["x"]), "stop_strings"),  # no tokenizer to decode with
    ],
)
def test_bad_generation_settings_fail_before_decoding(llama_pair, gen, name):
    target, drafter = llama_pair
    engine = SpeculativeEngine(target, SpeculationSettings(method="draft_model"), drafter=drafter)
    counters = [ForwardCounter(target), ForwardCounter(drafter)]
    try:
        with pytest.raises(ValueError, match=name):
            engine.generate([1, 2, 3], GenerationSettings(**gen))
        assert [c.calls for c in counters] == [0, 0]
    finally:
        for c in counters:
            c.restore()


def test_draft_model_needs_a_drafter(llama_pair):
    target, _ = llama_pair
    with pytest.raises(ValueError, match="drafter"):
        SpeculativeEngine(target, SpeculationSettings(method="draft_model"))


def test_drafter_vocabulary_must_cover_the_tokenizer(llama_pair):
    target, _ = llama_pair
    tok = bracket_tokenizer(target.config.vocab_size)
    small = build("llama", vocab=target.config.vocab_size - 20, layers=1)
    with pytest.raises(ValueError, match="vocabulary"):
        SpeculativeEngine(target, SpeculationSettings(method="draft_model"), drafter=small, tokenizer=tok)


def test_drafter_tokenizer_must_match(llama_pair):
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    target, drafter = llama_pair
    tok = bracket_tokenizer(target.config.vocab_size)
    vocab = {p: i for p, i in tok.get_vocab().items()}
    a, b = [p for p, i in vocab.items() if i in (7, 8)]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same pieces, two ids swapped
    other = Tokenizer(models.BPE(vocab, merges=[], unk_token="a"))
    other.decoder = decoders.Fuse()
    other = PreTrainedTokenizerFast(tokenizer_object=other, unk_token="a")
    with pytest.raises(ValueError, match="tokenizer"):
        SpeculativeEngine(target, SpeculationSettings(method="draft_model"), drafter=drafter, tokenizer=tok,
                          drafter_tokenizer=other)
    # the same tokenizer is fine
    SpeculativeEngine(target, SpeculationSettings(method="draft_model"), drafter=drafter, tokenizer=tok, drafter_tokenizer=tok)


def test_empty_prompt(llama_pair):
    target, _ = llama_pair
    with pytest.raises(ValueError, match="empty"):
        SpeculativeEngine(target).generate([], GenerationSettings())


def test_every_method_has_a_proposer():
    from pipeline.engine import METHODS
    from pipeline.engine.methods import PLAIN

    assert [name for name, m in METHODS.items() if m.build is None] == [PLAIN]
    for name, m in METHODS.items():
        if m.build is not None:
            assert isinstance(m.proposer, type) and m.k_param is not None, name


def test_every_methods_declared_capabilities_are_its_proposers_hooks():
    """Capabilities are declared on the MethodSpec (the engine never probes a proposer); each
    declaration matches the class: the hooks of ``pipeline.engine.proposers.base``'s protocols."""
    from pipeline.engine import METHODS
    from pipeline.engine.proposers.base import NoState

    def has(cls, *names):
        return all(callable(getattr(cls, n, None)) for n in names)

    for name, m in METHODS.items():
        cls = m.proposer
        if cls is None:
            assert not (m.proposes_trees or m.hooks_target or m.learns_from_outputs or m.adaptive), name
            continue
        assert has(cls, "models", "bind", "admit", "propose", "rollback", "reserve"), name
        assert m.hooks_target == has(cls, "target_forward"), name
        assert m.moves_tree_state == has(cls, "move"), name
        assert m.learns_from_outputs == has(cls, "finish", "reset_learning", "seed_pool"), name
        assert isinstance(m.adaptive, bool) and (m.max_rows is None or m.max_rows >= 1), name
        assert not any(hasattr(cls, a) for a in ("adaptive", "max_rows", "proposes_trees")), name  # one owner
    assert not hasattr(NoState, "max_rows") and NoState().models() == []


def test_the_settings_are_composed_from_each_methods_params():
    """SpeculationSettings holds each method's Params fields once; a setting two methods
    declare each on their own is refused when the table is composed; the pool a method keeps
    for the nightly reuse is its Params' to say."""
    import dataclasses

    from pipeline.engine import METHODS
    from pipeline.engine.methods import MethodParams, MethodSpec, param, param_owners
    from pipeline.engine.speculation import compose

    names = [f.name for f in dataclasses.fields(SpeculationSettings)]
    assert len(names) == len(set(names))
    for name, spec in METHODS.items():
        assert set(spec.param_names) <= set(names), name
        assert all(name in param_owners(METHODS)[p] for p in spec.param_names), name
    assert param_owners(METHODS)["assistant_confidence_threshold"] == ("draft_model", "early_exit")

    @dataclasses.dataclass
    class Twice(MethodParams):
        max_matching_ngram_size: int = param(3, "the same name as prompt_lookup's, declared again")

    with pytest.raises(TypeError, match="max_matching_ngram_size is declared twice"):
        compose({**METHODS, "twice": MethodSpec("twice", params=Twice)})

    suffix, draft = METHODS["suffix"], METHODS["draft_model"]
    assert suffix.pool_size(SpeculationSettings(method="suffix", suffix_decoding_max_cached_requests=7)) == 7
    assert suffix.pool_size(SpeculationSettings(method="suffix")) == 10_000  # vLLM's default
    assert draft.pool_size(SpeculationSettings(method="draft_model")) == 0  # it learns nothing from outputs
