"""The speculative decoding engine: propose -> verify in one target pass -> accept ->
roll back caches -> repeat, for many rows in flight (continuous batching), with exact
per-row statistics.

Typical use::

    from pipeline.engine import SpeculativeEngine, GenerationSettings, SpeculationSettings

    engine = SpeculativeEngine(target, SpeculationSettings(method="draft_model", num_assistant_tokens=5),
                               drafter=drafter, tokenizer=tokenizer)
    result = engine.generate(prompt_ids, GenerationSettings(max_new_tokens=64))
    result.token_ids, result.text, result.finish_reason, result.stats.to_dict()
    results = engine.generate_batch([ids_a, ids_b, ...], GenerationSettings(max_new_tokens=64))
"""

from .settings import GenerationSettings
from .speculation import SpeculationSettings
from .stats import GenerationResult, RowStats
from .api import SpeculativeEngine
from .proposers import METHODS

__all__ = [
    "METHODS",
    "GenerationSettings",
    "SpeculationSettings",
    "GenerationResult",
    "RowStats",
    "SpeculativeEngine",
]
