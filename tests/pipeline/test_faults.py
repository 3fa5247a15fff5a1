"""Faults: an actor process killed mid-run (restarted by Ray, its batch retried, every row
exactly once); a batch that keeps killing its actor fails the run after bounded retries
(no hang); an object-storage outage mid-run (retried with backoff, or the run fails
clearly and a rerun completes only the missing shards).

The outage is simulated with a pausable TCP proxy on 127.0.0.1 in front of one moto
server: while paused it drops every open connection and closes new ones at once, as a
stopped server would, but the server keeps its objects (a restarted moto would come
back empty, losing the committed shards the test wants to check)."""

import json
import os
import signal
import threading
import time

from ray import cloudpickle
import pytest

import pipeline.output.writer
from actors.generate import GenerateActor
from pipeline_testkit import TEXTS, PausableProxy, committed, free_port, job_config, write_jsonl
from pipeline.retry import StorageError
from pipeline.run import ActorPoolError, run_job

KEY, SECRET = "testing-key", "testing-secret"


# ---------------------------------------------------------------------------- actors


def _alive_generate_actors(ray):
    from ray._private import state

    return {aid: a for aid, a in state.actors().items()
            if "GenerateActor" in a["ActorClassName"] and a["State"] == "ALIVE"}


@pytest.mark.slow
def test_actor_killed_mid_run_is_restarted_and_every_row_is_written_once(ray_local, tiny_models, tmp_path):
    """Kill the actor's process (SIGKILL to the PID from Ray's actor table) after the first
    shard is committed; Ray restarts it, resubmits the lost batch; the run completes."""
    import pyarrow.parquet as pq

    for i in range(4):
        write_jsonl(tmp_path / "in" / f"s{i}.jsonl", [{"id": f"s{i}-{j}", "text": TEXTS[(i + j) % 8]} for j in range(4)])
    out = tmp_path / "out"
    cfg = job_config(tiny_models, str(tmp_path / "in"), str(out), overrides=[
        "compute.rows_per_batch=2", "generation.max_new_tokens=16", "compute.max_actor_restarts=2",
        "compute.max_batch_retries=2"])
    killed: dict = {}

    def killer():
        deadline = time.time() + 120
        while time.time() < deadline and not killed:
            if len(list((out / "_manifest" / "log").glob("*.json"))) >= 2:  # the run's epoch and a unit committed
                for aid, a in _alive_generate_actors(ray_local).items():
                    os.kill(a["Pid"], signal.SIGKILL)
                    killed[aid] = a["Pid"]
                    break
            time.sleep(0.02)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    summary = run_job(cfg, progress=False)
    t.join(timeout=5)
    assert killed, "the actor was not killed before the run ended"
    assert summary["this_run"]["units_run"] == [f"part-{i:05d}-u00000.parquet" for i in range(4)]
    ids = pq.read_table(out).column("id").to_pylist()
    assert sorted(ids) == sorted(f"s{i}-{j}" for i in range(4) for j in range(4))  # every row exactly once
    assert summary["rows"] == 16 and summary["errors"] == 0
    from ray._private import state

    (aid,) = killed
    assert state.actors(actor_id=aid)["NumRestarts"] >= 1  # Ray restarted the killed actor


class _CrashingActor(GenerateActor):
    """Dies (the whole process) on the prompt 'crash me'."""

    def generate_rows(self, rows):
        if any(row.get("text") == "crash me" for row in rows):
            os._exit(1)
        return super().generate_rows(rows)


@pytest.mark.slow
def test_a_batch_that_keeps_killing_its_actor_fails_the_run_bounded(ray_local, tiny_models, tmp_path, monkeypatch):
    """Bounded retries, then the run fails (no hang) and publishes no ``_SUCCESS``.  (Batches
    in flight on the same actor die with it, so shard a may or may not have been committed.)"""
    import actors.generate

    import sys

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    monkeypatch.setattr(actors.generate, "GenerateActor", _CrashingActor)
    write_jsonl(tmp_path / "in" / "a.jsonl", [{"id": "a", "text": TEXTS[0]}])
    write_jsonl(tmp_path / "in" / "b.jsonl", [{"id": "b", "text": "crash me"}])
    out = tmp_path / "out"
    cfg = job_config(tiny_models, str(tmp_path / "in"), str(out), overrides=[
        "compute.rows_per_batch=1", "generation.max_new_tokens=4", "compute.max_actor_restarts=2",
        "compute.max_batch_retries=1"])
    t0 = time.time()
    try:
        with pytest.raises(Exception) as e:
            run_job(cfg, progress=False)
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    assert time.time() - t0 < 180
    assert not isinstance(e.value, StorageError)
    # the message says which budget ran out (the batch's resubmissions here: the actor had restarts left)
    assert isinstance(e.value, ActorPoolError), repr(e.value)
    assert str(e.value).startswith("a batch failed after compute.max_batch_retries=1 resubmissions: its actor kept "
                                   "dying (2 actor restarts so far, compute.max_actor_restarts=2")
    assert "part-00001-u00000.parquet" not in committed(out) and not (out / "_SUCCESS").exists()


# ---------------------------------------------------------------------------- storage


@pytest.fixture(scope="module")
def s3():
    import boto3
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    proxy = PausableProxy(port)
    client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", aws_access_key_id=KEY,
                          aws_secret_access_key=SECRET, region_name="us-east-1")
    client.create_bucket(Bucket="faults")
    for i in range(3):
        body = "".join(json.dumps({"id": f"s{i}-{j}", "text": TEXTS[(i + j) % 8]}) + "\n" for j in range(2))
        client.put_object(Bucket="faults", Key=f"in/shard-{i}.jsonl", Body=body.encode())
    yield client, proxy
    proxy.close()
    server.stop()


