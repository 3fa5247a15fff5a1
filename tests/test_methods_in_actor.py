"""Every method the bundled demo models support runs through the pipeline's actor from a job
config (configs/demo-summarize.yaml plus overrides): rows succeed, statistics are filled, and the
greedy outputs of the lossless methods equal plain decoding."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from actors.generate import GenerateActor
from pipeline.config import load_config
from pipeline.schema import INPUT_SCHEMA

REPO = Path(__file__).resolve().parents[1]
TEXTS = [
    "The town council approved a new park beside the river on Tuesday. Work will start in spring.",
    "A family of eagles has nested on a farm for the first time in fifty years, the owners said.",
]
METHODS = {
    "plain": [],
    "draft_model": [],
    "prompt_lookup": ["method.prompt_lookup_num_tokens=3"],
    "early_exit": ["method.assistant_early_exit=2"],
    "universal": [f"models.drafter={REPO / 'models' / 'demo-drafter-othertok'}"],
}


def _rows(texts):
    return pa.Table.from_pylist(
        [{"source_file": "demo", "source_row": i, "id": f"r{i}", "text": t, "input_error": None}
         for i, t in enumerate(texts)],
        schema=INPUT_SCHEMA,
    )


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    out = {}
    for method, extra in METHODS.items():
        cfg = load_config(
            REPO / "configs" / "demo-summarize.yaml",
            # every row its k: the controller (the default) may find that no draft pays on these
            # tiny models and run plain steps, and this test is about each method drafting
            [f"method.name={method}", "generation.max_new_tokens=12", "compute.draft_length=fixed",
             f"models.target={REPO / 'models' / 'demo-target'}", f"models.drafter={REPO / 'models' / 'demo-drafter'}",
             f"output.uri={tmp_path_factory.mktemp(method)}", *extra],
        )
        out[method] = GenerateActor(cfg.model_dump(), device="cpu")(_rows(TEXTS)).to_pylist()
    return out


@pytest.mark.parametrize("method", list(METHODS))
def test_method_runs_in_the_actor(outputs, method):
    plain = outputs["plain"]
    for row, ref in zip(outputs[method], plain):
        assert row["error"] is None, row["error"]
        assert row["method"] == method
        assert row["output_text"] == ref["output_text"]  # lossless, greedy
        assert row["new_tokens"] == ref["new_tokens"] > 0
        assert row["verify_steps"] >= 1 and row["accepted_tokens"] <= row["draft_tokens"]
        if method == "plain":
            assert row["draft_tokens"] == 0 and row["acceptance_rate"] is None
        else:
            assert sum(row["drafted_per_position"]) == row["draft_tokens"]
            assert sum(row["accepted_per_position"]) == row["accepted_tokens"]
    if method not in ("plain", "prompt_lookup"):
        assert sum(r["draft_tokens"] for r in outputs[method]) > 0
