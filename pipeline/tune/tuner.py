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
       runs them: the draft-length controller on (``compute.draft_length: auto``, the job's
       default), a candidate's k its cap; in interleaved rounds (each round runs every
       candidate once, the order rotated by one per round, so that a change of the
       machine's speed meets them all); the fastest median wins
    -> confirm the winner's token trees (a method that drafts them, greedy jobs) against it
       the same way (the winner runs again in those rounds); they replace it only when
       their median is VARIANT_MARGIN faster
    -> the tuned config (the input config with ``method`` and ``compute`` filled in) and
       ``tune_report.md`` (:mod:`pipeline.tune.report`)

Every measured engine is fresh and warmed up (:meth:`SpeculativeEngine.warm_up`, the job's
generation settings, its rows in flight) outside the timed region, as an actor's is at start.
The pilot and the profile run a fixed draft length (every row drafts ``k``: the acceptance by
draft position and the costs the prediction needs); the tuner chooses the method, the rows
in flight and the cap ``k`` on the draft length, not whether the controller runs.

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
from pipeline.loading import build_engine, limit_cpu_threads, load_job_models, process_cpus, resolve_job_generation
from pipeline.paths import resolve_config_paths
from pipeline.tune.confirm import TREE_CANDIDATES, VARIANT_MARGIN, Confirmation, keep_variant, tree_variant
from pipeline.tune.measure import PilotInput, PilotRun, read_pilot, row_settings, run_pilot
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
#: transformers' per-row draft-length knobs off (the draft-length controller decides instead;
#: the pilot needs every step to draft k): by knob, its fixed value
FIXED_DRAFT_LENGTH = {SCHEDULE_FIELD: "constant", CONFIDENCE_FIELD: 0.0}
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
        return METHODS[self.method].k_param

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
        trees: also measure the chosen method with token trees of :data:`TREE_CANDIDATES`
            branches (a method that drafts them, greedy jobs), kept only when measured
            :data:`VARIANT_MARGIN` faster (:mod:`pipeline.tune.confirm`).
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
    trees: bool = True
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
    #: the chosen candidate measured again in its token-tree variant's rounds (what that was compared with)
    variant_reference: Candidate | None = None

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
    or the config's when longer) with transformers' per-row draft-length knobs off.
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
                 if (k == SCHEDULE_FIELD and method.adaptive) or k in method.param_names}
        k_max = 0
        if method.k_param is not None:
            k_max = options.max_draft or max(method.tune_k_max or 0, getattr(spec, method.k_param))
        out.append(MethodChoice(method.name, k_max, {**params, **fixed}))
    if options.methods:
        known = {c.method for c in out}
        unknown = [m for m in options.methods if m not in known]
        if unknown:
            raise ConfigError(f"--methods {', '.join(unknown)}: not allowed by the configured models "
                              f"(allowed: {', '.join(sorted(known))})")
        out = [c for c in out if c.method in options.methods]
    return out, notes


def _engine(choice: MethodChoice, k: int, batch_size: int, loaded, clock, draft_length: str = "auto") -> SpeculativeEngine:
    """The engine of a candidate, built as the job builds its own (:func:`pipeline.loading.build_engine`):
    the draft-length controller with cap ``k`` (``"auto"``, the job's default), or every step
    drafting ``k`` (``"fixed"``: the pilot's and the profile's)."""
    return build_engine(loaded, choice.speculation(k), batch_size, draft_length=draft_length, clock=clock)


def _warmed(engine: SpeculativeEngine, batch_size: int, generation) -> SpeculativeEngine:
    """``engine`` warmed up outside any timed region as an actor's is at start: synthetic rows
    at every number of rows in flight up to ``batch_size``, with the job's generation
    settings (:meth:`SpeculativeEngine.warm_up`, which then forgets what its rows taught)."""
    engine.warm_up(batch_size, settings=generation)
    return engine


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


@dataclass
class _Clocks:
    """The tuning's stage timer: seconds of the tuner's clock and of the wall per stage."""

    clock: Callable[[], float]
    timings: dict[str, float] = field(default_factory=dict)
    wall_timings: dict[str, float] = field(default_factory=dict)

    def __post_init__(self):
        self.start, self.wall_start = self.clock(), time.perf_counter()
        self._mark = [self.start, self.wall_start]

    def stage(self, name: str) -> None:
        now, wall = self.clock(), time.perf_counter()
        self.timings[name], self.wall_timings[name] = now - self._mark[0], wall - self._mark[1]
        self._mark = [now, wall]

    def total(self) -> None:
        self.timings["total"] = self.clock() - self.start
        self.wall_timings["total"] = time.perf_counter() - self.wall_start


