"""The tuner's confirmation runs: candidates measured on the first pilot rows as the actor
runs them, in interleaved rounds, each on a fresh engine warmed up outside the timed region;
the chosen candidate's token-tree variant, kept only when measured faster."""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable

from pipeline.engine import METHODS
from pipeline.engine.methods import PLAIN
from pipeline.tune.measure import measure_candidate
from pipeline.tune.predict import Candidate

#: a variant of the chosen candidate (its token trees) replaces it only when measured this much faster
VARIANT_MARGIN = 0.05


@dataclass
class Confirmation:
    """Confirmation runs: candidates decode the same first pilot rows as the actor would.

    Attributes:
        build: ``(choice, k, batch_size) -> engine``: a fresh engine of a candidate, warmed up
            (the tuner's: the draft-length controller on, ``k`` its cap).
        clock: the tuner's clock.
        choices: the methods' :class:`~pipeline.tune.tuner.MethodChoice`, by name.
        log: progress lines.
        prompts, settings: the confirmation rows and their generation settings.
        build_s: the seconds their prompts took to build (added to every round).
        reference: greedy outputs to compare with (``None`` when sampling).
    """

    build: Callable[[Any, int, int], Any]
    clock: Callable[[], float]
    choices: dict[str, Any]
    log: Callable[[str], None]
    prompts: list[list[int]] = field(default_factory=list)
    settings: list = field(default_factory=list)
    build_s: float = 0.0
    reference: list[list[int]] | None = None

    def run_rounds(self, cands: list[Candidate], rounds: int) -> None:
        """Measure ``cands`` in ``rounds`` interleaved rounds: round ``r`` runs them all, starting
        from the ``r``-th (mod their number), so that each candidate takes each place in turn
        and a drift of the machine's speed is shared out instead of landing on whichever ran
        last.  Each candidate's figures become the median of all its rounds so far."""
        for r in range(rounds):
            shift = r % max(1, len(cands))
            for cand in cands[shift:] + cands[:shift]:
                self.run(cand)

    def run(self, cand: Candidate) -> None:
        """One more round of ``cand`` (a fresh engine from :attr:`build`, warmed up outside the
        timed region, so nothing learnt in an earlier round carries over): appends its seconds
        to ``cand.round_s``, sets its measured figures to the median round, and its
        same-output count (greedy: every round must match)."""
        choice = dataclasses.replace(self.choices[cand.method], params=dict(cand.params))
        engine = self.build(choice, cand.k, cand.batch_size)
        seconds, results = measure_candidate(engine, self.prompts, self.settings, cand.batch_size,
                                             cand.rows_per_batch, self.clock)
        cand.round_s.append(seconds + self.build_s)
        cand.measured_s = statistics.median(cand.round_s)
        tokens = sum(r.stats.new_tokens for r in results if r.error is None)
        cand.measured_tokens_per_s = tokens / cand.measured_s
        if self.reference is not None:
            same = sum(r.token_ids == ref for r, ref in zip(results, self.reference))
            cand.compared_rows = len(self.reference)
            cand.same_output = same if cand.same_output is None else min(cand.same_output, same)
        predicted = cand.confirm_predicted_tokens_per_s
        self.log(f"confirm {cand.label} (round {len(cand.round_s)}): predicted "
                 f"{f'{predicted:.1f}' if predicted else '(not modelled)'}, measured {tokens / cand.round_s[-1]:.1f} "
                 f"tokens/s (median so far {cand.measured_tokens_per_s:.1f})")


#: the branches of the token-tree variant the tuner confirms (``method.num_candidates``)
TREE_CANDIDATES = 4


def tree_variant(chosen: Candidate, do_sample: bool) -> Candidate | None:
    """The chosen candidate with token trees of :data:`TREE_CANDIDATES` branches (the
    controller sizes them per step), when its method drafts trees and the job is greedy;
    else ``None``.  Not modelled: its prediction is the chosen one's scaled by the measured
    ratio (filled in by :func:`keep_variant`)."""
    if do_sample or chosen.method == PLAIN or not METHODS[chosen.method].proposes_trees:
        return None
    return Candidate(chosen.method, chosen.k, chosen.batch_size, chosen.rows_per_batch,
                     params={**chosen.params, "num_candidates": TREE_CANDIDATES})


def keep_variant(chosen: Candidate, variant: Candidate, notes: list[str], reference: Candidate) -> Candidate:
    """``variant`` when measured ``VARIANT_MARGIN`` faster than ``reference`` (``chosen``
    measured again in the variant's rounds), else ``chosen``."""
    scale = variant.measured_tokens_per_s / reference.measured_tokens_per_s
    variant.predicted_tokens_per_s = chosen.predicted_tokens_per_s * scale
    variant.predicted_s = chosen.predicted_s / scale
    if chosen.confirm_predicted_tokens_per_s:
        variant.confirm_predicted_tokens_per_s = chosen.confirm_predicted_tokens_per_s * scale
    again = f" (measured again in the same rounds: {reference.measured_tokens_per_s:.1f} tokens/s)"
    if scale > 1 + VARIANT_MARGIN:
        notes.append(f"{variant.label} measured {scale:.2f}x {chosen.label}{again}: chosen (its prediction is "
                     f"{chosen.label}'s scaled by that ratio)")
        return variant
    notes.append(f"{variant.label} measured no gain of {100 * VARIANT_MARGIN:.0f} % over {chosen.label}{again} "
                 f"({scale:.2f}x): left out")
    return chosen


__all__ = ["Confirmation", "tree_variant", "keep_variant", "TREE_CANDIDATES", "VARIANT_MARGIN"]
