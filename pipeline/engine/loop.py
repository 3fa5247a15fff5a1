"""The single-sequence speculative loop.

One row at a time::

    prefill the target on prompt[:-1]
    repeat:
        k   <- min(schedule, remaining budget - 1)
        d   <- proposer drafts k tokens             (may be fewer, or none)
        one target pass over [last, d_1 .. d_n]      -> n + 1 distributions
        (a, t) <- verify(d, p, q)                    accepted prefix + one target token
        commit d_1..d_a, t token by token, stopping at EOS / stop string
        crop the target's and the drafter's KV caches to the committed length

Invariant: the target's cache holds every committed token but the last, which opens the
next verification pass, so a step with no draft is exactly a plain decoding step and the
accepted prefix is never recomputed.
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache

from .proposers import ProposerInputs, build_proposer
from .proposers.base import DraftRequest, Proposer, empty_draft
from .proposers.draft_model import text_config
from .sampling import LogitsShaper
from .settings import GenerationSettings, SpeculationSettings, resolve_generation_settings
from .stats import GenerationResult, RowStats
from .stopping import StopChecker
from .verify import verify_greedy, verify_sampling


class SpeculativeEngine:
    """Speculative decoding of one sequence at a time with a target model.

    Args:
        target: a causal LM (``transformers.PreTrainedModel``), in eval mode, on any
            device (or split with ``device_map``; inputs go to ``target.device``).
        speculation: the method and its parameters (:class:`SpeculationSettings`).
        drafter: the draft model for ``method="draft_model"`` (same tokenizer; its
            vocabulary may be padded to another size).
        tokenizer: the target's tokenizer; needed for ``text`` and ``stop_strings``.
        drafter_tokenizer: the drafter's tokenizer, if known: checked to equal the
            target's where both vocabularies overlap.

    Raises:
        ValueError: a bad setting (naming it), a method without the model it needs, or a
            drafter whose vocabulary cannot map onto the target's.
    """

    def __init__(
        self,
        target,
        speculation: SpeculationSettings | None = None,
        drafter=None,
        tokenizer=None,
        drafter_tokenizer=None,
    ):
        self.spec = (speculation or SpeculationSettings()).validate()
        self.target = target
        self.tokenizer = tokenizer
        self.target_vocab = text_config(target).vocab_size
        self.context = getattr(text_config(target), "max_position_embeddings", None)
        self.proposer: Proposer | None = build_proposer(
            ProposerInputs(target, self.spec, drafter, tokenizer, drafter_tokenizer)
        )
        hook = getattr(self.proposer, "target_forward", None)
        self._target_forward = hook if hook is not None else self._plain_target_forward

    @staticmethod
    def _plain_target_forward(target, input_ids, cache, logits_to_keep: int) -> torch.Tensor:
        return target(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=logits_to_keep).logits[0]


    # ------------------------------------------------------------------ generation
    @torch.inference_mode()
    def generate(self, input_ids, settings: GenerationSettings | None = None) -> GenerationResult:
        """Generate one row.

        Args:
            input_ids: the prompt, ``list[int]`` or int64 tensor ``(1, seq_len)`` / ``(seq_len,)``.
            settings: :class:`GenerationSettings`; unset fields take the target's
                ``generation_config`` values, else greedy with 128 new tokens
                (:func:`~pipeline.engine.settings.resolve_generation_settings`).

        Returns:
            :class:`GenerationResult` with the generated ids (prompt excluded), the text,
            the finish reason (``"stop"`` | ``"length"``) and exact :class:`RowStats`.

        Raises:
            ValueError: a bad setting, an empty prompt, or a prompt that does not fit the
                target's context (``max_position_embeddings``).
        """
        settings = resolve_generation_settings(settings, self.target.generation_config, self.target_vocab)
        start = time.perf_counter()
        device = self.target.device
        prompt = torch.as_tensor(input_ids, dtype=torch.long).view(1, -1).to(device)
        prompt_len = prompt.shape[1]
        if prompt_len == 0:
            raise ValueError("the prompt is empty (input_ids has no tokens)")
        budget = settings.max_new_tokens
        if self.context is not None:
            if prompt_len >= self.context:
                raise ValueError(
                    f"the prompt has {prompt_len} tokens, more than the target's context allows "
                    f"(max_position_embeddings={self.context})"
                )
            budget = min(budget, self.context - prompt_len)

        eos = settings.eos_token_id
        eos_ids = set([eos] if isinstance(eos, int) else (eos or []))
        stopper = StopChecker(eos_ids, settings.stop_strings, self.tokenizer)
        shaper = LogitsShaper(settings, prompt_length=prompt_len, eos_token_ids=eos_ids)
        generator = None
        if settings.do_sample:
            generator = torch.Generator(device=device)
            if settings.seed is None:
                generator.seed()
            else:
                generator.manual_seed(settings.seed)
        ensemble = self.spec.assistant_ensemble_weight
        want_probs = settings.do_sample or ensemble is not None
        stats = RowStats(prompt_tokens=prompt_len)
        proposer = self.proposer
        cache = DynamicCache(config=self.target.config)
        # sliding-window layers (Gemma, Mistral) must keep rejected states until the crop
        cache.activate_past_recording()
        if proposer is not None:
            proposer.reset(cache)
        k_schedule = self.spec.draft_length
        heuristic = self.spec.num_assistant_tokens_schedule == "heuristic" and proposer is not None and proposer.adaptive

        # Prefill: the cache holds every committed token but the last.
        t0 = time.perf_counter()
        if prompt_len > 1:
            self._target_forward(self.target, prompt[:, :-1], cache, 1)
        stats.prefill_time_s = time.perf_counter() - t0

        sequence = prompt
        generated: list[int] = []
        finish = "length"
        while len(generated) < budget:
            k = min(k_schedule, budget - len(generated) - 1)
            t0 = time.perf_counter()
            if proposer is not None and k > 0:
                draft = proposer.propose(DraftRequest(sequence, k, shaper, generator, want_probs))
            else:
                draft = empty_draft(device)
            t1 = time.perf_counter()
            n = len(draft)
            d_tokens = draft.tokens.to(device)
            step_input = torch.cat([sequence[:, -1:], d_tokens.view(1, -1)], dim=1)
            logits = self._target_forward(self.target, step_input, cache, n + 1)
            d_probs = draft.probs.to(device) if draft.probs is not None else None
            if settings.do_sample:
                p = shaper.probs(sequence, logits, d_tokens)
                if d_probs is not None:
                    d_probs = d_probs.to(p.dtype)
                accepted, token = verify_sampling(d_tokens, p, d_probs, generator, ensemble)
            else:
                scores = shaper.shape(sequence, logits, d_tokens)
                accepted, token = verify_greedy(d_tokens, scores, d_probs, ensemble)
            cache.crop(accepted - n)  # crop(0) trims sliding-window layers back to their window
            if proposer is not None:
                proposer.rollback(sequence.shape[1] + accepted)
            stats.verify_steps += 1
            stats.draft_time_s += t1 - t0
            stats.verify_time_s += time.perf_counter() - t1

            block = d_tokens[:accepted].tolist() + [token]
            emitted = 0
            for tok in block:
                generated.append(tok)
                emitted += 1
                if stopper.hit(generated):
                    finish = "stop"
                    break
            if n:
                stats.record_draft(n, min(accepted, emitted))
            if finish == "stop":
                break
            new = torch.tensor([block], dtype=torch.long, device=device)
            sequence = torch.cat([sequence, new], dim=1)
            if heuristic:
                k_schedule = k_schedule + 2 if accepted == k_schedule else max(1, k_schedule - 1)

        stats.new_tokens = len(generated)
        stats.finish_reason = finish
        stats.wall_time_s = time.perf_counter() - start
        text = self.tokenizer.decode(generated, skip_special_tokens=True) if self.tokenizer is not None else None
        return GenerationResult(token_ids=generated, text=text, finish_reason=finish, stats=stats)
