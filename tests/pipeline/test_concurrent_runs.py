"""Two runs on one output (pipeline.output.lease, end to end): real job processes with different
settings started at the same instant, and 20 s apart: exactly one commits, the other exits 2
naming the lease's holder, and the output is entirely the winner's config.  A SIGKILLed
holder's lease refuses the next run until it goes stale (``output.lease_timeout_s``), then
the next run takes it over, with a warning, and resumes.  A job stopped (SIGSTOP) inside a
unit's commit for longer than its lease is taken over by a run of another config, and on
SIGCONT it publishes nothing and exits 1."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.cli import main
from pipeline.output.lease import LEASE
from pipeline_testkit import REPO, committed, write_jsonl

WORDS = "the cat sat on the mat and looked at the dog".split()


def _inputs(d: Path, shards: int, rows: int) -> Path:
    for s in range(shards):
        write_jsonl(d / f"s{s}.jsonl", [{"id": f"{s}-{i}", "text": " ".join(WORDS[(i + k) % 11] for k in range(10))}
                                        for i in range(rows)])
    return d


def _start(args, tmp_path, name):
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", XDG_STATE_HOME=str(tmp_path / "state"))
    env.pop("RAY_ADDRESS", None)
    env.pop("PYTHONPATH", None)
    out, err = open(tmp_path / f"{name}.out", "w"), open(tmp_path / f"{name}.err", "w")
    p = subprocess.Popen([sys.executable, str(REPO / "jobs" / "summarize.py"), *args], stdout=out, stderr=err,
                         text=True, env=env, start_new_session=True)
    p.logs = (tmp_path / f"{name}.out", tmp_path / f"{name}.err")
    return p


def _finish(p, timeout=400):
    try:
        p.wait(timeout=timeout)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return p.returncode, p.logs[0].read_text(), p.logs[1].read_text()


def _said(err):
    return [ln for ln in err.splitlines() if ln.startswith("error:")]


def _args(tiny_models, inp, out, method, tokens, *extra):
    return ["--input", str(inp), "--output", str(out), "--target", tiny_models["target"],
            "--drafter", tiny_models["drafter"], "--method", method, "--max-new-tokens", str(tokens),
            "--no-progress", "--set", "output.partition_by_date=false", *extra]


def _entirely_one_config(out: Path, summary_run_id: str, method: str):
    summary = json.loads((out / "_summary.json").read_text())
    assert summary["run_id"] == summary_run_id and (out / "_SUCCESS").read_text().strip() == summary_run_id
    assert summary["config"]["method"]["name"] == method
    entries = list(committed(out).values())
    assert entries and {e.config_fingerprint for e in entries} == {summary["config_fingerprint"]}
    assert {e.run_id for e in entries} == {summary_run_id}
    table = pq.read_table(out)
    assert set(table.column("method").to_pylist()) == {method}
    ids = table.column("id").to_pylist()
    assert len(ids) == len(set(ids)) == summary["rows"]
    assert not (out / LEASE).exists() and not (out / "_staging").exists()


@pytest.mark.slow
def test_two_runs_started_together_one_commits_the_other_is_refused_naming_the_lease(tiny_models, tmp_path):
    inp, out = _inputs(tmp_path / "in", 2, 3), tmp_path / "out"
    a = _start(_args(tiny_models, inp, out, "plain", 4), tmp_path, "a")
    b = _start(_args(tiny_models, inp, out, "draft_model", 6), tmp_path, "b")
    results = {"plain": _finish(a), "draft_model": _finish(b)}
    codes = sorted(r[0] for r in results.values())
    assert codes == [0, 2], {k: (r[0], r[2][-2000:]) for k, r in results.items()}
    winner = next(m for m, r in results.items() if r[0] == 0)
    loser = next(m for m, r in results.items() if r[0] == 2)
    run_id = json.loads(results[winner][1])["run_id"]
    said = _said(results[loser][2])
    assert len(said) == 1, results[loser][2][-3000:]
    assert said[0].startswith(f"error: output '{out}' is leased by another run: run {run_id} of ")
    assert "last heartbeat" in said[0] and "Traceback" not in results[loser][2]
    _entirely_one_config(out, run_id, winner)


def _actor_of(job) -> int:
    """The pid of ``job``'s generate actor: a process of the job's own session (it was
    started with a session of its own) whose title names the actor."""
    import psutil

    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if os.getsid(p.pid) == job.pid and "MapBatches(GenerateActor" in " ".join(p.info["cmdline"] or []):
                return p.pid
        except (OSError, psutil.Error):
            continue
    raise AssertionError("the job's actor process was not found")


@pytest.mark.slow
def test_a_run_started_20_s_after_another_is_refused_and_the_first_commits(tiny_models, tmp_path):
    """The first run is made slow by pausing its actor (SIGSTOP) once it committed a shard,
    so the second starts while it surely runs, whatever the machine's speed."""
    inp, out = _inputs(tmp_path / "in", 8, 4), tmp_path / "out"  # enough rows that the run is still going
    t0 = time.monotonic()
    first = _start(_args(tiny_models, inp, out, "plain", 32, "--rows-per-batch", "1"), tmp_path, "first")
    actor = None
    try:
        deadline = time.time() + 240
        while not committed(out):
            assert first.poll() is None and time.time() < deadline, first.logs[1].read_text()[-3000:]
            time.sleep(0.05)
        actor = _actor_of(first)
        os.kill(actor, signal.SIGSTOP)  # a slow run: its driver (and the lease's heartbeat) goes on
        assert not (out / "_SUCCESS").exists()
        time.sleep(max(0.0, t0 + 20 - time.monotonic()))
        code, _, err = _finish(_start(_args(tiny_models, inp, out, "draft_model", 6, "--overwrite"), tmp_path,
                                      "second"), timeout=200)
        assert first.poll() is None
        said = _said(err)
        assert code == 2 and len(said) == 1, err[-3000:]
        assert said[0].startswith(f"error: output '{out}' is leased by another run: run ")
        assert "last heartbeat" in said[0]
    finally:
        if actor is not None:
            os.kill(actor, signal.SIGCONT)
    code, stdout, err = _finish(first)
    assert code == 0, err[-3000:]
    run_id = json.loads(stdout)["run_id"]
    assert f"run {run_id} of " in said[0]
    _entirely_one_config(out, run_id, "plain")  # the second's --overwrite deleted nothing


