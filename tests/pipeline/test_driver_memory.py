"""Driver memory does not grow with the rows: the workers write each unit's rows, and the
driver receives only a record per staged file, so one 5,000-row file (10 units of 500)
raises the driver's peak memory no more than ten files of 500 rows.  A control that holds
the same output rows in the driver (reading them back) shows the measurement sees them.  The actors echo each row's prompt without running a
model (:class:`_EchoActor`): the driver's side (Ray Data iteration, buffers, staging,
commits) is what is measured, in seconds instead of minutes."""

import json
import sys

import pyarrow.parquet as pq
import pytest
from ray import cloudpickle

from actors.generate import GenerateActor
from pipeline_testkit import committed, job_config
from pipeline.run import run_job

WORDS = "the cat sat on the mat and looked at the dog a storm hit the coast on monday".split()
TEXT_WORDS = 200  # ~1 KB of text per row; the prompt (text + template) is kept in the output


def _write_shards(d, shards, rows):
    d.mkdir(parents=True)
    for s in range(shards):
        with open(d / f"s{s:02d}.jsonl", "w") as f:
            for i in range(rows):
                text = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(TEXT_WORDS)) + f" {i % 10}"
                f.write(json.dumps({"id": f"{s}-{i}", "text": text}) + "\n")
    return d


class _EchoActor(GenerateActor):
    """An output row per input row (the prompt kept, one "generated" word), no model."""

    def __init__(self, config, device=None, columns="job", text_column="text", id_column="id", carry=None,
                 **_):  # reuse=, load_board=: not this stub's
        from pipeline.config import JobConfig
        from pipeline.prompts import fill_template

        self.columns, self.text_column, self.id_column, self.carry = columns, text_column, id_column, carry
        self.cfg = JobConfig.model_validate(config)
        self.fill = fill_template
        self.meta = {"method": "plain", "target_model": self.cfg.models.target, "draft_model": None}
        self.rows_done = 0

    def generate_rows(self, rows):
        self.rows_done += len(rows)
        return [{"id": row["id"], "source_file": row["source_file"], "source_row": row["source_row"], **self.meta,
                 "prompt": self.fill(row["text"], self.cfg.task), "output_text": "x", "finish_reason": "length",
                 "new_tokens": 1, "error": None} for row in rows]


def _rss_mb(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(field)


def _peak_growth_mb(fn):
    """Peak resident memory of this process (the driver) during ``fn()``, above its level
    just before (VmHWM reset through /proc/self/clear_refs)."""
    import gc

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
    base = _rss_mb("VmRSS")
    fn()
    return _rss_mb("VmHWM") - base


@pytest.mark.slow
def test_driver_memory_is_flat_in_the_shard_size(ray_local, tiny_models, tmp_path, monkeypatch):
    import actors.generate

    try:
        open("/proc/self/clear_refs", "w").close()
    except OSError:
        pytest.skip("needs Linux /proc/self/clear_refs to reset the peak RSS")
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    monkeypatch.setattr(actors.generate, "GenerateActor", _EchoActor)

    def run(name, inputs):
        cfg = job_config(tiny_models, str(inputs), str(tmp_path / "out" / name), method="plain", overrides=[
            "generation.max_new_tokens=1", "compute.rows_per_batch=250", "input.split_rows=500"])
        return lambda: run_job(cfg, progress=False)

    one_big = _write_shards(tmp_path / "one", 1, 5000)
    ten_small = _write_shards(tmp_path / "ten", 10, 500)
    try:
        run("warm", _write_shards(tmp_path / "warm", 1, 300))()  # imports, Ray Data, allocator arenas
        big = _peak_growth_mb(run("big", one_big))
        small = _peak_growth_mb(run("small", ten_small))
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    held = []
    whole = _peak_growth_mb(lambda: held.append(pq.read_table(tmp_path / "out" / "big").to_pylist()))  # rows held
    print(f"driver peak growth: one 5,000-row file {big:.1f} MB, ten of 500 {small:.1f} MB, "
          f"its output rows held in the driver {whole:.1f} MB")
    # the measurement sees the rows held in memory ...
    assert whole > big + 8, (whole, big)
    # ... and the 5,000-row file sits near the ten small files, far from its rows held
    # (allocator noise under a loaded machine is a few MB)
    assert big < small + max(6.0, 0.4 * (whole - small)), (big, small, whole)
    entries = committed(tmp_path / "out" / "big")
    assert len(entries) == 10 and pq.read_table(tmp_path / "out" / "big").num_rows == 5000
