"""The job never hangs on its own resource plan: with 1 to all of the cluster's CPUs taken
by actors (``cpus_per_actor: 1``), the read and repartition stages still run; a plan the
cluster cannot hold is refused naming the numbers; and whatever the cause, a run that makes
no progress for ``compute.stall_timeout_s`` fails with a clear message instead of waiting
forever.  (A local 2-node cluster under ``ray job submit``: test_job_submit.py.)"""

import logging
import os
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest
from ray import cloudpickle

from actors.generate import GenerateActor
from pipeline_testkit import REPO, TEXTS, job_config, write_jsonl
from pipeline.run import PlanError, check_resource_plan, run_job

EMBEDDED_CPUS = 2  # the ray_local fixture (conftest.py)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("in")
    for s in range(3):
        write_jsonl(d / f"s{s}.jsonl", [{"id": f"{s}-{i}", "text": TEXTS[(s + i) % 8]} for i in range(4)])
    return d


@pytest.mark.parametrize("actors", range(1, EMBEDDED_CPUS + 1))
def test_every_actor_count_up_to_the_cpu_count_finishes(ray_local, tiny_models, inputs, tmp_path, actors):
    assert ray_local.cluster_resources()["CPU"] == EMBEDDED_CPUS
    cfg = job_config(tiny_models, str(inputs), str(tmp_path / "out"), method="plain", overrides=[
        f"compute.num_actors={actors}", "compute.cpus_per_actor=1", "compute.rows_per_batch=2",
        "generation.max_new_tokens=4", "compute.stall_timeout_s=90"])  # a deadlock fails in 90 s, not never
    t0 = time.monotonic()
    summary = run_job(cfg, progress=False)
    assert summary["rows"] == 12 and summary["errors"] == 0
    assert pq.read_table(tmp_path / "out").num_rows == 12
    assert time.monotonic() - t0 < 90


