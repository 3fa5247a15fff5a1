"""The tuner, top to bottom: choose the method, draft length and batch size of a job from a
pilot sample of its own input, on the configured hardware, and predict its speed.

    load the model pair (as an actor does, with the actor's CPU threads: pipeline.loading)
    -> read the pilot: the first N rows of the job's input, prompts built as the job builds them
    -> pilot runs: each method the models allow, over the pilot rows at its longest draft K
       (acceptance by draft position, new tokens, prefill; greedy outputs checked equal)
    -> profile: the target's verification cost t(n, B) for n = 1 .. K+1 and every batch
       size B; each proposer's cost and the loop's bookkeeping per step (real steps)
    -> predict every (method, k, B) (:mod:`pipeline.tune.predict`), rank them
    -> confirm the top candidates (and the best plain one) on the pilot rows, as the actor
       runs them, in interleaved rounds (each round runs every candidate once, the order
       rotated by one per round, so that a change of the machine's speed meets them all);
       the fastest median wins
    -> confirm the adaptive draft lengths of the winner against its fixed k the same way
       (the winner runs again in those rounds): the engine's draft length by expected gain
       up to K (greedy jobs), and a method's per-row schedule; one replaces the fixed k only
       when its median is ADAPTIVE_MARGIN faster
    -> the tuned config (the input config with ``method`` and ``compute`` filled in) and
       ``tune_report.md`` (:mod:`pipeline.tune.report`)

Times are seconds of one clock: ``wall`` (``time.perf_counter``) or ``cpu``
(``time.process_time``: the process's CPU time, steadier when other processes share the
CPU; with one torch thread it is what a dedicated core would take, so predictions and
measurements then mean "on a dedicated core").
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable


from pipeline.config import ConfigError, JobConfig, apply_overrides, read_yaml
from pipeline.engine import METHODS, SpeculationSettings, SpeculativeEngine
from pipeline.engine.methods import CONFIDENCE_FIELD, PLAIN, SCHEDULE_FIELD
from pipeline.engine.cost_model import reach_from_counts
from pipeline.engine.profile import EngineProfile, profile_engine
from pipeline.engine.cpu import prepare
from pipeline.loading import build_engine, generation_settings, limit_cpu_threads, load_job_models, process_cpus
from pipeline.paths import resolve_config_paths
from pipeline.tune.measure import PilotInput, PilotRun, measure_candidate, read_pilot, row_settings, run_pilot
from pipeline.tune.predict import (
    Candidate,
    MethodModel,
    PilotRow,
    calibrate,
    line_fit,
    predict_seconds,
    rank_candidates,
)

CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32)
#: the batch-size sweep stops where a plain pass costs this much more per row than at a smaller batch
BATCH_STOP_RATIO = 1.25
#: the per-row adaptive knobs off, so that every step drafts k (a candidate's own settings; the
#: adaptive ones are measured as variants of the chosen candidate): by knob, its fixed value
FIXED_DRAFT_LENGTH = {SCHEDULE_FIELD: "constant", CONFIDENCE_FIELD: 0.0}
#: transformers' default ``assistant_confidence_threshold``
CONFIDENCE_THRESHOLD = 0.4
#: an adaptive variant replaces the chosen fixed draft length only when measured this much faster
ADAPTIVE_MARGIN = 0.05
#: the corpus size the report states the tuning's share for (the issue's goal: under 10 %)
REFERENCE_ROWS = 10_000


@dataclass
class MethodChoice:
    """A method the configured models allow, with its parameters.

    Attributes:
        method: the method name.
        k_max: the longest draft tried (``K``).
        params: its other SpeculationSettings fields (kept in the tuned config).
    """

    method: str
    k_max: int = 0
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def k_param(self) -> str | None:
        """The SpeculationSettings field of its draft length (``None``: it drafts nothing)."""
        return METHODS[self.method].draft_length

    def speculation(self, k: int) -> SpeculationSettings:
        kw = dict(self.params)
        if self.k_param is not None:
            kw[self.k_param] = k
        return SpeculationSettings(method=self.method, **kw).validate()

    def method_section(self, k: int) -> dict[str, Any]:
        """The ``method:`` section of a job config for draft length ``k``."""
        section: dict[str, Any] = {"name": self.method}
        if self.k_param is not None:
            section[self.k_param] = k
        section.update(self.params)
        return section


@dataclass
class TuneOptions:
    """Settings of one tuning (the ``jobs/tune.py`` flags).

    Attributes:
        rows: pilot rows (the first rows of the input; at most 64 per method is the design).
        batch_sizes: batch sizes ``B`` to consider (capped by what a proposer can batch).
        methods: methods to consider (``None``: every one the models allow).
        max_draft: the longest draft ``K`` tried (``None``: 8 for model drafters, 10 for
            prompt lookup, or the config's if longer).
        pilot_batch_size: rows in flight in the pilot runs (acceptance does not depend on it).
        repeats: timings per profiled figure (median kept).
        confirm: top candidates confirmed on the pilot rows (the best plain one is added).
        confirm_rows: the first pilot rows a confirmation run decodes (short runs).
        confirm_rounds: interleaved rounds of confirmation runs; a candidate's measured
            figure is the median of its rounds (each round builds its engines afresh, so a
            job-wide suffix tree never learns the rows it is timed on).
        adaptive: also measure the chosen method with adaptive draft lengths: the engine's
            draft length by expected gain up to ``K`` (greedy jobs), and for a method with a
            per-row schedule transformers' heuristic schedule and a confidence threshold of
            0.4 at ``K``; keep one only when it is measured 5 % faster than the fixed ``k``.
        clock: ``wall`` or ``cpu`` (module docstring).
    """

    rows: int = 64
    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES
    methods: tuple[str, ...] | None = None
    max_draft: int | None = None
    pilot_batch_size: int = 8
    repeats: int = 3
    confirm: int = 3
    confirm_rows: int = 32
    confirm_rounds: int = 3
    adaptive: bool = True
    clock: str = "wall"


@dataclass
class TuneResult:
    """Everything the tuning measured and decided (the report reads it)."""

    config_path: str | None
    options: TuneOptions
    chosen: Candidate
    candidates: list[Candidate]
    confirmed: list[Candidate]
    models: list[MethodModel]
    choices: list[MethodChoice]
    pilots: dict[str, PilotRun]
    profiles: dict[str, EngineProfile]
    pilot: PilotInput
    pilot_rows: list[PilotRow]
    tuned_config: dict[str, Any]
    timings: dict[str, float]
    wall_timings: dict[str, float]
    machine: dict[str, Any]
    notes: list[str]
    num_actors: int = 1
    calibration: float = 1.0
    mismatches: dict[str, int] = field(default_factory=dict)
    #: the chosen fixed k measured again in the adaptive variants' rounds (what they were compared with)
    adaptive_reference: Candidate | None = None

    @property
    def seconds_per_row(self) -> float:
        """The chosen candidate's predicted seconds per row (one actor)."""
        return self.chosen.predicted_s / max(1, len(self.pilot_rows))

    def estimated_run_s(self, rows: int | None = None) -> float:
        """Predicted seconds of the whole run (``rows``: default the input's) with the tuned
        config, its actors working in parallel."""
        rows = self.pilot.corpus_rows if rows is None else rows
        return self.seconds_per_row * rows / max(1, self.num_actors)

    def baseline(self) -> Candidate | None:
        """The best plain candidate (confirmed when it could be)."""
        plain = [c for c in self.confirmed if c.method == PLAIN] or [c for c in self.candidates if c.method == PLAIN]
        return plain[0] if plain else None


def allowed_methods(cfg: JobConfig, loaded, options: TuneOptions) -> tuple[list[MethodChoice], list[str]]:
    """The methods the configured models allow, and notes on the ones left out.

    Each method of the table decides from its spec
    (:meth:`pipeline.engine.methods.MethodSpec.candidate_params`): plain decoding and the
    methods that need nothing the models may lack always; a model drafter when
    ``models.drafter`` fits it; a method that drafts from the target's own layers when the
    target names them; any other only when the config's method is that one.  Each is tried
    at draft lengths 1 .. ``K`` (``--max-draft``, else the method's default longest draft,
    or the config's when longer) with its per-row adaptive knobs off.
    """
    notes: list[str] = []
    spec = cfg.method.speculation_settings()
    out: list[MethodChoice] = []
    for method in METHODS.values():
        try:
            params = method.candidate_params(spec, loaded)
        except ValueError as e:
            notes.append(f"{method.name} left out: {e}")
            continue
        if params is None:
            continue
        fixed = {k: v for k, v in FIXED_DRAFT_LENGTH.items()
                 if (k == SCHEDULE_FIELD and method.adaptive) or k in method.params}
        k_max = 0
        if method.draft_length is not None:
            k_max = options.max_draft or max(method.tune_k_max or 0, getattr(spec, method.draft_length))
        out.append(MethodChoice(method.name, k_max, {**params, **fixed}))
    if options.methods:
        known = {c.method for c in out}
        unknown = [m for m in options.methods if m not in known]
        if unknown:
            raise ConfigError(f"--methods {', '.join(unknown)}: not allowed by the configured models "
                              f"(allowed: {', '.join(sorted(known))})")
        out = [c for c in out if c.method in options.methods]
    return out, notes


def _engine(choice: MethodChoice, k: int, batch_size: int, loaded, clock, adaptive: bool = False) -> SpeculativeEngine:
    """The engine of a candidate, built as the job builds its own (:func:`pipeline.loading.build_engine`),
    with a fixed draft length (every step drafts ``k``), or with ``adaptive`` the engine's draft
    length by expected gain up to ``k``."""
    return build_engine(loaded, choice.speculation(k), batch_size, draft_length="auto" if adaptive else "fixed",
                        clock=clock)


def _method_model(choice: MethodChoice, pilot: PilotRun | None, profile: EngineProfile,
                  target_grid: dict[int, dict[int, float]], hooked: bool, max_rows: int | None) -> MethodModel:
    """A :class:`MethodModel` from a method's pilot run and profile (plain: no pilot needed)."""
    m = MethodModel(choice.method, k_max=choice.k_max, admit_s_per_token=profile.admit_s_per_token,
                    max_rows=max_rows, params=dict(choice.params))
    by_rows: dict[int, list] = {}
    for s in profile.steps:
        by_rows.setdefault(s.rows, []).append(s)
    m.verify = target_grid
    if choice.method != PLAIN and pilot is not None:
        steps = pilot.stats.verify_steps
        m.reach = reach_from_counts(pilot.stats.accepted_per_position, steps)[: choice.k_max]
        m.draft_rate = pilot.stats.draft_steps / steps if steps else 0.0
        m.propose = {b: line_fit([(s.k, s.propose_s) for s in ss]) for b, ss in by_rows.items()}
        if hooked:  # the method verifies through its own hook: its measured passes, n = 1 from the target's
            m.verify = {b: {1: target_grid[b][1], **{s.width: s.verify_s for s in ss}} for b, ss in by_rows.items()}
    m.overhead = {b: sum(s.overhead_s for s in ss) / len(ss) for b, ss in by_rows.items()}
    return m


def tune(cfg: JobConfig, options: TuneOptions | None = None, *, raw_config: dict[str, Any] | None = None,
         config_path: str | None = None, log: Callable[[str], None] = print) -> TuneResult:
    """Tune ``cfg`` (see the module docstring).

    Args:
        cfg: the validated job config.
        options: :class:`TuneOptions`.
        raw_config: the config as written (YAML data, overrides applied): the tuned config
            keeps it and fills in ``method`` and ``compute`` (default: ``cfg`` dumped).
        config_path: named in the report.
        log: progress lines.

    Returns:
        A :class:`TuneResult` (nothing written; see :func:`pipeline.tune.report.write_outputs`).

    Raises:
        ConfigError, InputError, ModelError: a bad config, input or model path (before
            anything is measured).
        ValueError: no pilot row makes a usable prompt.
    """
    import torch

    from pipeline.models import check_models

    options = options or TuneOptions()
    if options.clock not in CLOCKS:
        raise ConfigError(f"clock must be one of {', '.join(CLOCKS)}, got {options.clock!r}")
    if min(options.rows, options.repeats, options.pilot_batch_size, options.confirm_rows,
           options.confirm_rounds) < 1 or options.confirm < 0:
        raise ConfigError("--rows, --repeats, --pilot-batch-size, --confirm-rows and --confirm-rounds must be >= 1 "
                          "and --confirm >= 0")
    if not options.batch_sizes or any(b < 1 for b in options.batch_sizes):
        raise ConfigError(f"batch sizes must be positive integers, got {list(options.batch_sizes)}")
    clock = CLOCKS[options.clock]
    timings: dict[str, float] = {}
    wall_timings: dict[str, float] = {}
    start, wall_start = clock(), time.perf_counter()
    mark = [start, wall_start]

    def stage(name: str) -> None:
        now, wall = clock(), time.perf_counter()
        timings[name], wall_timings[name] = now - mark[0], wall - mark[1]
        mark[0], mark[1] = now, wall

    machine = {"cpu_count": os.cpu_count(), "load_average_start": _load(), "clock": options.clock}
    # a bad path fails before any weights load; the pair is each method's to judge (allowed_methods)
    check_models(cfg.models, bool(cfg.models.drafter), method=cfg.method.name, pair=False)
    limit_cpu_threads(process_cpus(cfg))  # the actor's threads
    loaded = load_job_models(cfg, any_drafter=True)  # every method the models allow is tried
    prepare(loaded.target, cfg.cpu.cpu_options(), "target")  # the job's CPU parts; every engine below keeps them
    machine.update(device=loaded.device, torch_threads=torch.get_num_threads(), torch=torch.__version__)
    choices, notes = allowed_methods(cfg, loaded, options)
    generation = generation_settings(cfg, loaded.target)
    plain_engine = _engine(MethodChoice(PLAIN), 0, max(options.batch_sizes), loaded, clock)
    stage("load")

    pilot = read_pilot(cfg, loaded.tokenizer, options.rows, plain_engine.context, clock)
    settings = row_settings(generation, pilot.keys)
    log(f"pilot: {len(pilot.prompts)} rows ({len(pilot.skipped)} of the first {options.rows} would be error rows); "
        f"input: {pilot.corpus_rows} rows")
    engines: dict[str, SpeculativeEngine] = {}
    pilots: dict[str, PilotRun] = {}
    for choice in [c for c in choices if c.method != PLAIN]:
        try:
            engines[choice.method] = _engine(choice, choice.k_max, options.pilot_batch_size, loaded, clock)
        except ValueError as e:
            notes.append(f"{choice.method} left out: {e}")
            continue
        p = pilots[choice.method] = run_pilot(engines[choice.method], pilot.prompts, settings,
                                              options.pilot_batch_size, clock)
        log(f"pilot {choice.method} k={choice.k_max}: {p.stats.new_tokens} tokens in {p.seconds:.1f} s, "
            f"acceptance {p.stats.accepted_tokens}/{p.stats.draft_tokens}")
    choices = [c for c in choices if c.method == PLAIN or c.method in pilots]
    if not choices:
        raise ConfigError("no method to tune: " + "; ".join(notes))
    if not pilots:
        pilots[PLAIN] = run_pilot(plain_engine, pilot.prompts, settings, options.pilot_batch_size, clock)
    runs = list(pilots.values())
    reference = runs[0].results
    mismatches = {} if generation.do_sample else _mismatches(pilots, notes)
    ok = [i for i in range(len(pilot.prompts)) if all(r.results[i].error is None for r in runs)]
    rows = _pilot_rows(pilot, runs, ok)
    stage("pilot")

    k_top = max([c.k_max for c in choices] + [1])
    prompts = [pilot.prompts[i] + reference[i].token_ids[: len(reference[i].token_ids) // 2] for i in ok]
    prompts = prompts[: max(options.batch_sizes)]  # mid-generation contexts
    log(f"profile: target t(n, B) for n = 1..{k_top + 1}, B in {list(options.batch_sizes)}")
    profiles = {PLAIN: profile_engine(plain_engine, prompts, list(options.batch_sizes),
                                        widths=list(range(1, k_top + 2)), repeats=options.repeats, settings=generation,
                                        stop_ratio=BATCH_STOP_RATIO)}
    plain_engine = None  # its caches (max(B) rows) are not needed any more
    grid = profiles[PLAIN].verify_s
    sizes = sorted(grid)
    notes += _pruned_note(grid, options.batch_sizes)
    models = [_method_model(MethodChoice(PLAIN), None, profiles[PLAIN], grid, False, None)]
    for choice in choices:
        if choice.method == PLAIN:
            continue
        engine = engines.pop(choice.method)  # dropped after its profile, with its caches
        ks = sorted({1, math.ceil(choice.k_max / 2), choice.k_max})
        log(f"profile: {choice.method}, k in {ks}")
        profiles[choice.method] = profile_engine(engine, prompts, sizes, draft_lengths=ks,
                                                 repeats=options.repeats, settings=generation)
        models.append(_method_model(choice, pilots[choice.method], profiles[choice.method], grid,
                                    engine.uses_target_hook, METHODS[choice.method].max_rows))
    if not any(c.method == PLAIN for c in choices):
        models = models[1:]
    stage("profile")

    candidates = rank_candidates(models, rows, sizes, cfg.compute.rows_per_batch)
    by_model = {m.method: m for m in models}
    build_s = sum(pilot.build_s[i] for i in ok)
    factor = calibrate(candidates,
                       sum(predict_seconds(by_model[r.method], rows, r.k, r.batch_size, len(rows)) for r in runs),
                       sum(r.seconds + build_s for r in runs))
    log(f"calibration: the pilot runs took {factor:.2f}x the model's prediction")
    stage("predict")

    subset = ok[: options.confirm_rows]
    bench = _Confirmation(loaded, clock, {c.method: c for c in choices}, [pilot.prompts[i] for i in subset],
                          [settings[i] for i in subset], sum(pilot.build_s[i] for i in subset),
                          None if generation.do_sample else [reference[i].token_ids for i in subset], log)
    confirmed = candidates[: options.confirm]
    plain = next((c for c in candidates if c.method == PLAIN), None)
    if plain is not None and plain not in confirmed:
        confirmed.append(plain)
    part = rows[: len(subset)]
    for cand in confirmed:
        cand.confirm_predicted_tokens_per_s = sum(r.new_tokens for r in part) / (
            factor * predict_seconds(by_model[cand.method], part, cand.k, cand.batch_size, cand.rows_per_batch))
    bench.run_rounds(confirmed, options.confirm_rounds)
    chosen = max(confirmed, key=lambda c: c.measured_tokens_per_s or 0.0) if confirmed else candidates[0]
    again = None
    if options.adaptive and chosen.method != PLAIN and chosen.measured_tokens_per_s:
        variants = _adaptive_variants(chosen, bench.choices[chosen.method].k_max, generation.do_sample)
        # the fixed k again, in the variants' rounds (a copy: the chosen keeps the figures it was chosen by)
        again = dataclasses.replace(chosen, round_s=[], same_output=None, compared_rows=None)
        bench.run_rounds([again] + variants, options.confirm_rounds)
        confirmed += variants
        chosen = _keep_adaptive(chosen, variants, notes, reference=again)
    stage("confirm")

    raw = copy.deepcopy(raw_config) if raw_config is not None else cfg.model_dump(mode="json")
    tuned = tuned_config(raw, dataclasses.replace(bench.choices[chosen.method], params=dict(chosen.params)), chosen)
    timings["total"] = clock() - start
    wall_timings["total"] = time.perf_counter() - wall_start
    machine["load_average_end"] = _load()
    return TuneResult(config_path=config_path, options=options, chosen=chosen, candidates=candidates,
                      confirmed=confirmed, models=models, choices=choices, pilots=pilots, profiles=profiles,
                      pilot=pilot, pilot_rows=rows, tuned_config=tuned, timings=timings, wall_timings=wall_timings,
                      machine=machine, notes=notes, num_actors=cfg.compute.num_actors, calibration=factor,
                      mismatches=mismatches, adaptive_reference=again)


def _mismatches(pilots: dict[str, PilotRun], notes: list[str]) -> dict[str, int]:
    """Rows of each pilot run whose greedy output differs from the first run's."""
    first = next(iter(pilots.values()))
    out = {}
    for name, run in pilots.items():
        out[name] = sum(a.token_ids != b.token_ids for a, b in zip(run.results, first.results))
        if out[name]:
            notes.append(f"pilot {name}: {out[name]} rows differ from {first.method}'s greedy output "
                         "(float near-ties, or a bug)")
    return out


def _pilot_rows(pilot: PilotInput, runs: list[PilotRun], ok: list[int]) -> list[PilotRow]:
    """The pilot rows every run decoded, as the prediction sees them (means over the runs)."""
    rows = [PilotRow(prompt_tokens=len(pilot.prompts[i]),
                     new_tokens=sum(r.results[i].stats.new_tokens for r in runs) / len(runs),
                     prefill_s=sum(r.results[i].stats.prefill_time_s for r in runs) / len(runs),
                     outside_s=pilot.build_s[i] + sum(r.outside_s_per_row for r in runs) / len(runs))
            for i in ok]
    if not rows:
        raise ValueError("every pilot row failed in the engine: " + str(runs[0].results[0].error))
    return rows


def _pruned_note(grid: dict[int, dict[int, float]], asked) -> list[str]:
    sizes = sorted(grid)
    skipped = sorted(set(asked) - set(sizes))
    if not skipped:
        return []
    b, prev = sizes[-1], min(sizes[:-1], key=lambda x: grid[x][1] / x)
    return [f"batch sizes {skipped} not profiled: at B = {b} a plain pass costs {1e3 * grid[b][1] / b:.2f} ms per "
            f"row, over {BATCH_STOP_RATIO}x the {1e3 * grid[prev][1] / prev:.2f} ms at B = {prev} (batching stops "
            "paying)"]


@dataclass
class _Confirmation:
    """Confirmation runs: candidates decode the same first pilot rows as the actor would."""

    loaded: Any
    clock: Callable[[], float]
    choices: dict[str, MethodChoice]
    prompts: list[list[int]]
    settings: list
    build_s: float
    reference: list[list[int]] | None  # greedy outputs to compare with (None when sampling)
    log: Callable[[str], None]

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
        """One more round of ``cand`` (a fresh engine, so nothing learnt in an earlier round
        carries over): appends its seconds to ``cand.round_s``, sets its measured figures to
        the median round, and its same-output count (greedy: every round must match)."""
        choice = dataclasses.replace(self.choices[cand.method], params=dict(cand.params))
        engine = _engine(choice, cand.k, cand.batch_size, self.loaded, self.clock, cand.adaptive_draft_length)
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


def _adaptive_variants(chosen: Candidate, k_max: int, do_sample: bool = False) -> list[Candidate]:
    """Adaptive draft lengths of the chosen method, to confirm against its fixed ``k``: the
    engine's draft length by expected gain up to ``K`` (greedy jobs: the job applies it to
    greedy rows only), and for a method that drafts token trees the same with trees of
    ``TREE_CANDIDATES`` branches, sized per row by expected gain; for a method with a per-row
    schedule, transformers' heuristic
    schedule from its k, and (for a method that takes it) a confidence threshold at ``K``.
    Not modelled: their prediction is the chosen one's scaled by the measured ratio (filled
    in by :func:`_keep_adaptive`)."""
    out = []
    if not do_sample:
        out.append(Candidate(chosen.method, k_max, chosen.batch_size, chosen.rows_per_batch, params=dict(chosen.params),
                             adaptive_draft_length=True))
        if METHODS[chosen.method].proposes_trees:  # token trees: greedy rows only
            out.append(Candidate(chosen.method, k_max, chosen.batch_size, chosen.rows_per_batch,
                                 params={**chosen.params, "num_candidates": TREE_CANDIDATES}, adaptive_draft_length=True))
    knobs = [(chosen.k, {SCHEDULE_FIELD: "heuristic"})] if METHODS[chosen.method].adaptive else []
    if CONFIDENCE_FIELD in METHODS[chosen.method].params:
        knobs.append((k_max, {CONFIDENCE_FIELD: CONFIDENCE_THRESHOLD}))
    return out + [Candidate(chosen.method, k, chosen.batch_size, chosen.rows_per_batch, params={**chosen.params, **extra})
                  for k, extra in knobs]


def _keep_adaptive(chosen: Candidate, variants: list[Candidate], notes: list[str], reference: Candidate) -> Candidate:
    """The measured variant when it is ``ADAPTIVE_MARGIN`` faster than ``reference`` (``chosen``
    measured again in the variants' rounds), else ``chosen``."""
    for v in variants:
        scale = v.measured_tokens_per_s / reference.measured_tokens_per_s
        v.predicted_tokens_per_s = chosen.predicted_tokens_per_s * scale
        v.predicted_s = chosen.predicted_s / scale
        if chosen.confirm_predicted_tokens_per_s:
            v.confirm_predicted_tokens_per_s = chosen.confirm_predicted_tokens_per_s * scale
    best = max(variants, key=lambda v: v.measured_tokens_per_s)
    ratio = best.measured_tokens_per_s / reference.measured_tokens_per_s
    again = f" (measured again in the same rounds: {reference.measured_tokens_per_s:.1f} tokens/s)"
    if ratio > 1 + ADAPTIVE_MARGIN:
        notes.append(f"{best.label} measured {ratio:.2f}x {chosen.label}{again}: chosen (its prediction is "
                     f"{chosen.label}'s scaled by that ratio)")
        return best
    tried = "; ".join(v.label for v in variants)
    notes.append(f"adaptive draft lengths ({tried}) measured no gain of {100 * ADAPTIVE_MARGIN:.0f} % over "
                 f"{chosen.label}{again} (best {ratio:.2f}x): left out")
    return chosen


def tuned_config(raw: dict[str, Any], choice: MethodChoice, chosen: Candidate) -> dict[str, Any]:
    """The input config (as written) with ``method`` replaced by the chosen one and
    ``compute`` given its batch size, rows per batch and its draft length: fixed, or by
    expected gain up to ``k`` when the confirmation chose that.

    Raises:
        ConfigError: the result does not validate (a bug: it is checked before it is written).
    """
    out = copy.deepcopy(raw)
    out["method"] = choice.method_section(chosen.k)
    compute = dict(out.get("compute") or {})
    compute.update(max_batch_size=chosen.batch_size, rows_per_batch=chosen.rows_per_batch,
                   draft_length="auto" if chosen.adaptive_draft_length else "fixed")
    out["compute"] = compute
    from pydantic import ValidationError

    try:
        JobConfig.model_validate(copy.deepcopy(out))
    except ValidationError as e:
        raise ConfigError(f"the tuned config does not validate: {e}") from None
    return out


def read_raw_config(path: str | None, overrides: list[str] | None) -> dict[str, Any]:
    """The config file's YAML data with ``--set`` overrides applied (what the tuned config keeps),
    its relative paths made absolute against the file's folder (the tuned config is written
    elsewhere)."""
    data: dict[str, Any] = {}
    if path is not None:
        loaded = read_yaml(Path(path).read_text())
        data = resolve_config_paths(loaded, Path(path).parent) if isinstance(loaded, dict) else {}
    return apply_overrides(data, overrides)


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


__all__ = ["tune", "TuneOptions", "TuneResult", "MethodChoice", "allowed_methods", "tuned_config",
           "read_raw_config", "CLOCKS", "DEFAULT_BATCH_SIZES", "REFERENCE_ROWS"]