@dataclass
class _Pilot:
    """What the pilot phase measured (the input of the profile and the prediction)."""

    pilot: PilotInput
    settings: list
    engines: dict[str, SpeculativeEngine]
    pilots: dict[str, PilotRun]
    choices: list[MethodChoice]
    mismatches: dict[str, int]
    ok: list[int]
    rows: list[PilotRow]

    @property
    def reference(self) -> list:
        return next(iter(self.pilots.values())).results


def check_options(options: TuneOptions) -> None:
    """Refuse options no tuning can run with.

    Raises:
        ConfigError: an unknown clock, a count below 1, no batch size or a batch size below 1.
    """
    if options.clock not in CLOCKS:
        raise ConfigError(f"clock must be one of {', '.join(CLOCKS)}, got {options.clock!r}")
    if min(options.rows, options.repeats, options.pilot_batch_size, options.confirm_rows,
           options.confirm_rounds) < 1 or options.confirm < 0:
        raise ConfigError("--rows, --repeats, --pilot-batch-size, --confirm-rows and --confirm-rounds must be >= 1 "
                          "and --confirm >= 0")
    if not options.batch_sizes or any(b < 1 for b in options.batch_sizes):
        raise ConfigError(f"batch sizes must be positive integers, got {list(options.batch_sizes)}")


