"""Loading: a job config -> its loaded model pair, its engine and its resolved generation
settings, as every process that decodes a job's rows holds them: a batch job's actor
(:mod:`actors.generate`), a Serve replica (:mod:`pipeline.serve.server`), the tuner
(:mod:`pipeline.tune`), the benches and the scripts.  One recipe, so that what the tuner
measures and what a replica serves is what the job runs.

- :func:`load_engine` -- ``cfg.models`` loaded, the engine of ``cfg.method``, the job's
  ``generation:`` resolved against the target checkpoint (:class:`LoadedEngine`);
- :func:`load_job_models` and :func:`build_engine` -- the two halves, for a caller that
  builds several engines on one model pair (the tuner, the actor's plain audit engine);
- :func:`resolve_job_generation` -- the job's ``generation:`` with the checkpoint's defaults,
  resolved once per job, in the driver (the processor hands the result to its actors; a
  replica or the tuner, which have no driver, resolve it the same way);
- :func:`row_key`, :func:`row_seed`, :func:`row_settings` -- a row's own sampling seed,
  derived from ``generation.seed`` and the row's id, so a row's output does not depend on
  which actor, batch or batch position it lands in;
- :func:`process_cpus` and :func:`limit_cpu_threads` -- the CPU thread rule: as many torch
  intra-op threads as CPUs Ray gave the process.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from typing import TYPE_CHECKING, Any, Callable

from pipeline.config import JobConfig
from pipeline.engine import METHODS, GenerationSettings, SpeculationSettings
from pipeline.models import LoadedModels, load_models

if TYPE_CHECKING:
    from pipeline.engine import SpeculativeEngine
    from pipeline.engine.cpu import CpuOptions


@dataclasses.dataclass
class LoadedEngine:
    """A job config's model pair and engine, as one process (an actor, a Serve replica) holds them.

    Attributes:
        models: the loaded :class:`pipeline.models.LoadedModels`.
        engine: the :class:`pipeline.engine.SpeculativeEngine` of ``method:``.
        settings: the job's ``generation:`` with the target checkpoint's defaults filled in
            (:func:`resolve_job_generation`; the driver's, when it handed them over).
        load_time_s: seconds spent loading the weights.
    """

    models: Any
    engine: Any
    settings: GenerationSettings
    load_time_s: float


def load_job_models(cfg: JobConfig, device: str | None = None, any_drafter: bool = False) -> LoadedModels:
    """Load ``cfg.models`` (on ``device``; default ``cuda`` when visible, else ``cpu``): the
    drafter when ``cfg.method`` drafts with it (:attr:`JobConfig.uses_drafter`) or, with
    ``any_drafter``, whenever ``models.drafter`` is set (the tuner tries every method the
    models allow).

    Raises:
        OSError, ValueError: as :func:`pipeline.models.load_models` (transformers' loading errors).
    """
    return load_models(cfg.models, bool(cfg.models.drafter) if any_drafter else cfg.uses_drafter, device,
                       method=cfg.method.name)


def build_engine(models: LoadedModels, spec: SpeculationSettings | None = None, max_batch_size: int = 8,
                 draft_length: str = "auto",
                 clock: Callable[[], float] = time.perf_counter, cpu: "CpuOptions | None" = None) -> "SpeculativeEngine":
    """The engine of ``spec`` (default: plain decoding) on loaded models: the drafter and its
    tokenizer are passed only to a method that drafts with them.

    Args:
        models: :class:`pipeline.models.LoadedModels`.
        spec: the method and its settings.
        max_batch_size: rows in flight.
        draft_length: ``"auto"`` (the engine's draft-length controller) or ``"fixed"`` (every row its ``k``).
        clock: the engine's clock (the tuner measures on CPU time).
        cpu: the CPU acceleration's parts (the job's ``cpu:``; default all on); the engine
            prepares each model once with them (:func:`pipeline.engine.cpu.prepare`), and a model
            already prepared with the same options keeps its plan.

    Raises:
        ValueError: the engine refuses the model pair or a setting (the message names it).
    """
    from pipeline.engine import SpeculativeEngine

    spec = spec or SpeculationSettings()
    drafts_with_model = METHODS[spec.method].needs_drafter
    return SpeculativeEngine(
        models.target,
        spec,
        drafter=models.drafter if drafts_with_model else None,
        tokenizer=models.tokenizer,
        drafter_tokenizer=models.drafter_tokenizer if drafts_with_model else None,
        max_batch_size=max_batch_size,
        draft_length=draft_length,
        clock=clock,
        cpu=cpu,
    )


def resolve_job_generation(cfg: JobConfig, target_config) -> GenerationSettings:
    """``generation:`` with the target checkpoint's ``generation_config`` defaults filled in
    (:func:`pipeline.engine.settings.resolve_generation_settings`; read from the checkpoint's
    files, no weights: ``target_config`` is its ``config.json``).  The one resolution of a
    job's generation settings: the driver's preflight calls it once and hands the result to
    the actors (:class:`actors.generate.GenerateActor`'s ``generation``).

    Raises:
        ConfigError: a bad value, from the config or the checkpoint (naming the setting).
    """
    from pipeline.config import ConfigError
    from pipeline.engine.settings import resolve_generation_settings
    from pipeline.models import checkpoint_generation_config

    checkpoint = checkpoint_generation_config(cfg.models.target, target_config, cfg.models.trust_remote_code)
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    try:
        return resolve_generation_settings(cfg.generation.generation_settings(), checkpoint,
                                           getattr(text, "vocab_size", None))
    except ValueError as e:
        raise ConfigError(f"generation: {e}") from None


def load_engine(cfg: JobConfig, device: str | None = None, max_batch_size: int | None = None,
                generation: GenerationSettings | None = None) -> LoadedEngine:
    """Load ``cfg.models`` (on ``device``; default ``cuda`` when visible, else ``cpu``) and
    build the engine of ``cfg.method`` with ``max_batch_size`` rows in flight (default
    ``compute.max_batch_size``), ``compute.draft_length`` and the ``cpu:`` options (the
    models are prepared for the CPU here, once: the engine's ``cpu_plans`` say what was chosen).
    ``generation``: the job's resolved generation settings (the driver's); ``None``: resolved
    here (:func:`resolve_job_generation`), for a process without a driver (a replica, the tuner).

    Raises:
        ValueError: the engine refuses the model pair or a setting (the message names it).
    """
    t0 = time.perf_counter()
    models = load_job_models(cfg, device)
    load_time_s = time.perf_counter() - t0
    engine = build_engine(models, cfg.method.speculation_settings(), max_batch_size or cfg.compute.max_batch_size,
                          cfg.compute.draft_length, cpu=cfg.cpu.cpu_options())
    if generation is None:
        generation = resolve_job_generation(cfg, models.target.config)
    return LoadedEngine(models, engine, generation, load_time_s)


# ---------------------------------------------------------------------------- rows
def row_key(row: dict[str, Any]) -> Any:
    """What seeds a row's sampling: its ``id``, else its shard and position in it."""
    key = row.get("id")
    return key if key is not None else f"{row.get('source_file')}\x00{row.get('source_row')}"


def row_seed(seed: int, key: Any) -> int:
    """A row's sampling seed: a hash of the job's ``seed`` and the row's key (63 bits)."""
    h = hashlib.sha256(f"{seed}\x00{key}".encode()).digest()
    return int.from_bytes(h[:8], "big") >> 1


def row_settings(settings: GenerationSettings, key: Any) -> GenerationSettings:
    """The generation settings of one row: when sampling with a seed, the row's own seed
    (:func:`row_seed` of the job's seed and ``key``); otherwise ``settings`` itself."""
    if not settings.do_sample or settings.seed is None:
        return settings
    return dataclasses.replace(settings, seed=row_seed(settings.seed, key))


# ---------------------------------------------------------------------------- CPU threads
def process_cpus(cfg: JobConfig, serving: bool = False) -> float:
    """CPUs Ray gives one decoding process: a batch actor ``compute.cpus_per_actor``; a Serve
    replica (``serving``) ``serve.cpus_per_replica``, unset: the actor's."""
    return (cfg.serve.cpus_per_replica if serving else None) or cfg.compute.cpus_per_actor


def limit_cpu_threads(cpus: float) -> None:
    """Use as many torch intra-op threads as CPUs Ray gave this process (at least 1): more
    threads than cores makes small-batch decoding many times slower on a shared machine."""
    import torch

    torch.set_num_threads(max(1, int(cpus)))