def _cfg(tiny_models, proxy, out, *extra):
    opts = json.dumps({
        "key": KEY, "secret": SECRET,
        "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{proxy.port}", "region_name": "us-east-1"},
        # keep botocore's own retry loop short: the pipeline's backoff is under test
        "config_kwargs": {"retries": {"max_attempts": 1, "mode": "standard"}, "connect_timeout": 2, "read_timeout": 5},
    })
    return job_config(tiny_models, "s3://faults/in/*.jsonl", out, overrides=[
        f"input.storage_options={opts}", f"output.storage_options={opts}", "compute.rows_per_batch=2",
        "generation.max_new_tokens=6", *extra])


def _keys(client, prefix):
    return sorted(o["Key"] for o in client.list_objects_v2(Bucket="faults", Prefix=prefix).get("Contents", []))


def _ids(client, prefix):
    import io

    import pyarrow.parquet as pq

    ids = []
    for k in _keys(client, prefix):
        if k.endswith(".parquet") and "/_" not in k:
            ids += pq.read_table(io.BytesIO(client.get_object(Bucket="faults", Key=k)["Body"].read())).column("id").to_pylist()
    return sorted(ids)


EXPECTED = sorted(f"s{i}-{j}" for i in range(3) for j in range(2))


def _outage_at_commit(monkeypatch, proxy, index, seconds=None):
    """Take the storage down when the driver starts its unit commit number ``index``
    (from 0; units commit in the order they complete), back after ``seconds``, or never."""
    original = pipeline.output.writer.OutputWriter.commit_unit
    calls = []

    def hooked(self, unit, fragments):
        calls.append(unit.part)
        if len(calls) == index + 1 and not proxy.paused.is_set():
            proxy.pause()
            if seconds is not None:
                threading.Timer(seconds, proxy.resume).start()
        return original(self, unit, fragments)

    monkeypatch.setattr(pipeline.output.writer.OutputWriter, "commit_unit", hooked)
    return calls


@pytest.mark.slow
def test_storage_outage_mid_run_is_retried(ray_local, tiny_models, s3, monkeypatch, caplog):
    client, proxy = s3
    _outage_at_commit(monkeypatch, proxy, 1, seconds=6.0)
    cfg = _cfg(tiny_models, proxy, "s3://faults/out/retried", "retry.attempts=10", "retry.initial_backoff_s=0.25",
               "retry.max_backoff_s=2")
    with caplog.at_level("WARNING", logger="specbatch"):
        summary = run_job(cfg, progress=False)
    assert proxy.refused > 0  # the outage really happened
    assert any("transient error" in r.getMessage() for r in caplog.records)
    assert summary["rows"] == 6
    assert "out/retried/_SUCCESS" in _keys(client, "out/retried/")
    assert _ids(client, "out/retried/") == EXPECTED


@pytest.mark.slow
def test_persistent_outage_fails_clearly_and_a_rerun_completes_only_the_missing_shards(
        ray_local, tiny_models, s3, monkeypatch):
    client, proxy = s3
    calls = _outage_at_commit(monkeypatch, proxy, 1)  # never comes back during run 1
    cfg = _cfg(tiny_models, proxy, "s3://faults/out/resumed", "retry.attempts=2", "retry.initial_backoff_s=0.2")
    try:
        with pytest.raises(StorageError, match=r"(part-0000\d-u00000|the lease|the commit log).*failed after 2 attempts"):
            run_job(cfg, progress=False)
    finally:
        proxy.resume()
    monkeypatch.undo()
    first, failed = calls[0], calls[1]
    keys = _keys(client, "out/resumed/")
    entries = committed(cfg.output.uri, cfg.output.storage_options)
    assert first in entries  # committed before the outage: intact
    assert "out/resumed/_SUCCESS" not in keys and failed not in entries

    summary = run_job(_cfg(tiny_models, proxy, "s3://faults/out/resumed"), progress=False)
    assert summary["this_run"]["units_skipped"] == [first]
    assert summary["this_run"]["units_run"] == sorted({f"part-{i:05d}-u00000.parquet" for i in range(3)} - {first})
    assert summary["rows"] == 6 and len(summary["runs"]) == 2
    assert _ids(client, "out/resumed/") == EXPECTED  # every row exactly once
    assert "out/resumed/_SUCCESS" in _keys(client, "out/resumed/")


def test_retry_helper_backs_off_on_transient_errors_only():
    from pipeline.retry import is_transient, with_retries

    sleeps: list[float] = []
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] < 4:
            raise ConnectionRefusedError("connection refused")
        return "ok"

    assert with_retries(flaky, what="x", attempts=5, initial_backoff_s=0.5, max_backoff_s=1.5, sleep=sleeps.append) == "ok"
    assert sleeps == [0.5, 1.0, 1.5]
    with pytest.raises(StorageError, match=r"x failed after 2 attempts in \d+ s: TimeoutError"):
        with_retries(lambda: (_ for _ in ()).throw(TimeoutError("slow")), what="x", attempts=2, sleep=sleeps.append)
    sleeps.clear()
    with pytest.raises(StorageError, match=r"\(not retried\): FileNotFoundError"):
        with_retries(lambda: (_ for _ in ()).throw(FileNotFoundError("gone")), what="x", sleep=sleeps.append)
    assert sleeps == []

    class EndpointConnectionError(Exception):  # botocore's, matched by name
        pass

    class ClientError(Exception):
        def __init__(self, code, status):
            self.response = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}

    assert is_transient(EndpointConnectionError("down"))
    assert is_transient(ClientError("SlowDown", 503)) and not is_transient(ClientError("AccessDenied", 403))
    assert not is_transient(PermissionError("denied")) and not is_transient(ValueError("bad"))
    assert is_transient(OSError(5, "Connection reset by peer"))
