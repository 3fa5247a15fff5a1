"""A run that lost its lease publishes nothing, whatever the timing (pipeline.output.commit_log).

A run (A) is paused at each step of a commit: after the lease check, between two files of a
unit, between the files and the unit's record, before its ``final`` record, and between the
``final`` record and ``_SUCCESS``.  While it is paused (its heartbeat stopped, as SIGSTOP or a
VM freeze stops it) its lease goes stale and another run (B), with another config, takes the
output over and commits (to the end, or stopping half-way).  Then A resumes.  On local disk
and on moto S3: A fails with LeaseLost and changes nothing outside its own staging; the
manifest holds one config fingerprint; every row is there exactly once, with no orphan left;
and a rerun of B's config completes the output without a hand edit.

In-process (the writer's steps hooked, no Ray): cheap.  A real SIGSTOP of a job is
``test_concurrent_runs.py::test_a_job_paused_past_its_lease_publishes_nothing_after_the_taker``.
"""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import pipeline.output.writer as writer_mod
from pipeline.config import OutputConfig
from pipeline.fingerprint import config_fingerprint
from pipeline.output import OutputWriter, is_complete
from pipeline.layout import SUMMARY
from pipeline.output.lease import LeaseLost, OutputLease
from pipeline.input import Shard, units_of
from pipeline.schema import OUTPUT_SCHEMA

TIMEOUT_S = 3.0
SHARDS, ROWS = 3, 4  # 3 units of 4 rows, each written as 2 files (max_rows_per_file=2)
IDENTITY = {"A": {"method": {"name": "plain"}}, "B": {"method": {"name": "draft_model"}}}


class Place:
    """An output folder on local disk or in a moto bucket: its files, read behind the job's back."""

    def __init__(self, kind, tmp_path, moto):
        self.kind = kind
        if kind == "local":
            self.root, self.uri, self.options = tmp_path / "out", str(tmp_path / "out"), {}
        else:
            self.client, self.options = moto["client"], moto["options"]
            try:
                self.client.create_bucket(Bucket="fencing")
            except self.client.exceptions.BucketAlreadyOwnedByYou:
                pass
            self.prefix = f"{tmp_path.name}/"
            self.uri = f"s3://fencing/{tmp_path.name}"

    def files(self) -> dict[str, bytes]:
        if self.kind == "local":
            return {str(p.relative_to(self.root)): p.read_bytes() for p in self.root.rglob("*") if p.is_file()} \
                if self.root.exists() else {}
        got = self.client.list_objects_v2(Bucket="fencing", Prefix=self.prefix).get("Contents", [])
        return {o["Key"][len(self.prefix):]: self.client.get_object(Bucket="fencing", Key=o["Key"])["Body"].read()
                for o in got}

    def cfg(self, **kw) -> OutputConfig:
        return OutputConfig(uri=self.uri, storage_options=self.options, lease_timeout_s=TIMEOUT_S, max_rows_per_file=2,
                            **kw)


@pytest.fixture(params=["local", "s3"])
def place(request, tmp_path):
    return Place(request.param, tmp_path, request.getfixturevalue("moto_s3") if request.param == "s3" else None)


SHARD_LIST = [Shard(index=i, url=f"/in/{i}.jsonl", format="jsonl", num_rows=ROWS, fingerprint="f") for i in range(SHARDS)]
UNITS = units_of(SHARD_LIST)


def _rows(unit, config):
    return pa.Table.from_pylist([{"id": f"{unit.shard.index}-{r}", "source_row": r, "method": config}
                                 for r in range(ROWS)], schema=OUTPUT_SCHEMA)


def _writer(place, config, **kw) -> OutputWriter:
    w = OutputWriter(place.cfg(**kw))
    w.acquire_lease(config_fingerprint(IDENTITY[config]))
    return w


def _run(w, config, units=None, stop_after=None) -> None:
    """Prepare and commit every unit of the plan (or ``stop_after`` of them, then stop as a
    failing run does), then the final commit."""
    try:
        plan = w.on_write_start(UNITS, IDENTITY[config])
        for n, unit in enumerate(plan.todo):
            if stop_after is not None and n == stop_after:
                w.on_write_failed()
                return
            w.write_part(unit, _rows(unit, config))
        w.on_write_complete({"rows": SHARDS * ROWS})
    finally:
        w.release_lease()


def _taker(place, finishes: bool, overwrite: bool) -> None:
    """Run B (another config) on the output; A's lease looks stale to it (its clock runs ahead)."""
    class Ahead(OutputLease):
        def __init__(self, *a, **k):
            super().__init__(*a, **k, clock=lambda: __import__("time").time() + TIMEOUT_S + 1)

    original = writer_mod.OutputLease
    writer_mod.OutputLease = Ahead
    try:
        b = _writer(place, "B", overwrite=overwrite)
    finally:
        writer_mod.OutputLease = original
    _run(b, "B", stop_after=None if finishes else 1)


