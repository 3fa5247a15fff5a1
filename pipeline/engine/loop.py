"""The speculative loop, for many rows in flight (continuous batching); one row is the
case of a batch of one.

Each step, for every row in flight::

    k   <- min(its schedule, its token budget - 1, what the context allows)  its cap
    k'  <- the draft-length controller's plan for all rows at once    (0 .. k; pipeline.engine.draft_control)
    d   <- the proposer drafts up to k' tokens for every row at once  (may be fewer, or none; per source)
           and a row with a reference drafts from it too              (pipeline.engine.reference)
           and a row with a grammar offers the run it forces (up to k), every draft cut
           before the first token its grammar forbids                 (pipeline.engine.grammar)
    d   <- the controller's cut: a draft per row, and how much of it  (the step's width)
    one target pass over every row's [last, d_1 .. d_n]               -> n + 1 distributions each
    (a, t) <- verify(d, p, q)  per row                                accepted prefix + one target token
    commit d_1..d_a, t token by token, stopping at EOS / stop string / budget / context
    the row's caches are valid up to its committed length (KV-cache rollback)
    the controller observes the plan, the accepted tokens and the step's timings; a row's
    schedule moves its k (the controller's next_k)

then finished rows leave and waiting rows take their slots at once (their prompt is
prefilled before the next step).  Rows are ragged: each keeps its own length, positions
and draft, in caches where position ``p`` sits in slot ``p`` (:mod:`pipeline.engine.cache`),
so a row's output never depends on which rows share its batch.

Invariant: the target's cache holds every committed token of a row but the last, which
opens the row's next verification pass, so a step with no draft is exactly a plain
decoding step and the accepted prefix is never recomputed.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from .batch import RowState
from .cpu import CpuOptions, CpuPlan, prepare
from .draft_control import DraftController
from .grammar import GrammarError, GrammarState, compile_grammar
from .reference import offer_reference
from .proposers import METHODS, ProposerInputs, build_proposer
from .proposers.base import Draft, DraftRequest, Proposer, empty_draft
from .runner import ModelRunner, model_layout, prefill, text_config
from .sampling import LogitsShaper
from .settings import GenerationSettings
from .speculation import SpeculationSettings
from .stats import GenerationResult, RowStats
from .stopping import StopChecker
from .verify import ArgmaxVerification, ShapedVerification, Verdict, Verification, VerifyPass

#: rows in flight when neither the engine nor the call says
DEFAULT_MAX_BATCH_SIZE = 16
#: the engine's ``draft_length``: by the controller, or every row its ``k``
DRAFT_LENGTHS = ("auto", "fixed")


class StepEngine:
    """The step API of speculative decoding: rows enter slots, every step advances every row
    in flight by propose -> verify -> accept -> commit.  :class:`~pipeline.engine.scheduler.Scheduler`
    is its only driver; :class:`~pipeline.engine.api.SpeculativeEngine` adds ``generate`` and
    ``generate_batch`` on top (what most callers use).

    The verbs, in the order a driver calls them: :meth:`bind` (slots for ``rows`` rows),
    :meth:`new_row` (a row's state, or why it cannot run), :meth:`admit` (prefill new rows),
    :meth:`step` (one step of every row in flight), :meth:`finish` (a finished row's
    :class:`GenerationResult`); :meth:`reset_learning` between jobs (or after a warm-up).
    :attr:`uses_target_hook` says whether the proposer runs the target's passes itself (MTP,
    early exit); :meth:`target_pass` is one target pass; :attr:`controller` is the draft-length
    controller (:class:`~pipeline.engine.draft_control.DraftController`, ``None`` for plain decoding).

    Args:
        target: a causal LM (``transformers.PreTrainedModel``), in eval mode, on any
            device (or split with ``device_map``; inputs go to ``target.device``), with
            eager or SDPA attention.
        speculation: the method and its parameters (:class:`SpeculationSettings`).
        drafter: the draft model for ``method="draft_model"`` (same tokenizer; its
            vocabulary may be padded to another size), the drafter of ``universal``, or
            the assistant of ``mtp_assistant``.
        tokenizer: the target's tokenizer; needed for ``text`` and ``stop_strings``.
        drafter_tokenizer: the drafter's tokenizer, if known: checked to equal the
            target's where both vocabularies overlap.
        max_batch_size: rows decoded in lockstep (default 16; ``universal`` drafts one
            row at a time).
        draft_length: ``"auto"`` (default): each step, the draft-length controller decides
            how many draft tokens each row verifies, 0 .. its draft length ``k``, from the
            proposer's confidence, measured acceptance and the measured cost of one more token
            in the pass (:mod:`pipeline.engine.draft_control`), greedy and sampled rows alike;
            a step where no draft pays is a plain step.  ``"fixed"``: every row drafts its
            ``k`` (the proposer's primary draft, token trees whole).  Greedy outputs and the
            law of sampled ones never depend on it; the draws a seed gives do, so a seed
            reproduces a sampled output only with ``"fixed"``.  Static ensemble verification
            (lossy: its output depends on ``k``) is always ``"fixed"``.
        clock: the clock of every time in the rows' statistics and of the controller's costs
            (seconds): ``time.perf_counter`` (default, wall time) or e.g.
            ``time.process_time`` (CPU time of the process: steadier on a shared CPU
            machine, but blind to GPU work and summed over threads).
        cpu: the CPU acceleration's parts (:class:`~pipeline.engine.cpu.CpuOptions`, the
            environment overriding them; ``None``: a model's existing plan, else all on).  Every
            model the engine runs is prepared here, once (:func:`pipeline.engine.cpu.prepare`:
            **its linear layers are rewritten in place**, kernels measured and compiled);
            :attr:`cpu_plans` says what was chosen.

    Raises:
        ValueError: a bad setting (naming it), a method without the model it needs, a
            drafter whose vocabulary cannot map onto the target's, or a model the engine
            cannot run exactly (recurrent layers, ``dynamic`` RoPE: the message names it).
    """

    def __init__(
        self,
        target,
        speculation: SpeculationSettings | None = None,
        drafter=None,
        tokenizer=None,
        drafter_tokenizer=None,
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
        draft_length: str = "auto",
        clock: Callable[[], float] = time.perf_counter,
        cpu: CpuOptions | None = None,
    ):
        self.spec = (speculation or SpeculationSettings()).validate()
        if not isinstance(max_batch_size, int) or isinstance(max_batch_size, bool) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be a positive integer, got {max_batch_size!r}")
        self.target = target
        self.tokenizer = tokenizer
        self.layout = model_layout(target, "target", self.spec.method)
        self.context = self.layout.context
        self.target_vocab = text_config(target).vocab_size
        #: the method's spec: the proposer's capabilities, read once (never probed on the proposer)
        self.method = METHODS[self.spec.method]
        #: what preparing each model the engine runs did, by role (pipeline.engine.cpu.CpuPlan)
        self.cpu_plans: dict[str, CpuPlan] = {}

        self.cpu_plans["target"] = prepare(target, cpu, "target", rows_in_flight=max_batch_size)
        self.proposer: Proposer | None = build_proposer(ProposerInputs(target, self.spec, drafter, tokenizer,
                                                                       drafter_tokenizer))
        for model, role in self.proposer.models() if self.proposer is not None else []:
            self.cpu_plans[role] = prepare(model, cpu, role, rows_in_flight=max_batch_size)  # every model it names
        self._hook = self.method.hooks_target
        self._move = self.method.moves_tree_state  # TreeState: state from the target's passes, moved with a tree's path
        if self._hook and self.layout.longrope_switch is not None:
            raise ValueError(
                f"method {self.spec.method!r} reuses the target's own passes, which a LongRoPE target recomputes when "
                "a row crosses original_max_position_embeddings; use draft_model or prompt_lookup with this target"
            )
        if self.spec.num_candidates > 1 and self.layout.longrope_switch is not None:
            raise ValueError(f"num_candidates={self.spec.num_candidates} (token trees) cannot be used with this target: "
                             "a LongRoPE target's factors follow the pass's slots, not the nodes' positions; set "
                             "num_candidates to 1")  # the method's own rule is SpeculationSettings.validate()'s
        limit = self.method.max_rows
        self.max_batch_size = max_batch_size if limit is None else min(max_batch_size, limit)
        if draft_length not in DRAFT_LENGTHS:
            raise ValueError(f"draft_length must be one of {DRAFT_LENGTHS}, got {draft_length!r}")
        self.clock = clock
        fixed = draft_length == "fixed" or self.spec.assistant_ensemble_weight is not None
        schedule = self.spec.num_assistant_tokens_schedule if self.method.adaptive else "constant"
        #: the draft-length controller (``None`` without a proposer)
        self.controller = DraftController(self.spec.k_max, fixed=fixed, schedule=schedule) \
            if self.proposer is not None else None
        self._runner: ModelRunner | None = None

    # ------------------------------------------------------------------ plumbing
    @property
    def runner(self) -> ModelRunner | None:
        """The target's :class:`ModelRunner` (``None`` until :meth:`bind`)."""
        return self._runner

    @property
    def uses_target_hook(self) -> bool:
        """Whether the proposer runs every target pass itself (``target_forward``: MTP layers,
        early exit), so the target's passes carry its extra work."""
        return self._hook

    def reset_learning(self) -> None:
        """Forget what the engine learnt from the rows it decoded, keeping what it measured of
        the machine: after a warm-up on synthetic rows (:meth:`SpeculativeEngine.warm_up`), or
        between timed runs of the same rows, so that no draft source has seen the rows it is
        timed on (suffix replaying its own outputs measured acceptance 0.88 instead of 0.39).

        Cleared: the proposer's job-wide state (its ``reset_learning()``: suffix's tree of
        finished outputs) and the controller's learning
        (:meth:`~pipeline.engine.draft_control.DraftController.reset_learning`: the calibration of
        confidence, the acceptance by position, the token-tree sizer's gain per side node, the
        probe schedule, the recorded admissions).  Kept: the controller's cost curve
        t(tokens, rows), the CPU plans and compiled kernels, the caches.  Rows in flight keep
        their own evidence: call it between runs, not while rows are in flight."""
        if self.method.learns_from_outputs:
            self.proposer.reset_learning()
        if self.controller is not None:
            self.controller.reset_learning()

    def seed_pool(self, documents: list[list[int]]) -> int:
        """Seed the proposer's job-wide pool with earlier outputs (token ids; a previous run's,
        :mod:`pipeline.reuse`) after :meth:`reset_learning`, when its method learns from
        finished outputs (suffix's ``seed_pool``); returns how many documents it took (0 for
        any other method).  Drafts only: the output is unchanged."""
        if self.proposer is None or not self.method.learns_from_outputs:
            return 0
        return self.proposer.seed_pool(documents)

    def bind(self, rows: int) -> ModelRunner:
        """The target's runner (and the proposer's state) for ``rows`` slots, built once."""
        if self._runner is None or self._runner.cache.max_rows < rows:
            self._runner = ModelRunner(self.target, rows, self.layout)
            if self.proposer is not None:
                self.proposer.bind(rows, self._runner)
        return self._runner

    def target_pass(self, slots, tokens, starts, logits_to_keep: int, trees=None) -> torch.Tensor:
        """One target pass over the rows in ``slots`` (through the proposer's hook when it has
        one): ``tokens[i]`` ``(q_i,)`` int64 from position ``starts[i]``; returns ``(b,
        logits_to_keep, V)`` logits of the last positions of every row.  ``trees``: per row
        ``None`` or a token tree's ``parents`` over its tokens (:meth:`ModelRunner.forward`;
        through a hook only when the proposer keeps its state along a tree's path,
        :class:`~pipeline.engine.proposers.base.TreeState`: the engine refuses trees otherwise)."""
        if self._hook:
            if trees is not None:
                return self.proposer.target_forward(self._runner, slots, tokens, starts, logits_to_keep, trees=trees)
            return self.proposer.target_forward(self._runner, slots, tokens, starts, logits_to_keep)
        return self._runner.forward(slots, tokens, starts, logits_to_keep=logits_to_keep, trees=trees).logits

    # ------------------------------------------------------------------ rows
    def new_row(self, index: int, prompt, settings: GenerationSettings, slot: int, device) -> RowState | str:
        """A row ready to prefill, or why it cannot run."""
        try:
            ids = torch.as_tensor(prompt, dtype=torch.long).view(1, -1).to(device)
        except (TypeError, ValueError, RuntimeError) as e:
            return f"the prompt is not a list of token ids: {e}"
        n = ids.shape[1]
        if n == 0:
            return "the prompt is empty (input_ids has no tokens)"
        if int(ids.min()) < 0 or int(ids.max()) >= self.target_vocab:
            return f"the prompt has token ids outside the target's vocabulary (0 .. {self.target_vocab - 1})"
        budget, bound = settings.max_new_tokens, False
        if self.context is not None:
            if n >= self.context:
                return (f"the prompt has {n} tokens, more than the target's context allows "
                        f"({self.context} positions, from max_position_embeddings and the RoPE scaling)")
            if self.context - n < budget:
                budget, bound = self.context - n, True
        eos = settings.eos_token_id  # resolved: the checkpoint's unless set
        eos_ids = set([eos] if isinstance(eos, int) else (eos or []))
        grammar = None
        if settings.response_format is not None:
            if self.tokenizer is None:
                return "response_format needs the target's tokenizer: pass tokenizer= to the engine"
            if not eos_ids:
                return "response_format needs an EOS token id (eos_token_id) to end the row where its grammar completes"
            try:
                grammar = compile_grammar(settings.response_format, self.tokenizer, self.target_vocab).state(eos_ids)
            except GrammarError as e:
                return str(e)
        generator = None
        if settings.do_sample:
            generator = torch.Generator(device=device)
            if settings.seed is None:
                generator.seed()
            else:
                generator.manual_seed(settings.seed)
        return RowState(
            index=index, slot=slot, sequence=ids, prompt_len=n, budget=budget, context_bound=bound,
            settings=settings, shaper=LogitsShaper(settings, prompt_length=n, eos_token_ids=eos_ids, grammar=grammar),
            stopper=StopChecker(eos_ids, settings.stop_strings, self.tokenizer),
            generator=generator, stats=RowStats(prompt_tokens=n), k=self.spec.k_max,
            rope_regime=self.layout.regime(n - 1), grammar=grammar,
            logprobs=[] if settings.logprobs is not None else None,
        )

    def admit(self, rows: list[RowState]) -> None:
        """Let the proposer take the new rows in (a drafter prefills them), then prefill their
        prompts (all but the last token) on the target; the time is shared by the rows'
        prompt tokens."""
        t0 = self.clock()
        slots = [r.slot for r in rows]
        prompts = [r.sequence for r in rows]
        longest = max(r.prompt_len + r.budget for r in rows) + self.spec.k_max * self.spec.num_candidates + 1
        self._runner.cache.reserve(longest)  # one allocation, not a doubling per pass
        if self.proposer is not None:
            self.proposer.reserve(longest)
            self.proposer.admit(slots, prompts)  # before the prefill, which hooks may record
        t1 = self.clock()
        prefill(self.target_pass, slots, prompts)
        t2 = self.clock()
        total = sum(r.prompt_len for r in rows)
        for r in rows:
            share = r.prompt_len / total
            r.stats.draft_time_s += (t1 - t0) * share
            r.stats.prefill_time_s += (t2 - t1) * share
            r.stats.wall_time_s += (t2 - t0) * share

    def _cap(self, row: RowState) -> int:
        """The most tokens this row may draft now: its schedule, its token budget (one token is
        the target's), its context, and a verification pass that must not straddle a
        LongRoPE switch."""
        if self.proposer is None:
            return 0
        k = min(row.k, row.remaining - 1)
        switch = self.layout.longrope_switch
        if switch is not None and row.length <= switch:
            k = min(k, switch - row.length)
        return max(0, k)

    def step(self, rows: list[RowState], fixed: bool = False) -> None:
        """One propose -> verify -> commit step for every row in flight: the controller's
        lengths, the proposer's drafts, the controller's cut, one target pass, the verdicts,
        each row settled, the controller told what happened.  ``fixed``: every row drafts
        and verifies its cap ``k`` this step, whatever the engine's ``draft_length``
        (:func:`~pipeline.engine.profile.step_costs`)."""
        t0 = self.clock()
        caps = [self._cap(r) for r in rows]
        # the rows of a step share their settings (the scheduler groups them): one way to verify
        argmax = self.spec.assistant_ensemble_weight is None and not any(
            r.shaper.active or r.shaper.do_sample or r.logprobs is not None for r in rows)
        candidates = self.spec.num_candidates if argmax else 1
        controller, evidence = self.controller, [r.evidence for r in rows]
        plan = controller.lengths(evidence, caps, rows[0].settings.do_sample, fixed) if controller is not None else None
        ks = list(plan.lengths) if plan is not None else caps
        proposed = self._propose(rows, ks, candidates)
        offered = [offer_reference(d, r.reference.draft(r.generated, k, r.sequence.device)) if r.reference is not None
                   else d for r, d, k in zip(rows, proposed, ks)]
        if self.proposer is not None and any(r.grammar is not None for r in rows):
            offered = [grammar_draft(r.grammar, r.generated, d, cap, r.sequence.device) if r.grammar is not None
                       else d for r, d, cap in zip(rows, offered, caps)]
        if plan is not None:
            plan = controller.cut(plan, offered, evidence)
        drafts = plan.drafts if plan is not None else offered
        t1 = self.clock()
        step = self._pass(rows, drafts)
        verdicts = self._verification(argmax).run(rows, drafts, step)
        t2 = self.clock()
        emitted = [self._settle(r, d, v, tree_off=self.spec.num_candidates > 1 and not argmax and r.grammar is None)
                   for r, d, v in zip(rows, drafts, verdicts)]
        t3 = self.clock()
        if plan is not None:
            controller.observe(plan, evidence, [v.path for v in verdicts], emitted, t1 - t0, t3 - t1)
        share = 1.0 / len(rows)
        for r in rows:
            r.stats.verify_steps += 1
            r.stats.draft_time_s += (t1 - t0) * share
            r.stats.verify_time_s += (t2 - t1) * share
            r.stats.wall_time_s += (t3 - t0) * share

    def _propose(self, rows: list[RowState], ks: list[int], candidates: int) -> list[Draft]:
        """Every row's draft of up to ``ks[i]`` tokens (a token tree of up to ``candidates``
        branches where the proposer offers them)."""
        drafts: list[Draft] = [empty_draft(r.sequence.device) for r in rows]
        asks = [i for i, k in enumerate(ks) if k > 0]
        if asks:
            want_probs = rows[0].settings.do_sample or self.spec.assistant_ensemble_weight is not None
            requests = [DraftRequest(rows[i].slot, rows[i].sequence, ks[i], rows[i].shaper, rows[i].generator,
                                     want_probs, candidates) for i in asks]
            for i, d in zip(asks, self.proposer.propose(requests)):
                drafts[i] = d
        return drafts

    def _pass(self, rows: list[RowState], drafts: list[Draft]) -> VerifyPass:
        """The step's target pass: each row's ``[last, d_1 .. d_n]`` (its whole sequence on the
        first pass past a LongRoPE switch, recomputed under the long factors as ``generate()``
        does), and the token trees over them."""
        tokens, starts = [], []
        switch = self.layout.longrope_switch
        for r, d in zip(rows, drafts):
            d_tokens = d.tokens.to(r.sequence.device)
            if switch is not None and r.rope_regime == 0 and r.length > switch:
                tokens.append(torch.cat([r.sequence[0], d_tokens]))
                starts.append(0)
                r.rope_regime = 1
            else:
                tokens.append(torch.cat([r.sequence[0, -1:], d_tokens]))
                starts.append(r.length - 1)
        trees = [d.parents if d.is_tree else None for d in drafts]
        return VerifyPass([r.slot for r in rows], tokens, starts, max(len(d) for d in drafts) + 1,
                          trees if any(t is not None for t in trees) else None)

    def _verification(self, argmax: bool) -> Verification:
        """How this step verifies: by argmax (greedy rows without logits processors; linear
        drafts and token trees), or with each row's logits shaped (processors, sampling,
        static ensemble)."""
        if not argmax:
            return ShapedVerification(self.target_pass, self.spec.assistant_ensemble_weight)
        return ArgmaxVerification(self.target_pass)

    def _settle(self, row: RowState, draft: Draft, verdict: Verdict, tree_off: bool) -> list[int]:
        """After verification: the accepted path's cache entries moved to their slots (a tree),
        the proposer rolled back to the committed tokens the target's pass ran (the verified
        draft may be another source's, or leave the proposer's first branch: which of its own
        state still holds, the proposer checks against its drafted tokens,
        :class:`~pipeline.engine.proposers.base.DraftedTokens`), the block committed and
        counted; returns the tokens emitted."""
        n, path = len(draft), verdict.path
        depth = n
        if draft.parents is not None:
            moves = [(row.length + j, row.length + i) for i, j in enumerate(path) if j != i]
            if moves:
                src, dst = [a for a, _ in moves], [b for _, b in moves]
                self._runner.cache.move(row.slot, src, dst)
                if self._move:
                    self.proposer.move(row.slot, src, dst)
            if draft.is_tree:
                row.stats.tree_steps += 1
                row.stats.tree_nodes += n
            depth = max(draft.depths(), default=0)
        elif tree_off and n:
            row.stats.tree_off_steps += 1
        tokens = draft.tokens[path].tolist() if path else []
        if self.proposer is not None:
            self.proposer.rollback(row.slot, row.length + len(path))
        return self._commit(row, tokens, verdict.token, depth, draft.source, verdict.logprobs)

    def _commit(self, row: RowState, accepted: list[int], token: int, drafted: int, source: str,
                logprobs: list[dict] | None = None) -> list[int]:
        """Emit the ``accepted`` draft tokens and the target's token one by one, stopping at
        EOS / a stop string; update the row's sequence, schedule and statistics (a draft of
        ``drafted`` positions from ``source``: a tree counts its depth; the tokens its grammar
        forced; the log-probabilities); returns the tokens emitted."""
        block = accepted + [token]
        emitted = 0
        for tok in block:
            row.generated.append(tok)
            emitted += 1
            if row.grammar is not None and row.grammar.forced_at.get(len(row.generated) - 1):
                row.stats.forced_tokens += 1
            if row.stopper.hit(row.generated):
                row.finish = "stop"
                break
        if row.logprobs is not None and logprobs is not None:
            row.logprobs.extend(logprobs[:emitted])
        if row.on_tokens is not None:
            row.on_tokens(row.generated[-emitted:])
        if drafted:
            row.stats.record_draft(drafted, min(len(accepted), emitted))
            row.stats.record_source(source, min(len(accepted), emitted))
        if row.finish is None and row.remaining <= 0:
            row.finish = "context" if row.context_bound else "length"
        if row.finish is None:
            new = torch.tensor([block], dtype=torch.long, device=row.sequence.device)
            row.sequence = torch.cat([row.sequence, new], dim=1)
            if self.controller is not None and drafted:
                row.k = self.controller.next_k(row.k, len(accepted))
        return block[:emitted]

    def finish(self, row: RowState) -> GenerationResult:
        if self.method.learns_from_outputs:  # a proposer that learns from finished outputs (suffix)
            self.proposer.finish(row.slot, row.generated)
        stats = row.stats
        stats.new_tokens = len(row.generated)
        stats.finish_reason = row.finish
        text = self.tokenizer.decode(row.generated, skip_special_tokens=True) if self.tokenizer is not None else None
        complete = None
        if row.grammar is not None:
            complete = row.finish == "stop" and row.grammar.complete(row.generated)
        return GenerationResult(token_ids=row.generated, text=text, finish_reason=row.finish, stats=stats,
                                grammar_complete=complete, logprobs=row.logprobs)


def _prefix(draft: Draft, n: int) -> Draft:
    """A linear draft's first ``n`` tokens (its alternatives as they are)."""
    if n >= len(draft):
        return draft
    return Draft(draft.tokens[:n], draft.probs[:n] if draft.probs is not None else None, None,
                 draft.confidence[:n] if draft.confidence is not None else None, draft.source, draft.alternatives)


def grammar_draft(grammar: GrammarState, output: list[int], draft: Draft, cap: int, device) -> Draft:
    """A grammar row's draft for the controller: the method's draft and its alternatives, each
    cut before the first token its grammar forbids after ``output`` (a forbidden token would
    be rejected anyway: the cut saves its pass), and the run the grammar forces, up to ``cap``
    tokens with confidence 1.0, offered as source ``"grammar"`` (a lossless draft: verified like
    any other): first when it is at least as long as the method's draft, else beside it.  A token tree is left whole (grammar rows verify linear drafts)."""
    if draft.parents is not None and draft.is_tree:
        return draft
    alternatives = tuple(a for a in (_prefix(a, grammar.valid_prefix(output, a.tokens.tolist()))
                                     for a in draft.alternatives) if len(a))
    primary = _prefix(Draft(draft.tokens, draft.probs, None, draft.confidence, draft.source, alternatives),
                      grammar.valid_prefix(output, draft.tokens.tolist()))
    if len(primary) == 0 and alternatives:  # the first alternative first, the others beside (offer_reference's rule)
        first = alternatives[0]
        primary = Draft(first.tokens, first.probs, None, first.confidence, first.source, alternatives[1:])
    run = grammar.forced(output, cap)
    if not run:
        return primary
    forced = Draft(torch.tensor(run, dtype=torch.long, device=device),
                   confidence=torch.ones(len(run), dtype=torch.float64), source="grammar")
    if len(run) < len(primary):
        return offer_reference(primary, forced)
    # at least as long as the method's draft: the run first (what a fixed draft length verifies),
    # the method's draft and its other sources beside it
    own = (Draft(primary.tokens, primary.probs, None, primary.confidence, primary.source),) if len(primary) else ()
    return Draft(forced.tokens, None, None, forced.confidence, "grammar", own + primary.alternatives)
