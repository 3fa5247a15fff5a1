"""What a decoding method is, as one record: :class:`MethodSpec`.

The table of methods, one spec per method, is ``METHODS`` in
:mod:`pipeline.engine.proposers` (the proposer registry); everything that depends on a
method reads its spec there and never names methods: the settings' checks
(:meth:`pipeline.engine.SpeculationSettings.validate`), the job config (which methods
load ``models.drafter``), the driver's model checks (:func:`pipeline.models.check_models`),
the loader (:mod:`pipeline.loading`), the tuner's candidates (:mod:`pipeline.tune.tuner`)
and the server's per-request draft length (:mod:`pipeline.serve`).

Adding a method is one file in ``pipeline/engine/proposers/`` (the proposer, its
``build(inputs)`` factory and, where it needs them, its pair check and tuner candidacy)
plus one ``MethodSpec`` line in the registry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

#: target-only decoding: the method without a proposer, and the baseline speedups are measured against
PLAIN = "plain"
#: the SpeculationSettings fields of the per-row adaptive draft length: transformers'
#: heuristic schedule (every adaptive method) and the drafter-confidence stop (the methods
#: that take it as a parameter)
SCHEDULE_FIELD = "num_assistant_tokens_schedule"
CONFIDENCE_FIELD = "assistant_confidence_threshold"


@dataclass(frozen=True)
class MethodSpec:
    """One decoding method.

    Attributes:
        name: ``SpeculationSettings.method`` (and the job config's ``method.name``).
        build: ``(ProposerInputs) -> Proposer``, the factory of its proposer (``None``:
            target-only decoding, no proposer).  Raises ``ValueError`` when the inputs do
            not fit the method (a missing drafter, a drafter of another architecture).
        proposer: the proposer class ``build`` makes.
        needs_drafter: ``models.drafter`` is required, loaded and passed to ``build``
            (the other methods never load it, even when one is configured).
        k_param: the SpeculationSettings field of its ``k`` (the most draft tokens; the same
            name in an API request); ``None``: it drafts nothing.
        params: its own SpeculationSettings fields beyond the draft length (and beyond
            the schedule of an adaptive method): a field that defaults to ``None`` is
            refused on a method that does not list it; the tuner carries them into its
            candidates.
        required: the ``params`` that must be set.
        draft_logits: its drafts carry the drafter's distribution in the target's
            vocabulary, so static ensemble verification (``assistant_ensemble_weight``)
            is possible.
        check_pair: ``(target_config, drafter_config, tokenizer, drafter_tokenizer)``,
            the driver's check that the drafter fits the target, from the configs and
            tokenizers alone (no weights); raises ``ValueError`` saying why not.
        check_drafter: for a drafter that is not a causal-LM checkpoint (a draft head):
            ``(path, target_config) -> drafter_config``, the driver's check of
            ``models.drafter`` in place of the causal-LM checks (config, architecture,
            tokenizer, ``check_pair``); raises ``ValueError`` saying why it does not fit.
        load_drafter: for such a drafter: ``(path, target) -> drafter``, loading
            ``models.drafter`` onto the loaded target in place of ``AutoModelForCausalLM``
            (no drafter tokenizer).
        tune_candidate: ``(config_settings, models) -> params | None``: whether the tuner
            tries the method on these loaded models (``models.target``, ``.drafter``,
            ``.tokenizer``, ``.drafter_tokenizer``) for a job whose own settings are
            ``config_settings``: ``None`` when it does not apply, else the values of its
            ``params`` to try where they differ from the config's (:func:`always_tried`:
            ``{}``, whatever the models).  Unset: tried only when the job's config names
            the method.
        tune_k_max: the longest draft the tuner tries by default (at least the config's
            draft length; 8 suits a model drafter); ``None``: the config's (a draft
            length the checkpoint bounds).

    The proposer's capabilities, declared here (the loop, the settings' checks and the tuner
    read them here and never probe a proposer; ``tests/engine/test_settings.py`` checks each
    against the class's hooks, the protocols of :mod:`pipeline.engine.proposers.base`):

    Attributes:
        proposes_trees: it may answer with a token tree (``num_candidates > 1``).
        hooks_target: it runs the target's passes itself (``target_forward``: MTP layers,
            early exit, draft heads).
        moves_tree_state: it keeps per-position state from the target's passes along a
            tree's accepted path (``move``, :class:`~pipeline.engine.proposers.base.TreeState`).
        learns_from_outputs: it learns from finished rows (``finish``, ``reset_learning`` and
            ``seed_pool``, :class:`~pipeline.engine.proposers.base.Finish`: suffix's job-wide
            pool, which the nightly reuse seeds).
        adaptive: its draft length adapts per row (transformers' heuristic schedule applies).
        max_rows: rows it can draft for at once (``None``: any number).
    """

    name: str
    build: Callable[[Any], Any] | None = None
    proposer: type | None = None
    needs_drafter: bool = False
    k_param: str | None = "num_assistant_tokens"
    params: tuple[str, ...] = ()
    required: tuple[str, ...] = ()
    draft_logits: bool = False
    check_pair: Callable[[Any, Any, Any, Any], None] | None = None
    check_drafter: Callable[[str, Any], Any] | None = None
    load_drafter: Callable[[str, Any], Any] | None = None
    tune_candidate: Callable[[Any, Any], dict[str, Any] | None] | None = None
    tune_k_max: int | None = 8
    proposes_trees: bool = False
    hooks_target: bool = False
    moves_tree_state: bool = False
    learns_from_outputs: bool = False
    adaptive: bool = False
    max_rows: int | None = None

    def tree_refusal(self) -> str | None:
        """Why this method cannot verify token trees (``num_candidates > 1``), or ``None``
        when it can (a target's own limits, such as LongRoPE, are the engine's to check)."""
        if self.build is None or not self.proposes_trees:
            return "its proposer drafts no token trees (prompt_lookup, suffix, draft_model and eagle do)"
        if self.hooks_target and not self.moves_tree_state:
            return "it runs the target's passes itself, without keeping its state along a tree's path (move)"
        return None

    @property
    def drafts(self) -> bool:
        return self.build is not None

    def config_params(self, settings) -> dict[str, Any]:
        """Its ``params`` that ``settings`` (a SpeculationSettings) sets, by name."""
        return {p: getattr(settings, p) for p in self.params if getattr(settings, p) is not None}

    def candidate_params(self, settings, models) -> dict[str, Any] | None:
        """The tuner's candidacy on ``models`` for a job with ``settings`` (see
        ``tune_candidate``): its parameters to try, or ``None``."""
        if self.tune_candidate is not None:
            extra = self.tune_candidate(settings, models)
        else:
            extra = {} if settings.method == self.name else None
        return None if extra is None else {**self.config_params(settings), **extra}


def always_tried(settings, models) -> dict[str, Any]:
    """``MethodSpec.tune_candidate`` of a method the tuner always tries (it needs nothing
    the models may lack)."""
    return {}
