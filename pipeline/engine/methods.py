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

from dataclasses import dataclass, field
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
        proposer: the proposer class ``build`` makes; its ``adaptive`` and ``max_rows``
            are the method's (:attr:`adaptive`, :attr:`max_rows`).
        needs_drafter: ``models.drafter`` is required, loaded and passed to ``build``
            (the other methods never load it, even when one is configured).
        draft_length: the SpeculationSettings field of its draft length ``k`` (the same
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

    The proposer's capabilities, read once from its class (the protocols of
    :mod:`pipeline.engine.proposers.base`) when the spec is made, so that the settings'
    checks and the loop read them here and never probe a proposer:

    Attributes:
        proposes_trees: it may answer with a token tree (``num_candidates > 1``; the class's
            ``proposes_trees``).
        hooks_target: it runs the target's passes itself (``target_forward``: MTP layers,
            early exit, draft heads).
        moves_tree_state: it keeps per-position state from the target's passes along a
            tree's accepted path (``move``, :class:`~pipeline.engine.proposers.base.TreeState`).
        learns_from_outputs: it learns from finished rows (``finish`` and ``reset_learning``,
            :class:`~pipeline.engine.proposers.base.Finish`: suffix's job-wide pool).
    """

    name: str
    build: Callable[[Any], Any] | None = None
    proposer: type | None = None
    needs_drafter: bool = False
    draft_length: str | None = "num_assistant_tokens"
    params: tuple[str, ...] = ()
    required: tuple[str, ...] = ()
    draft_logits: bool = False
    check_pair: Callable[[Any, Any, Any, Any], None] | None = None
    check_drafter: Callable[[str, Any], Any] | None = None
    load_drafter: Callable[[str, Any], Any] | None = None
    tune_candidate: Callable[[Any, Any], dict[str, Any] | None] | None = None
    tune_k_max: int | None = 8
    proposes_trees: bool = field(init=False, default=False)
    hooks_target: bool = field(init=False, default=False)
    moves_tree_state: bool = field(init=False, default=False)
    learns_from_outputs: bool = field(init=False, default=False)

    def __post_init__(self):
        cls = self.proposer
        facts = {"proposes_trees": bool(getattr(cls, "proposes_trees", False)),
                 "hooks_target": callable(getattr(cls, "target_forward", None)),
                 "moves_tree_state": callable(getattr(cls, "move", None)),
                 "learns_from_outputs": callable(getattr(cls, "finish", None))}
        for name, value in facts.items():
            object.__setattr__(self, name, value)

    def tree_refusal(self) -> str | None:
        """Why this method cannot verify token trees (``num_candidates > 1``), or ``None``
        when it can (a target's own limits, such as LongRoPE, are the engine's to check)."""
        if self.build is None or not self.proposes_trees:
            return "its proposer drafts no token trees (prompt_lookup, suffix, draft_model and eagle do)"
        if self.hooks_target and not self.moves_tree_state:
            return "it runs the target's passes itself, without keeping its state along a tree's path (move)"
        return None

    @property
    def adaptive(self) -> bool:
        """Whether its draft length adapts per row (transformers' heuristic schedule applies)."""
        return bool(getattr(self.proposer, "adaptive", False))

    @property
    def max_rows(self) -> int | None:
        """Rows it can draft for at once (``None``: any number)."""
        return getattr(self.proposer, "max_rows", None)

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