@pytest.mark.slow
def test_a_killed_holders_lease_refuses_until_stale_then_is_taken_over(ray_local, tiny_models, tmp_path, capsys,
                                                                         caplog):
    # Many small units, so that the holder is still at work when its first commit is seen (with
    # one unit per file, a fast machine once committed all three and released the lease within
    # one poll).
    shards, rows = 3, 20
    inp, out = _inputs(tmp_path / "in", shards, rows), tmp_path / "out"
    args = _args(tiny_models, inp, out, "plain", 24, "--rows-per-batch", "1", "--set", "output.lease_timeout_s=6",
                 "--set", "input.split_rows=2")
    holder = _start(args, tmp_path, "holder")
    try:
        deadline = time.time() + 240
        held = None
        while not committed(out):
            assert holder.poll() is None and time.time() < deadline, holder.logs[1].read_text()[-3000:]
            if held is None and (out / LEASE).exists():  # taken before any work starts
                with contextlib.suppress(ValueError):  # created, then written: it may be empty a moment
                    held = json.loads((out / LEASE).read_text())
            time.sleep(0.05)
        assert held is not None and holder.poll() is None, "the holder ended before it could be killed"
        os.killpg(holder.pid, signal.SIGKILL)  # no clean-up at all, as a lost node
        holder.wait()
        killed_at = time.time()
    finally:
        if holder.poll() is None:
            os.killpg(holder.pid, signal.SIGKILL)
    assert (out / LEASE).exists()

    capsys.readouterr()
    assert main("summarize", args) == 2  # its heartbeat is recent: refused, naming it
    said = _said(capsys.readouterr().err)
    assert len(said) == 1 and f"run {held['run_id']} of {held['owner']} (pid {held['pid']}" in said[0]
    assert time.time() - killed_at < 6, "the refusal came too late to test it (the lease went stale)"

    time.sleep(max(0.0, killed_at + 6.5 - time.time()))
    with caplog.at_level("WARNING", logger="specbatch"):
        assert main("summarize", args) == 0
    headline = json.loads(capsys.readouterr().out)
    assert any(f"took over the stale lease of run {held['run_id']}" in r.getMessage() for r in caplog.records)
    assert headline["this_run"]["units_skipped"] >= 1 and headline["rows"] == shards * rows
    ids = pq.read_table(out).column("id").to_pylist()
    assert sorted(ids) == sorted(f"{s}-{i}" for s in range(shards) for i in range(rows))  # every row once
    assert not (out / LEASE).exists() and not (out / "_staging").exists()