def tune(cfg: JobConfig, options: TuneOptions | None = None, *, raw_config: dict[str, Any] | None = None,
         config_path: str | None = None, log: Callable[[str], None] = print) -> TuneResult:
    """Tune ``cfg`` (see the module docstring): load, pilot, profile, predict, confirm.

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
    options = options or TuneOptions()
    check_options(options)
    clock = CLOCKS[options.clock]
    clocks = _Clocks(clock)
    machine = {"cpu_count": os.cpu_count(), "load_average_start": _load(), "clock": options.clock}
    loaded, choices, notes, plain_engine = _load_models(cfg, options, clock, machine)
    generation = resolve_job_generation(cfg, loaded.target.config)
    clocks.stage("load")
    run = _pilot_phase(cfg, options, loaded, choices, plain_engine, generation, clock, notes, log)
    clocks.stage("pilot")
    profiles, models, sizes = _profile_phase(options, run, plain_engine, generation, notes, log)
    del plain_engine  # its caches (max(B) rows) are not needed any more
    clocks.stage("profile")
    candidates, factor = _predict_phase(cfg, run, models, sizes, log)
    clocks.stage("predict")

    def build(choice: MethodChoice, k: int, batch_size: int) -> SpeculativeEngine:
        return _warmed(_engine(choice, k, batch_size, loaded, clock), batch_size, generation)

    bench = Confirmation(build, clock, {c.method: c for c in run.choices}, log)
    confirmed, chosen, again = _confirm_phase(options, run, bench, candidates, models, factor, notes,
                                              generation.do_sample)
    clocks.stage("confirm")
    raw = copy.deepcopy(raw_config) if raw_config is not None else cfg.model_dump(mode="json")
    tuned = tuned_config(raw, dataclasses.replace(bench.choices[chosen.method], params=dict(chosen.params)), chosen)
    clocks.total()
    machine["load_average_end"] = _load()
    return TuneResult(config_path=config_path, options=options, chosen=chosen, candidates=candidates,
                      confirmed=confirmed, models=models, choices=run.choices, pilots=run.pilots, profiles=profiles,
                      pilot=run.pilot, pilot_rows=run.rows, tuned_config=tuned, timings=clocks.timings,
                      wall_timings=clocks.wall_timings, machine=machine, notes=notes,
                      num_actors=cfg.compute.num_actors, calibration=factor, mismatches=run.mismatches,
                      variant_reference=again)


def _load_models(cfg: JobConfig, options: TuneOptions, clock, machine: dict[str, Any]):
    """Load the models as an actor does: ``(loaded, choices, notes, plain engine)`` (the plain
    engine at the largest batch size, warmed up)."""
    import torch

    from pipeline.models import check_models

    # a bad path fails before any weights load; the pair is each method's to judge (allowed_methods)
    check_models(cfg.models, bool(cfg.models.drafter), method=cfg.method.name, pair=False)
    limit_cpu_threads(process_cpus(cfg))  # the actor's threads
    loaded = load_job_models(cfg, any_drafter=True)  # every method the models allow is tried
    prepare(loaded.target, cfg.cpu.cpu_options(), "target")  # the job's CPU parts; every engine below keeps them
    machine.update(device=loaded.device, torch_threads=torch.get_num_threads(), torch=torch.__version__)
    choices, notes = allowed_methods(cfg, loaded, options)
    plain_engine = _engine(MethodChoice(PLAIN), 0, max(options.batch_sizes), loaded, clock)
    _warmed(plain_engine, max(options.batch_sizes), resolve_job_generation(cfg, loaded.target.config))
    return loaded, choices, notes, plain_engine


def _pilot_phase(cfg: JobConfig, options: TuneOptions, loaded, choices: list[MethodChoice], plain_engine,
                 generation, clock, notes: list[str], log) -> _Pilot:
    """Each method over the pilot rows at its longest draft ``K``, every row drafting ``K``
    (``draft_length="fixed"``: the acceptance by position the prediction needs), on an
    engine warmed up first; greedy outputs compared."""
    pilot = read_pilot(cfg, loaded.tokenizer, options.rows, plain_engine.context, clock)
    settings = row_settings(generation, pilot.keys)
    log(f"pilot: {len(pilot.prompts)} rows ({len(pilot.skipped)} of the first {options.rows} would be error rows); "
        f"input: {pilot.corpus_rows} rows")
    engines: dict[str, SpeculativeEngine] = {}
    pilots: dict[str, PilotRun] = {}
    for choice in [c for c in choices if c.method != PLAIN]:
        try:
            engine = _engine(choice, choice.k_max, options.pilot_batch_size, loaded, clock, draft_length="fixed")
        except ValueError as e:
            notes.append(f"{choice.method} left out: {e}")
            continue
        engines[choice.method] = _warmed(engine, options.pilot_batch_size, generation)
        p = pilots[choice.method] = run_pilot(engine, pilot.prompts, settings, options.pilot_batch_size, clock)
        log(f"pilot {choice.method} k={choice.k_max}: {p.stats.new_tokens} tokens in {p.seconds:.1f} s, "
            f"acceptance {p.stats.accepted_tokens}/{p.stats.draft_tokens}")
    choices = [c for c in choices if c.method == PLAIN or c.method in pilots]
    if not choices:
        raise ConfigError("no method to tune: " + "; ".join(notes))
    if not pilots:
        pilots[PLAIN] = run_pilot(plain_engine, pilot.prompts, settings, options.pilot_batch_size, clock)
    runs = list(pilots.values())
    mismatches = {} if generation.do_sample else _mismatches(pilots, notes)
    ok = [i for i in range(len(pilot.prompts)) if all(r.results[i].error is None for r in runs)]
    return _Pilot(pilot, settings, engines, pilots, choices, mismatches, ok, _pilot_rows(pilot, runs, ok))


def _profile_phase(options: TuneOptions, run: _Pilot, plain_engine, generation, notes: list[str], log):
    """The target's verification cost ``t(n, B)`` (the plain engine, warmed up first) and each
    method's proposer and bookkeeping (its pilot engine): ``(profiles, models, batch sizes)``."""
    k_top = max([c.k_max for c in run.choices] + [1])
    reference = run.reference
    prompts = [run.pilot.prompts[i] + reference[i].token_ids[: len(reference[i].token_ids) // 2] for i in run.ok]
    prompts = prompts[: max(options.batch_sizes)]  # mid-generation contexts
    log(f"profile: target t(n, B) for n = 1..{k_top + 1}, B in {list(options.batch_sizes)}")
    profiles = {PLAIN: profile_engine(plain_engine, prompts, list(options.batch_sizes),
                                      widths=list(range(1, k_top + 2)), repeats=options.repeats, settings=generation,
                                      stop_ratio=BATCH_STOP_RATIO)}
    grid = profiles[PLAIN].verify_s
    sizes = sorted(grid)
    notes += _pruned_note(grid, options.batch_sizes)
    models = [_method_model(MethodChoice(PLAIN), None, profiles[PLAIN], grid, False, None)]
    for choice in run.choices:
        if choice.method == PLAIN:
            continue
        engine = run.engines.pop(choice.method)  # dropped after its profile, with its caches
        ks = sorted({1, math.ceil(choice.k_max / 2), choice.k_max})
        log(f"profile: {choice.method}, k in {ks}")
        profiles[choice.method] = profile_engine(engine, prompts, sizes, ks=ks,
                                                 repeats=options.repeats, settings=generation)
        models.append(_method_model(choice, run.pilots[choice.method], profiles[choice.method], grid,
                                    engine.uses_target_hook, METHODS[choice.method].max_rows))
    if not any(c.method == PLAIN for c in run.choices):
        models = models[1:]
    return profiles, models, sizes


def _predict_phase(cfg: JobConfig, run: _Pilot, models: list[MethodModel], sizes: list[int], log):
    """Every (method, k, B) predicted and ranked, calibrated against the pilot runs' measured
    time: ``(candidates, calibration factor)``."""
    candidates = rank_candidates(models, run.rows, sizes, cfg.compute.rows_per_batch)
    by_model = {m.method: m for m in models}
    build_s = sum(run.pilot.build_s[i] for i in run.ok)
    runs = list(run.pilots.values())
    factor = calibrate(candidates,
                       sum(predict_seconds(by_model[r.method], run.rows, r.k, r.batch_size, len(run.rows))
                           for r in runs),
                       sum(r.seconds + build_s for r in runs))
    log(f"calibration: the pilot runs took {factor:.2f}x the model's prediction")
    return candidates, factor


def _confirm_phase(options: TuneOptions, run: _Pilot, bench: Confirmation, candidates: list[Candidate],
                   models: list[MethodModel], factor: float, notes: list[str], do_sample: bool):
    """The top candidates (and the best plain one) measured on the first pilot rows with the
    draft-length controller on, in interleaved rounds; then the winner's token trees against
    it: ``(confirmed, chosen, the winner measured again in the variant's rounds)``."""
    subset = run.ok[: options.confirm_rows]
    bench.prompts = [run.pilot.prompts[i] for i in subset]
    bench.settings = [run.settings[i] for i in subset]
    bench.build_s = sum(run.pilot.build_s[i] for i in subset)
    bench.reference = None if do_sample else [run.reference[i].token_ids for i in subset]
    confirmed = candidates[: options.confirm]
    plain = next((c for c in candidates if c.method == PLAIN), None)
    if plain is not None and plain not in confirmed:
        confirmed.append(plain)
    part = run.rows[: len(subset)]
    by_model = {m.method: m for m in models}
    for cand in confirmed:
        cand.confirm_predicted_tokens_per_s = sum(r.new_tokens for r in part) / (
            factor * predict_seconds(by_model[cand.method], part, cand.k, cand.batch_size, cand.rows_per_batch))
    bench.run_rounds(confirmed, options.confirm_rounds)
    chosen = max(confirmed, key=lambda c: c.measured_tokens_per_s or 0.0) if confirmed else candidates[0]
    again = None
    trees = tree_variant(chosen, do_sample) if options.trees and chosen.measured_tokens_per_s else None
    if trees is not None:
        # the chosen again, in the variant's rounds (a copy: the chosen keeps the figures it was chosen by)
        again = dataclasses.replace(chosen, round_s=[], same_output=None, compared_rows=None)
        bench.run_rounds([again, trees], options.confirm_rounds)
        confirmed.append(trees)
        chosen = keep_variant(chosen, trees, notes, reference=again)
    return confirmed, chosen, again


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


def tuned_config(raw: dict[str, Any], choice: MethodChoice, chosen: Candidate) -> dict[str, Any]:
    """The input config (as written) with ``method`` replaced by the chosen one and
    ``compute`` given its batch size, rows per batch and the draft-length controller
    (``draft_length: auto``, with the chosen ``k`` as its cap: what the confirmation ran).

    Raises:
        ConfigError: the result does not validate (a bug: it is checked before it is written).
    """
    out = copy.deepcopy(raw)
    out["method"] = choice.method_section(chosen.k)
    compute = dict(out.get("compute") or {})
    compute.update(max_batch_size=chosen.batch_size, rows_per_batch=chosen.rows_per_batch,
                   draft_length="auto")
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


__all__ = ["tune", "check_options", "TREE_CANDIDATES", "VARIANT_MARGIN", "TuneOptions", "TuneResult", "MethodChoice", "allowed_methods", "tuned_config",
           "read_raw_config", "CLOCKS", "DEFAULT_BATCH_SIZES", "REFERENCE_ROWS"]
