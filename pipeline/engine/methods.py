"""What a decoding method is, as one record: :class:`MethodSpec`.

The table of methods, one spec per method, is ``METHODS`` in
:mod:`pipeline.engine.proposers` (the proposer registry); everything that depends on a
method reads its spec there and never names methods: the settings' checks
(:meth:`pipeline.engine.SpeculationSettings.validate`), the job config (which methods
load ``models.drafter``), the driver's model checks (:func:`pipeline.models.check_models`),
the loader (:mod:`pipeline.loading`), the tuner's candidates (:mod:`pipeline.tune.tuner`)
and the server's per-request draft length (:mod:`pipeline.serve`).

A method's parameters are its own too: its file declares a ``Params`` dataclass
(:class:`MethodParams`) whose fields, made with :func:`param`, carry their default, their
rule (:class:`Rule`) and their doc; :class:`pipeline.engine.SpeculationSettings` is composed
from the ``Params`` of the table's methods, and the config reference is generated from the
fields' docs.  Which method takes which setting is read here, from ``MethodSpec.params``,
and nowhere else (:attr:`MethodSpec.param_names`, :attr:`MethodSpec.reads`,
:func:`foreign_params`).

Adding a method is one file in ``pipeline/engine/proposers/`` (the proposer, its
``Params``, its ``build(inputs)`` factory and, where it needs them, its pair check and
tuner candidacy) plus one ``MethodSpec`` line in the registry (``docs/adding-a-method.md``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

#: target-only decoding: the method without a proposer, and the baseline speedups are measured against
PLAIN = "plain"
#: the SpeculationSettings fields of the per-row adaptive draft length: transformers'
#: heuristic schedule (every adaptive method) and the drafter-confidence stop (the methods
#: that take it as a parameter)
SCHEDULE_FIELD = "num_assistant_tokens_schedule"
CONFIDENCE_FIELD = "assistant_confidence_threshold"
#: the static ensemble verification weight: a setting of every method with draft logits
ENSEMBLE_FIELD = "assistant_ensemble_weight"


@dataclass(frozen=True)
class Rule:
    """What a parameter's value must be: ``ok(value)`` is true, else the error says ``says``
    (``"<field> must be <says>, got <value>"``)."""

    says: str
    ok: Callable[[Any], bool]


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)


def int_at_least(n: int) -> Rule:
    """An integer ``>= n`` (``n = 1``: a positive integer; ``0``: a non-negative one)."""
    says = {1: "a positive integer", 0: "a non-negative integer"}.get(n, f"an integer >= {n}")
    return Rule(says, lambda v: _int(v) and v >= n)


def number_in(low: float, high: float, *, low_open: bool = False, high_open: bool = False) -> Rule:
    """A number (no NaN, no boolean) in the interval from ``low`` to ``high``."""
    says = f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    return Rule(says, lambda v: _number(v) and (v > low if low_open else v >= low)
                and (v < high if high_open else v <= high))


def one_of(choices: Iterable[str]) -> Rule:
    choices = tuple(choices)
    return Rule(f"one of {choices}", lambda v: v in choices)


POSITIVE_INT = int_at_least(1)


def param(default: Any, doc: str, rule: Rule | None = None, *, what: str = "", required: bool = False):
    """A field of a method's ``Params`` (a :func:`dataclasses.field`): its ``default`` (a
    field that defaults to ``None`` is the method's own: refused on a method that does not
    take it), its ``doc`` (the config reference's text for ``method.<field>``), its ``rule``
    (checked when the value is not ``None``), ``what`` it counts (said beside the name in an
    error) and whether the method ``required`` it set."""
    return dataclasses.field(default=default, metadata={"doc": doc, "rule": rule, "what": what,
                                                         "required": required})


def check_param(field: dataclasses.Field, value: Any) -> None:
    """Check ``value`` against ``field``'s rule (a field made with :func:`param`).

    Raises:
        ValueError: ``"<name> (<what>) must be <rule>, got <value>"``.
    """
    rule = field.metadata.get("rule")
    if rule is None or (value is None and field.default is None) or rule.ok(value):
        return
    what = field.metadata.get("what")
    raise ValueError(f"{field.name}{f' ({what})' if what else ''} must be {rule.says}, got {value!r}")


class MethodParams:
    """The base of a method's ``Params`` dataclass: the settings only some methods read.

    A subclass is a ``@dataclass`` whose fields are made with :func:`param`; two methods
    that share a setting share the class that declares it (a base of both ``Params``), so
    each setting is declared once.  :class:`pipeline.engine.SpeculationSettings` holds every
    ``Params`` field of the table's methods, under the same name (the ``method:`` section's
    keys)."""

    @classmethod
    def of(cls, settings) -> "MethodParams":
        """This method's parameters, read from ``settings`` (a SpeculationSettings)."""
        return cls(**{f.name: getattr(settings, f.name) for f in dataclasses.fields(cls)})

    def pool_size(self) -> int:
        """How many finished outputs the method's job-wide pool keeps (what the nightly reuse
        seeds it with); 0 for a method that learns nothing from outputs."""
        return 0


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
        params: its ``Params`` dataclass (a :class:`MethodParams`), declared in its file:
            the settings only some methods read, with their defaults, rules and docs
            (``None``: none).  Its fields beyond ``k_param`` are its own parameters
            (:attr:`param_names`): a field that defaults to ``None`` is refused on a method
            that does not take it; the tuner carries them into its candidates.
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
    params: type | None = None
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

    @property
    def param_names(self) -> tuple[str, ...]:
        """Its own parameters: the fields of its ``Params`` beyond its draft length."""
        fields = dataclasses.fields(self.params) if self.params is not None else ()
        return tuple(f.name for f in fields if f.name != self.k_param)

    @property
    def required(self) -> tuple[str, ...]:
        """Its parameters that must be set (:func:`param`'s ``required``)."""
        fields = dataclasses.fields(self.params) if self.params is not None else ()
        return tuple(f.name for f in fields if f.metadata.get("required"))

    @property
    def reads(self) -> frozenset[str]:
        """Every SpeculationSettings field it reads: its draft length, its parameters, the
        schedule of an adaptive method, the ensemble weight of one with draft logits (what
        the resume fingerprint compares)."""
        used = set(self.param_names)
        if self.k_param:
            used.add(self.k_param)
        if self.adaptive:
            used.add(SCHEDULE_FIELD)
        if self.draft_logits:
            used.add(ENSEMBLE_FIELD)
        return frozenset(used)

    def config_params(self, settings) -> dict[str, Any]:
        """Its parameters that ``settings`` (a SpeculationSettings) sets, by name."""
        if self.params is None:
            return {}
        own = dataclasses.asdict(self.params.of(settings))
        return {p: own[p] for p in self.param_names if own[p] is not None}

    def pool_size(self, settings) -> int:
        """How many finished outputs its job-wide draft pool keeps under ``settings`` (its
        ``Params.pool_size``): what the nightly reuse seeds each actor's pool with; 0 when it
        learns nothing from outputs."""
        if not self.learns_from_outputs or self.params is None:
            return 0
        return self.params.of(settings).pool_size()

    def candidate_params(self, settings, models) -> dict[str, Any] | None:
        """The tuner's candidacy on ``models`` for a job with ``settings`` (see
        ``tune_candidate``): its parameters to try, or ``None``."""
        if self.tune_candidate is not None:
            extra = self.tune_candidate(settings, models)
        else:
            extra = {} if settings.method == self.name else None
        return None if extra is None else {**self.config_params(settings), **extra}


def param_owners(methods: dict[str, MethodSpec]) -> dict[str, tuple[str, ...]]:
    """``{setting: the methods of methods (the table) that take it}``, for every method's own
    parameters (:attr:`MethodSpec.param_names`): the one map of settings to methods."""
    owners: dict[str, tuple[str, ...]] = {}
    for m in methods.values():
        for p in m.param_names:
            owners[p] = owners.get(p, ()) + (m.name,)
    return owners


def foreign_params(methods: dict[str, MethodSpec], name: str) -> dict[str, tuple[str, ...]]:
    """The parameters of the other methods of ``methods`` (the table) that method ``name``
    does not take, with the methods that take each: refused by the settings when set (those
    defaulting to ``None``), dropped from the engine's settings by the job config, which may
    keep them."""
    return {p: owners for p, owners in param_owners(methods).items() if name not in owners}


def always_tried(settings, models) -> dict[str, Any]:
    """``MethodSpec.tune_candidate`` of a method the tuner always tries (it needs nothing
    the models may lack)."""
    return {}