#: summarize.py, with the driver stopping itself (SIGSTOP) right after the lease check of its
#: second unit commit: the window between the check and the publish, as a VM freeze would hit it
_STOPS_IN_ITS_COMMIT = """
import os, signal, sys
sys.path.insert(0, sys.argv[1])
import pipeline.output.writer as w
check, calls = w.OutputWriter._check_lease, []
def stopping(self):
    check(self)
    calls.append(1)
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGSTOP)
w.OutputWriter._check_lease = stopping
from pipeline.cli import main
sys.exit(main("summarize", sys.argv[2:]))
"""


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.slow
def test_a_job_paused_past_its_lease_publishes_nothing_after_the_taker(ray_local, tiny_models, tmp_path, capsys,
                                                                       caplog):
    """A real job process stops (SIGSTOP) inside a unit's commit, after its lease check, for
    longer than ``output.lease_timeout_s``; a run of another config takes the output over
    (--overwrite) and completes it; on SIGCONT the paused job publishes nothing, exits 1 in
    one line, and the output is entirely the taker's, every row once; a rerun has nothing to do."""
    inp, out = _inputs(tmp_path / "in", 3, 4), tmp_path / "out"
    common = ["--rows-per-batch", "1", "--set", "output.lease_timeout_s=4", "--set", "input.split_rows=2"]
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", XDG_STATE_HOME=str(tmp_path / "state"))
    env.pop("RAY_ADDRESS", None)
    env.pop("PYTHONPATH", None)
    with open(tmp_path / "paused.err", "w") as err:
        paused = subprocess.Popen([sys.executable, "-c", _STOPS_IN_ITS_COMMIT, str(REPO),
                                   *_args(tiny_models, inp, out, "plain", 16, *common)],
                                  stdout=subprocess.DEVNULL, stderr=err, env=env, start_new_session=True)
    try:
        deadline = time.time() + 300
        while not _stopped(paused.pid):
            assert paused.poll() is None and time.time() < deadline, (tmp_path / "paused.err").read_text()[-3000:]
            time.sleep(0.1)
        held = json.loads((out / LEASE).read_text())
        time.sleep(4.5)  # its lease goes stale: its heartbeat is stopped with it
        taker = _args(tiny_models, inp, out, "draft_model", 6, *common, "--overwrite")
        capsys.readouterr()
        with caplog.at_level("WARNING", logger="specbatch"):
            assert main("summarize", taker) == 0
        run_id = json.loads(capsys.readouterr().out)["run_id"]
        assert any(f"took over the stale lease of run {held['run_id']}" in r.getMessage() for r in caplog.records)
        before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != LEASE}
        os.kill(paused.pid, signal.SIGCONT)
        paused.wait(timeout=120)
    finally:
        if paused.poll() is None:
            os.killpg(paused.pid, signal.SIGKILL)
            paused.wait()
    err = (tmp_path / "paused.err").read_text()
    said = _said(err)
    assert paused.returncode == 1 and len(said) == 1, err[-3000:]
    assert "lost the output" in said[0] and "publishes nothing more" in said[0], said
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != LEASE} == before
    _entirely_one_config(out, run_id, "draft_model")
    capsys.readouterr()
    assert main("summarize", _args(tiny_models, inp, out, "draft_model", 6, *common)) == 0
    assert json.loads(capsys.readouterr().out)["this_run"]["nothing_to_do"] is True
