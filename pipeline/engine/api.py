"""The engine as most callers use it: :class:`SpeculativeEngine` is the step API of
:class:`~pipeline.engine.loop.StepEngine` plus :meth:`~SpeculativeEngine.generate` (one row)
and :meth:`~SpeculativeEngine.generate_batch` (many rows, continuous batching), both a
:class:`~pipeline.engine.scheduler.Scheduler` run: calls go downward only
(this module -> scheduler -> step API).  :meth:`~SpeculativeEngine.warm_up` runs the same
path once on synthetic rows, so that timed work finds every kernel compiled.
"""

from __future__ import annotations

import dataclasses

import torch

from .batch import per_row_settings
from .loop import StepEngine
from .reference import ReferenceIndex
from .scheduler import Scheduler
from .settings import GenerationSettings
from .stats import GenerationResult


class SpeculativeEngine(StepEngine):
    """Speculative decoding of many rows at once with a target model (constructor arguments:
    :class:`~pipeline.engine.loop.StepEngine`)."""

    def generate(self, input_ids, settings: GenerationSettings | None = None) -> GenerationResult:
        """Generate one row (a batch of one).

        Args:
            input_ids: the prompt, ``list[int]`` or int64 tensor ``(1, seq_len)`` / ``(seq_len,)``.
            settings: :class:`GenerationSettings`; unset fields take the target's
                ``generation_config`` values, else greedy with 128 new tokens
                (:func:`~pipeline.engine.settings.resolve_generation_settings`).

        Returns:
            :class:`GenerationResult`: the generated ids (prompt excluded), the text, the
            finish reason (``"stop"`` | ``"length"`` | ``"context"``) and exact :class:`RowStats`.

        Raises:
            ValueError: a bad setting, an empty prompt, a token id outside the target's
                vocabulary, or a prompt that leaves no room in the target's context.
        """
        result = self.generate_batch([input_ids], settings)[0]
        if result.error is not None:
            raise ValueError(result.error.removeprefix("ValueError: "))
        return result

    @torch.inference_mode()
    def generate_batch(self, prompts, settings=None, max_batch_size: int | None = None,
                       references=None) -> list[GenerationResult]:
        """Generate many rows, up to ``max_batch_size`` in flight, in input order.

        Args:
            prompts: a list of prompts, each ``list[int]`` or an int64 tensor.
            settings: one :class:`GenerationSettings` for every row, or a list with one per
                prompt; rows may differ in any setting (those beyond
                :data:`~pipeline.engine.batch.PER_ROW_FIELDS` step in separate groups).
            max_batch_size: rows in flight (default: the engine's).
            references: ``None``, or one per prompt: ``None`` or the token ids the row's output
                is likely to repeat (a lightly edited row's previous output), from which the
                row drafts beside the method (:mod:`pipeline.engine.reference`; ignored by
                plain decoding).  Lossless: the results are what they are without them.

        Returns:
            One :class:`GenerationResult` per prompt, in order, each what :meth:`generate`
            gives for that row alone (greedy: the same tokens; sampling: the same law,
            drawn from the row's own generator).  A row that cannot run (empty prompt,
            prompt longer than the context, bad token ids) has ``error`` set and the
            others go on.

        Raises:
            ValueError: bad or mixed settings, or a reference with token ids outside the
                target's vocabulary (before any decoding).
        """
        prompts = list(prompts)
        references = [None] * len(prompts) if references is None else list(references)
        if len(references) != len(prompts):
            raise ValueError(f"references has {len(references)} entries for {len(prompts)} prompts")
        references = [None if r is None else ReferenceIndex(r, self.target_vocab) for r in references]
        rows_settings = per_row_settings(settings, len(prompts), self.target.generation_config, self.target_vocab)
        scheduler = Scheduler(self, min(max_batch_size or self.max_batch_size, max(1, len(prompts))))
        tickets = [scheduler.submit(p, s, resolved=True, reference=r)
                   for p, s, r in zip(prompts, rows_settings, references)]
        results = scheduler.run()
        return [results[t] for t in tickets]

    #: tokens of the random segment that a synthetic warm-up prompt repeats
    WARM_UP_PERIOD = 24

    def warm_up(self, max_rows: int | None = None, prompt_tokens: int = 128, new_tokens: int = 8,
                settings: GenerationSettings | None = None, seed: int = 0) -> float:
        """Decode synthetic rows once, through :meth:`generate_batch` (the one decode path), so
        that what the first timed rows would pay once is paid here: what inductor compiles on
        first use (:mod:`pipeline.engine.cpu`'s compiled layer and kernels, per shape), the KV
        cache and the drafter's caches allocated, the drafter's passes run, and the
        draft-length controller's cost curve measured at every number of rows in flight.  Then
        :meth:`reset_learning`: the rows' acceptance teaches the job nothing, while the cost
        curve stays.

        ``max_rows`` rows (default: the engine's ``max_batch_size``) enter at once, each a
        prompt of ``prompt_tokens`` token ids, a random segment of :data:`WARM_UP_PERIOD` ids of
        the target's vocabulary (seeded by ``seed`` and the row) repeated, so that prompt lookup
        and suffix decoding find matches and verify drafts of every length as a job does.  Row
        ``i`` (0-based) decodes ``new_tokens + 2 (k + 1) i`` tokens with EOS off, so the rows
        leave about one by one, as a job's batch drains; a number of rows in flight that this
        skipped (rows whose drafts put them ahead left in the same step) then runs once more on
        its own (prompts of two segments), so every number from ``max_rows`` down to 1 has run
        a step.  Greedy output never depends on it (it changes which kernels are ready,
        never what they compute); the rows' results are dropped.

        Args:
            max_rows: the most rows in flight the caller will run (the job's
                ``compute.max_batch_size``); capped at the engine's ``max_batch_size``.
            prompt_tokens: tokens per synthetic prompt (cut to fit the target's context).
            new_tokens: tokens the shortest row decodes.
            settings: the caller's :class:`GenerationSettings` (sampling and logits processors
                choose the verification path, so pass the job's); ``max_new_tokens``,
                ``eos_token_id``, ``stop_strings`` and ``seed`` are replaced, and ``response_format``
                dropped (random rows with EOS off cannot follow a grammar).  Default: greedy.
            seed: the synthetic prompts' seed (and the sampled rows').

        Returns:
            Seconds it took on the engine's ``clock``.

        Raises:
            ValueError: ``max_rows``, ``prompt_tokens`` or ``new_tokens`` below 1.
            RuntimeError: a synthetic row failed (its error: a model or setting that cannot
                decode at all, an out-of-memory at ``max_rows`` rows).
        """
        for name, v in (("max_rows", max_rows if max_rows is not None else 1), ("prompt_tokens", prompt_tokens),
                        ("new_tokens", new_tokens)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        t0 = self.clock()
        rows = min(max_rows or self.max_batch_size, self.max_batch_size)
        k = self.spec.k_max if self.proposer is not None else 0
        budgets = [new_tokens + 2 * (k + 1) * i for i in range(rows)]
        room = k * self.spec.num_candidates + 2
        if self.context is not None:  # a tiny context: shorter prompts first, then shorter budgets
            prompt_tokens = max(1, min(prompt_tokens, self.context - budgets[-1] - room))
            budgets = [max(1, min(b, self.context - prompt_tokens - room)) for b in budgets]
        gen = torch.Generator().manual_seed(seed)
        prompts = []
        for _ in range(rows):
            segment = torch.randint(0, self.target_vocab, (self.WARM_UP_PERIOD,), generator=gen)
            prompts.append(segment.repeat(-(-prompt_tokens // self.WARM_UP_PERIOD))[:prompt_tokens].tolist())
        base = settings or GenerationSettings(do_sample=False)
        row_settings = [dataclasses.replace(base, max_new_tokens=b, eos_token_id=[], stop_strings=None, seed=seed + i,
                                            response_format=None)
                        for i, b in enumerate(budgets)]
        results = self.generate_batch(prompts, row_settings, max_batch_size=rows)
        # every row entered at the first step and took part in its verify_steps steps
        steps = [r.stats.verify_steps for r in results if r.error is None]
        ran = {sum(s >= t for s in steps) for t in range(1, max(steps, default=0) + 1)}
        for n in sorted(set(range(1, rows + 1)) - ran):
            more = [dataclasses.replace(s, max_new_tokens=min(new_tokens, budgets[0])) for s in row_settings[:n]]
            results += self.generate_batch([p[: 2 * self.WARM_UP_PERIOD] for p in prompts[:n]], more, max_batch_size=n)
        failed = next((r.error for r in results if r.error is not None), None)
        self.reset_learning()
        if failed is not None:
            raise RuntimeError(f"the warm-up's synthetic rows failed: {failed}")
        return self.clock() - t0
