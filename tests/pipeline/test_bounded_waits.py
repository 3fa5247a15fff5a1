"""Storage waits are bounded: request timeouts reach botocore/s3fs (whose own retries are
off), no retry starts after ``retry.deadline_s``, and a call to an endpoint that accepts
connections but never answers fails within ``deadline_s + connect_timeout_s +
read_timeout_s``, naming the endpoint and the call: when listing the input, when writing
the output, and mid-run (moto S3 behind a proxy that starts hanging), where a rerun then
resumes; and through the command line with the default settings (under 2 minutes)."""

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

import pipeline.output.writer
from pipeline_testkit import REPO, TEXTS, PausableProxy, job_config
from pipeline.config import InputConfig, OutputConfig, RetryConfig
from pipeline.input import resolve_shards
from pipeline.retry import StorageError, open_fs, with_retries
from pipeline.output import OutputWriter

FAST = RetryConfig(connect_timeout_s=1, read_timeout_s=1, deadline_s=3, initial_backoff_s=0.2)
BOUND = FAST.deadline_s + FAST.connect_timeout_s + FAST.read_timeout_s


@pytest.fixture(scope="module")
def silent_endpoint():
    """``http://127.0.0.1:<port>``: accepts every connection, never sends a byte."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    held = []

    def accept():
        while True:
            try:
                held.append(sock.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()
    for c in held:
        c.close()


def _opts(endpoint):
    return {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}


def test_no_retry_starts_after_the_deadline():
    now = [0.0]
    calls = []

    def hangs_30s():
        calls.append(now[0])
        now[0] += 30  # each attempt ends with a 30 s read timeout
        raise TimeoutError("read timed out")

    def sleep(s):
        now[0] += s

    with pytest.raises(StorageError) as e:
        with_retries(hangs_30s, what="list input", attempts=6, initial_backoff_s=0.5, deadline_s=60,
                     endpoint="http://x", sleep=sleep, clock=lambda: now[0])
    assert calls == [0.0, 30.5]  # a third attempt would start at 61.5 s
    assert e.value.transient
    assert str(e.value).startswith("list input (endpoint http://x) failed after 2 attempts in 60 s "
                                   "(retry.deadline_s=60 reached): TimeoutError")
    # without a deadline all attempts run
    calls.clear()
    with pytest.raises(StorageError, match="after 6 attempts"):
        with_retries(hangs_30s, what="x", attempts=6, sleep=sleep, clock=lambda: now[0])
    assert len(calls) == 6


def test_timeouts_reach_botocore_and_the_inner_retry_loops_are_off():
    fs, _ = open_fs("s3://bucket/key", _opts("http://127.0.0.1:9"), RetryConfig(connect_timeout_s=3, read_timeout_s=7))
    assert fs.config_kwargs == {"connect_timeout": 3, "read_timeout": 7,
                                "retries": {"total_max_attempts": 1, "mode": "standard"}}
    assert fs.retries == 1
    mine = dict(_opts("http://127.0.0.1:9"), config_kwargs={"read_timeout": 99})
    fs, _ = open_fs("s3://bucket/key", mine, RetryConfig())
    assert fs.config_kwargs["read_timeout"] == 99 and fs.config_kwargs["connect_timeout"] == 10  # the user's wins
    local, _ = open_fs("/tmp/x", {}, RetryConfig())
    assert not hasattr(local, "config_kwargs")


def test_listing_input_at_a_silent_endpoint_fails_within_the_bound(silent_endpoint):
    t0 = time.monotonic()
    with pytest.raises(StorageError) as e:
        resolve_shards(InputConfig(uri="s3://bucket/in/*.jsonl", storage_options=_opts(silent_endpoint)), FAST)
    elapsed = time.monotonic() - t0
    assert FAST.read_timeout_s <= elapsed < BOUND + 2
    assert f"list input 's3://bucket/in/*.jsonl' (endpoint {silent_endpoint}) failed after" in str(e.value)
    assert "Timeout" in str(e.value)


def test_preparing_output_at_a_silent_endpoint_fails_within_the_bound(silent_endpoint):
    t0 = time.monotonic()
    with pytest.raises(StorageError) as e:
        OutputWriter(OutputConfig(uri="s3://bucket/out", storage_options=_opts(silent_endpoint)), retry=FAST).on_write_start()
    assert time.monotonic() - t0 < BOUND + 2
    assert f"(endpoint {silent_endpoint})" in str(e.value) and "failed after" in str(e.value)


@pytest.mark.slow
def test_a_store_that_hangs_mid_run_fails_the_run_within_the_bound_and_a_rerun_resumes(
        ray_local, tiny_models, moto_s3, monkeypatch):
    client = moto_s3["client"]
    client.create_bucket(Bucket="hangs")
    for i in range(3):
        body = "".join(json.dumps({"id": f"s{i}-{j}", "text": TEXTS[i + j]}) + "\n" for j in range(2))
        client.put_object(Bucket="hangs", Key=f"in/shard-{i}.jsonl", Body=body.encode())
    proxy = PausableProxy(int(moto_s3["endpoint"].rsplit(":", 1)[1]))
    opts = json.dumps(_opts(f"http://127.0.0.1:{proxy.port}") | {"key": "testing-key", "secret": "testing-secret"})
    retry = [f"retry.{k}={v}" for k, v in FAST.model_dump().items()]
    cfg = job_config(tiny_models, "s3://hangs/in/*.jsonl", "s3://hangs/out", method="plain", overrides=[
        f"input.storage_options={opts}", f"output.storage_options={opts}", "compute.rows_per_batch=2",
        "generation.max_new_tokens=3", *retry])
    hung_at = []
    original = pipeline.output.writer.OutputWriter.commit_unit
    calls = []

    def hang_at_second_commit(self, unit, fragments):
        calls.append(unit.part)
        if len(calls) == 2 and not hung_at:
            proxy.hang()
            hung_at.append(time.monotonic())
        return original(self, unit, fragments)

    monkeypatch.setattr(pipeline.output.writer.OutputWriter, "commit_unit", hang_at_second_commit)
    try:
        from pipeline.run import run_job

        with pytest.raises(StorageError) as e:
            run_job(cfg, progress=False)
        failed_after = time.monotonic() - hung_at[0]
        assert failed_after < BOUND + 2, failed_after
        # the unit's commit checks the lease first: that storage call is the one that gives up
        assert f"(endpoint http://127.0.0.1:{proxy.port})" in str(e.value)
        assert calls[1] in str(e.value) or "check the lease" in str(e.value), str(e.value)
    finally:
        proxy.resume()
        monkeypatch.undo()
    summary = run_job(cfg, progress=False)
    assert summary["this_run"]["units_skipped"] == [calls[0]] and summary["rows"] == 6
    keys = [o["Key"] for o in client.list_objects_v2(Bucket="hangs", Prefix="out/")["Contents"]]
    assert "out/_SUCCESS" in keys and not any("_staging" in k for k in keys)
    proxy.close()


@pytest.mark.slow
def test_the_job_with_default_settings_gives_up_on_a_silent_endpoint_in_under_2_minutes(silent_endpoint, tmp_path):
    """Defaults: connect 10 s, read 30 s, deadline 60 s: at most 100 s per storage call."""
    defaults = RetryConfig()
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(REPO / "jobs" / "summarize.py"), "--input", "s3://bucket/in/*.jsonl",
                        "--set", f"input.storage_options={json.dumps(_opts(silent_endpoint))}",
                        "--output", str(tmp_path / "out"), "--no-progress"],
                       capture_output=True, text=True, env=env, timeout=180)
    elapsed = time.monotonic() - t0
    assert r.returncode == 1, r.stderr
    assert elapsed < defaults.deadline_s + defaults.connect_timeout_s + defaults.read_timeout_s + 15 < 120
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in r.stderr
    assert f"list input 's3://bucket/in/*.jsonl' (endpoint {silent_endpoint})" in errors[0]
    # a warning was logged at the first timeout, long before the end
    assert "transient error (attempt 1/6" in r.stderr
