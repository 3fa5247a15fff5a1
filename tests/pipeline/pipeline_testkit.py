"""Helpers of the pipeline tests (imported by name: ``from pipeline_testkit import ...``)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

from pipeline.config import load_config

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def job_config(tiny_models: dict, input_uri: str, output_uri: str, *, method: str = "draft_model",
               overrides: list[str] | None = None, **extra_sets):
    """A small JobConfig for the tiny models (1 actor, CPU, 4 rows per batch, 12 new tokens)."""
    sets = [
        f"input.uri={input_uri}",
        f"output.uri={output_uri}",
        f"models.target={tiny_models['target']}",
        f"models.drafter={tiny_models['drafter']}",
        f"method.name={method}",
        "generation.max_new_tokens=12",
        "compute.num_actors=1",
        "compute.rows_per_batch=4",
        "compute.cpus_per_actor=1",
    ]
    return load_config(None, sets + list(overrides or []))


TEXTS = [
    "the cat sat on the mat and looked at the dog",
    "a storm hit the coast on monday and many homes lost power",
    "the council voted to build a new school near the river",
    "scientists found a new species of frog in the forest",
    "the team won the final match after a long season",
    "prices rose again this month as fuel costs went up",
    "the museum opened a new exhibition about ancient ships",
    "local farmers said the dry summer hurt their crops",
]