@pytest.mark.slow
def test_the_job_with_one_actor_per_cpu_of_its_embedded_ray_finishes(tiny_models, inputs, tmp_path):
    """The issue's case: ``--num-actors <CPU count>`` with the default ``cpus_per_actor: 1``
    on the job's own embedded Ray (it hung with no output)."""
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    r = subprocess.run([sys.executable, str(REPO / "jobs" / "summarize.py"), "--input", str(inputs), "--output",
                        str(tmp_path / "out"), "--target", tiny_models["target"], "--drafter", tiny_models["drafter"],
                        "--num-actors", str(os.cpu_count()), "--max-new-tokens", "4", "--no-progress",
                        "--set", "compute.stall_timeout_s=120", "--set", "output.partition_by_date=false"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert pq.read_table(tmp_path / "out").num_rows == 12


def _most_actors_at_once(since_ms: float) -> tuple[int, int]:
    """(the most pool actors alive at once, how many were started) since ``since_ms``, from Ray's
    actor table (each actor's start and end times)."""
    from ray._private import state

    now = time.time() * 1000
    events = []
    for a in state.actors().values():
        if str(a.get("ActorClassName", "")).startswith("MapWorker(") and (a.get("StartTime") or 0) >= since_ms:
            events += [(a["StartTime"], 1), ((a.get("EndTime") or 0) or now, -1)]
    alive = most = 0
    for _, step in sorted(events, key=lambda e: (e[0], e[1])):  # an end before a start at the same instant
        alive += step
        most = max(most, alive)
    return most, len(events) // 2


class _Busy:
    """An actor of the pool that takes a while over each batch (so the pool wants to grow)."""

    def __call__(self, batch):
        time.sleep(0.3)
        return batch


@pytest.mark.slow
def test_a_min_max_pool_never_runs_more_actors_than_the_cpus_hold_at_cpus_per_actor(ray_local):
    """A ``[min, max]`` pool with 1 CPU per actor on a 2-CPU Ray, given the plan the job gives
    Ray Data (:func:`pipeline.ray_setup.pool_plan`) and 40 batches of work: at most 2 actors are
    alive at once (when each reserved (CPUs - 1) / max of a CPU, 5 ran at once)."""
    import ray

    from pipeline.config import load_config
    from pipeline.ray_setup import pool_plan

    plan = pool_plan(load_config(None, ["compute.num_actors=[1, 6]", "compute.cpus_per_actor=1"]), embedded=True)
    since = time.time() * 1000 - 1000
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        ds = ray.data.range(40, override_num_blocks=40).map_batches(
            _Busy, batch_size=1, compute=plan.strategy(), num_cpus=plan.cpus, zero_copy_batch=True)
        assert ds.count() == 40
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    most, started = _most_actors_at_once(since)
    assert 1 <= most <= EMBEDDED_CPUS, (most, started)


def test_two_pools_in_one_driver_keep_their_load_facts_apart(ray_local):
    """Each actor pool gets its own load board: two runs in one driver process (threads, a
    test session) never read or wipe each other's posts, and a board outlives nothing but its
    handle (a named, job-wide board lost a run's posts to another run's opening)."""
    import ray

    from pipeline.ray_setup import open_load_board, post_load_facts, read_load_board

    @ray.remote(num_cpus=0)
    def load(board, pid):
        return post_load_facts({"pid": pid}, board)

    first, second = open_load_board(), open_load_board()
    assert ray.get([load.remote(first, 1), load.remote(first, 2)]) == [True, True]
    third = open_load_board()  # a later pool opening its board leaves the first's posts alone
    assert ray.get(load.remote(second, 3)) is True
    assert sorted(p["pid"] for p in read_load_board(first)) == [1, 2]
    assert read_load_board(second) == [{"pid": 3}] and read_load_board(third) == []
    assert read_load_board(None) == [] and post_load_facts({"pid": 4}, None) is False


def test_a_plan_the_cluster_cannot_hold_is_refused_with_the_numbers(ray_local, tiny_models, tmp_path, caplog):
    cfg = lambda *o: job_config(tiny_models, "unused", str(tmp_path / "o"), overrides=list(o))
    with pytest.raises(PlanError, match=f"compute.num_actors=3 x compute.cpus_per_actor=1 = 3 CPUs, but the "
                                        f"cluster has {EMBEDDED_CPUS}"):
        check_resource_plan(cfg("compute.num_actors=3"), embedded=True)
    with pytest.raises(PlanError, match="compute.gpus_per_actor=1 = 1 GPUs, but the cluster has 0"):
        check_resource_plan(cfg("compute.gpus_per_actor=1"), embedded=True)
    with pytest.raises(PlanError, match=f"compute.cpus_per_actor=3 CPUs per actor, but no node has more than "
                                        f"{EMBEDDED_CPUS}"):
        check_resource_plan(cfg("compute.cpus_per_actor=3"), embedded=True)
    check_resource_plan(cfg(f"compute.num_actors={EMBEDDED_CPUS}"), embedded=True)  # every CPU: fine
    with caplog.at_level(logging.WARNING, logger="specbatch"):  # a cluster that may autoscale: a warning
        check_resource_plan(cfg("compute.num_actors=3"), embedded=False)
    assert "waiting for the cluster to grow" in caplog.text


@pytest.mark.slow
def test_the_command_line_refuses_more_actors_than_cpus(tiny_models, inputs, tmp_path):
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    n = os.cpu_count() + 1
    r = subprocess.run([sys.executable, str(REPO / "jobs" / "summarize.py"), "--input", str(inputs), "--output",
                        str(tmp_path / "out"), "--target", tiny_models["target"], "--drafter", tiny_models["drafter"],
                        "--num-actors", str(n)], capture_output=True, text=True, env=env, timeout=180)
    assert r.returncode == 2, r.stderr[-3000:]
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert errors == [f"error: the actor pool cannot be scheduled: compute.num_actors={n} x compute.cpus_per_actor=1 "
                      f"= {n} CPUs, but the cluster has {os.cpu_count()}; lower compute.num_actors or the "
                      "per-actor resources"]
    assert "Traceback" not in r.stderr


class _StuckActor(GenerateActor):
    """Never returns from the row 'hang here' (a stuck model, a hung read, a lost node...)."""

    def generate_rows(self, rows):
        if any(row.get("text") == "hang here" for row in rows):
            time.sleep(3600)
        return super().generate_rows(rows)


def _alive_generate_actors():
    from ray._private import state

    return [a for a in state.actors().values() if "GenerateActor" in a["ActorClassName"] and a["State"] == "ALIVE"]


@pytest.mark.parametrize("wrap", ["system_error", "cause_replaced", "none"])
def test_the_stall_error_survives_code_that_rewraps_what_it_interrupted(wrap):
    """SIGALRM's StallError can land inside a C call (CPython then raises SystemError "returned a
    result with an exception set") and Ray Data re-raises that error from its own exception,
    dropping the StallError from the chain: the guard still raises the StallError, naming the
    timeout (a CI run once printed the SystemError instead)."""
    from pipeline.run import StallError, stall_guard

    def waiting():
        deadline = time.monotonic() + 10
        try:
            while time.monotonic() < deadline:
                time.sleep(0.05)
        except StallError:
            if wrap == "system_error":
                raise SystemError("<built-in method __new__> returned a result with an exception set")
            if wrap == "cause_replaced":
                raise SystemError("wrapped") from RuntimeError("SystemException")
            raise

    t0 = time.monotonic()
    with pytest.raises(StallError, match=r"compute.stall_timeout_s=1\b") as e:
        with stall_guard(1.0, lambda: "0 of 1 rows done"):
            waiting()
    assert time.monotonic() - t0 < 5 and "0 of 1 rows done" in str(e.value)
    with stall_guard(1.0, lambda: "") as beat:  # beats in time: nothing raised
        for _ in range(3):
            time.sleep(0.4)
            beat()


def test_a_run_that_makes_no_progress_fails_after_the_stall_timeout(ray_local, tiny_models, tmp_path, monkeypatch,
                                                                   capsys):
    import actors.generate
    from pipeline.cli import main

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    monkeypatch.setattr(actors.generate, "GenerateActor", _StuckActor)
    write_jsonl(tmp_path / "in" / "a.jsonl", [{"id": "a", "text": TEXTS[0]}])
    write_jsonl(tmp_path / "in" / "b.jsonl", [{"id": "b", "text": "hang here"}])
    t0 = time.monotonic()
    try:
        rc = main("summarize", ["--input", str(tmp_path / "in"), "--output", str(tmp_path / "out"), "--target",
                                tiny_models["target"], "--method", "plain", "--rows-per-batch", "1",
                                "--max-new-tokens", "4", "--no-progress", "--set", "compute.stall_timeout_s=8",
                                "--set", "output.partition_by_date=false"])
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    elapsed = time.monotonic() - t0
    assert rc == 1
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "no output row came back for" in err[0] and "compute.stall_timeout_s=8" in err[0]
    assert "of 2 rows done" in err[0] and "Committed units are kept" in err[0]
    assert elapsed < 8 + 5 + 60  # the stall (checked every 5 s) plus start-up
    assert not (tmp_path / "out" / "_SUCCESS").exists()
    deadline = time.monotonic() + 60  # the stuck actor does not outlive the run
    while _alive_generate_actors() and time.monotonic() < deadline:
        time.sleep(1)
    assert not _alive_generate_actors()