def _pause_at(a: OutputWriter, point: str, on_pause) -> None:
    """Hook A so that ``on_pause()`` runs (once) at ``point`` of its commits."""
    state = {"done": False}

    def pause():
        if not state["done"]:
            state["done"] = True
            a.lease._stop.set()  # frozen: its heartbeat stops too
            a.lease._thread.join()
            on_pause()

    check, publish, append = a._check_lease, a._publish, a.log.append

    def checked():
        check()
        if point == "after_lease_check":
            pause()

    def published(src, dst, what):
        if point == "after_final" and what == SUMMARY:
            pause()
        publish(src, dst, what)
        if point == "between_files":
            pause()

    def appended(record):
        if (point, record.kind) in (("before_entry", "unit"), ("before_final", "final")):
            pause()
        return append(record)

    a._check_lease, a._publish, a.log.append = checked, published, appended


def _committed_data(place) -> tuple[dict, list[str]]:
    """The manifest as the job reads it back, and the ids of every data file in the folder."""
    entries = OutputWriter(place.cfg()).location.read_manifest()
    files = place.files()
    data = [n for n in files if n.startswith("part-")]
    assert sorted(data) == sorted(f for e in entries.values() for f in e.files)  # no orphan left
    ids = [i for n in data for i in pq.read_table(io.BytesIO(files[n])).column("id").to_pylist()]
    return entries, ids


UNIT_POINTS = ["after_lease_check", "between_files", "before_entry"]
FINAL_POINTS = ["before_final", "after_final"]


@pytest.mark.parametrize("finishes", [True, False], ids=["taker-finishes", "taker-stops"])
@pytest.mark.parametrize("point", UNIT_POINTS + FINAL_POINTS)
def test_a_run_paused_past_its_lease_publishes_nothing_and_the_output_stays_one_config(place, point, finishes):
    a = _writer(place, "A")
    seen = {}

    def taker_runs():
        # in a unit: A committed nothing yet, and B resumes the output; at the end: A committed
        # every unit under its config, and B starts it afresh (--overwrite)
        _taker(place, finishes, overwrite=point in FINAL_POINTS)
        seen["files"] = place.files()

    _pause_at(a, point, taker_runs)
    with pytest.raises(LeaseLost, match="lost the output|lost its lease|holds no lease"):
        _run(a, "A")
    assert "files" in seen, "the pause never came"
    # A changed nothing after it lost its lease (its own staging aside, which it cannot publish from)
    now = place.files()
    assert {k: v for k, v in now.items() if not k.startswith("_staging/")} == {
        k: v for k, v in seen["files"].items() if not k.startswith("_staging/")}

    if not finishes:  # the output resumes with B's config, without a hand edit
        assert not is_complete(place.uri, place.options)
        _run(_writer(place, "B"), "B")
    assert is_complete(place.uri, place.options)
    entries, ids = _committed_data(place)
    assert {e.config_fingerprint for e in entries.values()} == {config_fingerprint(IDENTITY["B"])}
    assert sorted(ids) == sorted(f"{s}-{r}" for s in range(SHARDS) for r in range(ROWS))  # every row exactly once
    summary = json.loads(place.files()["_summary.json"])
    assert summary == {"rows": SHARDS * ROWS}
    # a rerun of B's config has nothing to do, and the output is as it was
    before = place.files()
    again = _writer(place, "B")
    try:
        assert again.on_write_start(UNITS, IDENTITY["B"]).nothing_to_do
    finally:
        again.release_lease()
    assert {k: v for k, v in place.files().items() if k != "_lease.json"} == before


def test_a_unit_committed_by_another_run_is_never_committed_over(place):
    """Two writers on one output, the second behind the first's back (no lease at all): the
    first to append after what both saw wins; the other's commit fails, naming the run that
    wrote in its place, and the manifest keeps the winner's entry."""
    a, b = OutputWriter(place.cfg()), OutputWriter(place.cfg())
    a.on_write_start(UNITS, IDENTITY["A"])
    b.log.next_seq = a.log.next_seq - 1  # b read the log when a had not begun: it appends where a's epoch is
    a.write_part(UNITS[0], _rows(UNITS[0], "A"))
    with pytest.raises(LeaseLost, match=f"written by run {a.run_id}"):
        b.write_part(UNITS[0], _rows(UNITS[0], "B"))
    entries = OutputWriter(place.cfg()).location.read_manifest()
    assert entries["part-00000-u00000.parquet"].run_id == a.run_id


def test_the_success_marker_of_a_run_that_lost_the_output_does_not_make_it_complete(place):
    """``_SUCCESS`` names the run of the log's ``final`` record: one left by another run (a
    late publish on a store where a copy had begun before the taker removed its source) does
    not count, and the next run finishes the output."""
    w = _writer(place, "A")
    _run(w, "A")
    assert is_complete(place.uri, place.options)
    OutputWriter(place.cfg()).location.put_atomic(
        OutputWriter(place.cfg()).location.path("_SUCCESS"), b"0123456789ab\n", "forge _SUCCESS")
    assert not is_complete(place.uri, place.options)
    _run(_writer(place, "A"), "A")
    assert is_complete(place.uri, place.options)
