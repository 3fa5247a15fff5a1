"""Interrupts: Ctrl-C (SIGINT to the whole process group, as a terminal sends it) and
SIGTERM (``ray job stop``, Kubernetes, a cron timeout) stop the job with one line and exit
status 130 / 143; shards committed before are kept, this run's staging is dropped, and a
rerun resumes after them and leaves no ``_staging/`` (not even one a SIGKILLed run left).
On local disk and on moto S3."""

import json
import os
import signal
import subprocess
import sys
import time

import pyarrow.parquet as pq

import pytest

from pipeline_testkit import REPO, OutStore as Out, write_jsonl
from pipeline.cli import main

WORDS = "the cat sat on the mat and looked at the dog".split()
ROWS = 10


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("in")
    for s in range(4):
        write_jsonl(d / f"s{s}.jsonl", [{"id": f"{s}-{i}", "text": " ".join(WORDS[(i + k) % 11] for k in range(12))}
                                        for i in range(ROWS)])
    return d


@pytest.mark.slow
@pytest.mark.parametrize("signame, storage, to_group, twice", [("SIGINT", "local", True, True),
                                                               ("SIGTERM", "s3", False, False)])
def test_an_interrupted_run_says_so_in_one_line_keeps_its_commits_and_resumes(
        ray_local, tiny_models, inputs, tmp_path, request, capsys, signame, storage, to_group, twice):
    """``twice``: a second signal once the first was reported (Ray is shutting down) ends
    the process at once, quietly, with the same status."""
    out = Out(storage, tmp_path, request.getfixturevalue("moto_s3") if storage == "s3" else None)
    args = ["--input", str(inputs), "--output", out.uri, "--target", tiny_models["target"],
            "--drafter", tiny_models["drafter"], "--method", "plain", "--max-new-tokens", "32",
            "--rows-per-batch", "1", "--no-progress", "--set", "output.partition_by_date=false"]
    if out.options:
        args += ["--set", f"output.storage_options={out.options}"]
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    env.pop("PYTHONPATH", None)
    errfile = tmp_path / "stderr.txt"
    with open(errfile, "w") as errf:
        job = subprocess.Popen([sys.executable, str(REPO / "jobs" / "summarize.py"), *args], stdout=subprocess.DEVNULL,
                               stderr=errf, text=True, env=env, start_new_session=True)
    try:
        deadline = time.time() + 240
        while not out.committed():  # a unit committed
            assert job.poll() is None and time.time() < deadline, errfile.read_text()[-3000:]
            time.sleep(0.1)
        sig = getattr(signal, signame)
        send = os.killpg if to_group else os.kill
        send(job.pid, sig)
        if twice:
            while "interrupted (" not in errfile.read_text() and job.poll() is None:
                time.sleep(0.02)
            if job.poll() is None:
                send(job.pid, sig)  # while Ray shuts down (its atexit hook)
        job.wait(timeout=120)
        err = errfile.read_text()
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 128 + sig, err[-3000:]
    said = [ln for ln in err.splitlines() if ln.strip() and "specbatch INFO" not in ln and "worker.py" not in ln
            and "core_worker.cc:2465" not in ln]  # the one documented Ray line (docs/reliability.md)
    assert said == [f"interrupted ({signame}): shards committed before the interrupt are kept; "
                    "rerun the same command to resume"], err[-3000:]
    for noise in ("Traceback", "KeyboardInterrupt", "execution finished", "SIGTERM received", "Stack trace",
                  "Exception ignored"):
        assert noise not in err
    files = out.files()
    entries = out.committed()
    assert entries and all(n in files for e in entries.values() for n in e.files)
    assert "_SUCCESS" not in files and not any(f.startswith("_staging") for f in files)
    assert len(entries) < 4  # interrupted before the end

    # a SIGKILLed run cannot clean up: its staging stays until a later successful run
    out.put("_staging/0123456789ab/part-00003/00000.parquet", b"left behind")
    capsys.readouterr()
    assert main("summarize", args) == 0  # the same command, in this process (the session's Ray)
    headline = json.loads(capsys.readouterr().out)
    assert headline["this_run"]["units_skipped"] >= 1 and headline["rows"] == 4 * ROWS
    files = out.files()
    assert "_SUCCESS" in files and not any(f.startswith("_staging") for f in files)
    assert out.ids() == sorted(f"{s}-{i}" for s in range(4) for i in range(ROWS))  # every row once


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.2, 1.2])
def test_a_sigterm_while_ray_starts_keeps_the_signal_contract(tiny_models, inputs, tmp_path, delay):
    """From the first line of output to the last: a SIGTERM 0.2 / 1.2 s after "rows to do"
    (the embedded Ray is starting: its node's and its core worker's own SIGTERM handlers
    would exit with 15 and no line, abort with -6, or drain 30 s first) stops the job with
    the one line and 143, leaves no process of its Ray behind, and a rerun does every row."""
    out = tmp_path / "out"
    args = ["--input", str(inputs), "--output", str(out), "--target", tiny_models["target"],
            "--drafter", tiny_models["drafter"], "--method", "plain", "--max-new-tokens", "4", "--no-progress",
            "--set", "output.partition_by_date=false"]
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    errfile = tmp_path / "stderr.txt"
    with open(errfile, "w") as errf:
        job = subprocess.Popen([sys.executable, str(REPO / "jobs" / "summarize.py"), *args], stdout=subprocess.DEVNULL,
                               stderr=errf, text=True, env=env, start_new_session=True)
    try:
        deadline = time.time() + 180
        while "rows to do" not in errfile.read_text():
            assert job.poll() is None and time.time() < deadline, errfile.read_text()[-3000:]
            time.sleep(0.02)
        time.sleep(delay)
        os.kill(job.pid, signal.SIGTERM)
        job.wait(timeout=120)  # the 30 s drain of Ray's node handler is gone; Ray's own shutdown remains
        err = errfile.read_text()
        time.sleep(1)
        left = subprocess.run(["pgrep", "-g", str(job.pid)], capture_output=True, text=True).stdout.split()
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 143, err[-3000:]
    said = [ln for ln in err.splitlines() if ln.strip() and "specbatch INFO" not in ln
            and "INFO worker.py" not in ln and "core_worker.cc:2465" not in ln]
    assert said == ["interrupted (SIGTERM): shards committed before the interrupt are kept; "
                    "rerun the same command to resume"], err[-3000:]
    for noise in ("Traceback", "SIGTERM received", "logging.cc", "Exception ignored"):
        assert noise not in err
    assert left == [], f"processes of the job's Ray left behind: {left}"
    if delay > 1:
        return  # one rerun is enough
    rerun = subprocess.run([sys.executable, str(REPO / "jobs" / "summarize.py"), *args], capture_output=True,
                           text=True, env=env, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    # Ray's ERROR about constructor arguments in the object store is explained once, before it comes
    explained = [i for i, ln in enumerate(rerun.stderr.splitlines()) if "has constructor arguments in the object store" in ln]
    assert len(explained) >= 1 and " specbatch INFO " in rerun.stderr.splitlines()[explained[0]], rerun.stderr[-3000:]
    assert sum(" specbatch INFO " in ln for i, ln in enumerate(rerun.stderr.splitlines()) if i in explained) == 1
    assert sorted(pq.read_table(out).column("id").to_pylist()) == sorted(
        f"{s}-{i}" for s in range(4) for i in range(ROWS))
