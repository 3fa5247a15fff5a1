"""Ray actors of the pipeline.  ``GenerateActor``: the model pair + engine, one per actor."""

from .generate import GenerateActor

__all__ = ["GenerateActor"]
