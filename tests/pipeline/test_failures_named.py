"""Every failure names its cause, in one line: a Parquet file whose footer reads but whose
data pages do not is refused before any work (local disk and moto S3), or, above
``input.preflight_read_max_bytes``, fails the run naming the file and the cause; actors
that keep dying say which budget ran out, with no Ray traceback on the console; the error
logs go to a per-user folder of mode 700."""

import io
import os
import stat
import subprocess
import sys
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.cli import _write_log, log_dir, main
from pipeline.config import InputConfig
from pipeline.input import InputError, resolve_shards
from pipeline_testkit import REPO, TEXTS, write_jsonl


def damaged_parquet(column: str = "text", rows: int = 64, where: str = "all") -> bytes:
    """A Parquet file (columns id, text, extra) whose footer is intact and one column
    chunk's pages are overwritten: all of it, or just its first page header."""
    buf = io.BytesIO()
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(rows)], "text": [TEXTS[i % 8] * 2 for i in range(rows)],
                             "extra": list(range(rows))}), buf)
    raw = bytearray(buf.getvalue())
    meta = pq.ParquetFile(io.BytesIO(bytes(raw))).metadata
    chunk = meta.row_group(0).column(meta.schema.names.index(column))
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    end = start + (chunk.total_compressed_size if where == "all" else 12)
    for i in range(start + 1, end - 1):
        raw[i] ^= 0x5A
    pq.ParquetFile(io.BytesIO(bytes(raw))).metadata  # the footer still reads
    return bytes(raw)


def good_parquet(rows: int = 3) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.table({"id": [f"g{i}" for i in range(rows)], "text": TEXTS[:rows]}), buf)
    return buf.getvalue()


@pytest.fixture(params=["local", "s3"])
def place(request, tmp_path):
    """``(put(name, bytes), input uri, storage options)`` of an input folder."""
    if request.param == "local":
        d = tmp_path / "in"
        d.mkdir()
        return (lambda name, data: (d / name).write_bytes(data)), str(d), {}
    moto = request.getfixturevalue("moto_s3")
    moto["client"].create_bucket(Bucket="damaged")
    prefix = tmp_path.name
    return ((lambda name, data: moto["client"].put_object(Bucket="damaged", Key=f"{prefix}/{name}", Body=data)),
            f"s3://damaged/{prefix}/", moto["options"])


@pytest.mark.parametrize("column, where", [("text", "all"), ("text", "header"), ("id", "all")])
def test_a_damaged_data_page_is_refused_before_any_work_naming_the_file_and_the_cause(place, column, where):
    put, uri, options = place
    put("a.parquet", good_parquet())
    put("b.parquet", damaged_parquet(column, where=where))
    with pytest.raises(InputError, match=r"input shard '.*b\.parquet' is damaged: its footer reads, but a data page "
                                         r"of its 'id' and 'text' columns does not \((OSError|ArrowInvalid|ArrowIOError)"
                                         r": .+\)"):
        resolve_shards(InputConfig(uri=uri, storage_options=options))


def test_a_damaged_page_of_a_column_the_job_does_not_read_is_no_problem(place):
    put, uri, options = place
    put("b.parquet", damaged_parquet("extra"))
    (shard,) = resolve_shards(InputConfig(uri=uri, storage_options=options))
    assert shard.num_rows == 64


def test_above_the_bound_the_pages_are_not_read_before_the_run(place):
    put, uri, options = place
    put("b.parquet", damaged_parquet())
    (shard,) = resolve_shards(InputConfig(uri=uri, storage_options=options, preflight_read_max_bytes=100))
    assert shard.num_rows == 64  # only its footer was read


@pytest.mark.slow
def test_a_damaged_page_above_the_bound_fails_the_run_in_one_line_naming_the_file(ray_local, tiny_models, tmp_path,
                                                                                 capsys):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.parquet").write_bytes(good_parquet())
    (tmp_path / "in" / "b.parquet").write_bytes(damaged_parquet())
    code = main("summarize", ["--input", str(tmp_path / "in"), "--output", str(tmp_path / "out"),
                              "--target", tiny_models["target"], "--method", "plain", "--max-new-tokens", "2",
                              "--no-progress", "--set", "input.preflight_read_max_bytes=1000",
                              "--set", "output.partition_by_date=false"])
    err = capsys.readouterr().err
    said = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert code == 1 and len(said) == 1, err[-3000:]
    assert said[0].startswith(f"error: read input shard '{tmp_path / 'in' / 'b.parquet'}' failed (not retried): ")
    assert "Couldn't deserialize thrift" in said[0] or "OSError" in said[0]
    assert "RayTaskError" not in said[0] and "UserCodeException" not in said[0]
    assert not (tmp_path / "out" / "_SUCCESS").exists()


# ---------------------------------------------------------------------------- error logs
def test_the_error_log_folder_is_per_user_and_private(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    d = log_dir()
    assert d == tmp_path / "state" / "specbatch" / "logs"
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    os.chmod(d, 0o755)  # made readable by someone: tightened again
    assert stat.S_IMODE(log_dir().stat().st_mode) == 0o700
    try:
        raise RuntimeError("boom")
    except RuntimeError as e:
        path = _write_log(e)
    assert os.path.dirname(path) == str(d) and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert "RuntimeError: boom" in open(path).read()

    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert log_dir() == tmp_path / "home" / ".cache" / "specbatch" / "logs"


def test_without_a_usable_home_the_logs_go_to_a_fresh_private_folder(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(blocker))
    a, b = log_dir(), log_dir()
    assert a != b and a.name.startswith("specbatch-logs-") and stat.S_IMODE(a.stat().st_mode) == 0o700


# ---------------------------------------------------------------------------- actors that keep dying
CRASHING_JOB = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, sys.argv.pop(1))
    import actors.generate
    from ray import cloudpickle

    class Crashing(actors.generate.GenerateActor):
        def generate_rows(self, rows):
            if any("crash me" == r.get("text") for r in rows):
                os._exit(1)  # the process dies, as out of memory would kill it
            return super().generate_rows(rows)

    import __main__
    cloudpickle.register_pickle_by_value(__main__)
    actors.generate.GenerateActor = Crashing
    from pipeline.cli import main
    sys.exit(main("summarize"))
""")


@pytest.mark.slow
def test_actors_that_keep_dying_are_one_line_saying_the_restarts_ran_out(tiny_models, tmp_path):
    script = tmp_path / "crashing_job.py"
    script.write_text(CRASHING_JOB)
    write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "text": TEXTS[0]}, {"id": 2, "text": "crash me"}])
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", XDG_STATE_HOME=str(tmp_path / "state"))
    env.pop("RAY_ADDRESS", None)
    r = subprocess.run([sys.executable, str(script), str(REPO), "--input", str(tmp_path / "in.jsonl"),
                        "--output", str(tmp_path / "out"), "--target", tiny_models["target"], "--method", "plain",
                        "--max-new-tokens", "2", "--rows-per-batch", "1", "--no-progress",
                        "--set", "compute.max_actor_restarts=1", "--set", "compute.max_batch_retries=4"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 1, r.stderr[-3000:]
    said = [ln for ln in r.stderr.splitlines() if ln.strip() and " specbatch INFO " not in ln
            and "Started a local Ray instance" not in ln and "core_worker.cc:2465" not in ln]
    assert len(said) == 1, r.stderr[-3000:]
    assert said[0].startswith("error: the actor pool ran out of restarts: an actor died 2 times, and "
                              "compute.max_actor_restarts=1 allows 1 restarts"), said[0]
    assert "Traceback" not in r.stderr and "An exception was raised from a task" not in r.stderr
    log = said[0].split("(traceback in ", 1)[1].split(")", 1)[0]
    assert log.startswith(str(tmp_path / "state" / "specbatch" / "logs")) and "ActorDiedError" in open(log).read()


KILLED_JOB = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, sys.argv.pop(1))
    pids = sys.argv.pop(1)
    import actors.generate
    from ray import cloudpickle

    class Waiting(actors.generate.GenerateActor):
        def generate_rows(self, rows):
            if any("kill me" == r.get("text") for r in rows):
                open(os.path.join(pids, str(os.getpid())), "w").close()  # the test kills this process
                time.sleep(600)
            return super().generate_rows(rows)

    import __main__
    cloudpickle.register_pickle_by_value(__main__)
    actors.generate.GenerateActor = Waiting
    from pipeline.cli import main
    sys.exit(main("summarize"))
""")


@pytest.mark.parametrize("budget", [0, 1, 4])
def test_the_budget_that_ran_out_is_read_from_ray_s_actor_table(budget, monkeypatch):
    """The line for budgets 0, 1 and 4, from the actor table Ray keeps (the pool's actor
    DEAD after ``budget`` restarts); the integration test below kills a real actor."""
    import datetime as dt

    from ray._private import state
    from ray.exceptions import ActorDiedError

    from pipeline.config import load_config
    from pipeline.run import _actor_pool_failure

    started = dt.datetime.now()
    table = {"a1": {"ActorClassName": "MapWorker(MapBatches(GenerateActor))", "State": "DEAD", "NumRestarts": budget,
                    "StartTime": started.timestamp() * 1000 + 5}}
    monkeypatch.setattr(state, "actors", lambda: table)
    cfg = load_config(REPO / "configs" / "demo-summarize.yaml", [f"compute.max_actor_restarts={budget}"])
    died = ActorDiedError()
    wrapped = RuntimeError("a Ray Data operator failed")
    wrapped.__cause__ = died
    line = _actor_pool_failure(cfg, wrapped, started)
    times = "1 time" if budget == 0 else f"{budget + 1} times"
    assert line.startswith(f"the actor pool ran out of restarts: an actor died {times}, and "
                           f"compute.max_actor_restarts={budget} allows {budget} restarts (ActorDiedError: "), line
    table["a1"]["State"] = "ALIVE"  # restarted, and the batch's retries ran out first
    assert _actor_pool_failure(cfg, wrapped, started).startswith("a batch failed after compute.max_batch_retries=") \
        if budget else _actor_pool_failure(cfg, wrapped, started) is None


@pytest.mark.slow
@pytest.mark.parametrize("budget", [4])
def test_an_actor_killed_from_outside_until_its_budget_runs_out_is_one_line_naming_it(tiny_models, tmp_path,
                                                                                      budget):
    """SIGKILL from another process (the kernel's OOM killer, an operator) each time the
    actor holds the batch, until ``compute.max_actor_restarts`` runs out: one line that
    names the budget and how often the actor died (budgets 0 and 1 from the actor table:
    the test above; 1 with an actor that kills itself: the one before)."""
    import signal
    import threading
    import time

    script, pids = tmp_path / "killed_job.py", tmp_path / "pids"
    script.write_text(KILLED_JOB)
    pids.mkdir()
    write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "text": TEXTS[0]}, {"id": 2, "text": "kill me"}])
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", XDG_STATE_HOME=str(tmp_path / "state"))
    env.pop("RAY_ADDRESS", None)
    job = subprocess.Popen([sys.executable, str(script), str(REPO), str(pids), "--input", str(tmp_path / "in.jsonl"),
                            "--output", str(tmp_path / "out"), "--target", tiny_models["target"], "--method", "plain",
                            "--max-new-tokens", "2", "--rows-per-batch", "1", "--no-progress",
                            "--set", f"compute.max_actor_restarts={budget}",
                            "--set", f"compute.max_batch_retries={budget + 4}"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    killed: set[str] = set()

    def killer() -> None:
        while job.poll() is None:
            for f in pids.iterdir():
                if f.name not in killed:
                    killed.add(f.name)
                    try:
                        os.kill(int(f.name), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            time.sleep(0.1)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    try:
        _, err = job.communicate(timeout=400)
    finally:
        if job.poll() is None:
            job.kill()
    t.join(5)
    assert job.returncode == 1, err[-3000:]
    assert len(killed) == budget + 1, (killed, err[-3000:])
    said = [ln for ln in err.splitlines() if ln.strip() and " specbatch INFO " not in ln
            and "Started a local Ray instance" not in ln and ".cc:" not in ln]
    assert len(said) == 1, err[-3000:]
    times = "1 time" if budget == 0 else f"{budget + 1} times"
    assert said[0].startswith(f"error: the actor pool ran out of restarts: an actor died {times}, and "
                              f"compute.max_actor_restarts={budget} allows {budget} restarts"), said[0]
    assert "Traceback (most recent call last)" not in err


def _job_args(tmp_path, target):
    write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "text": TEXTS[0]}])
    return ["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out"), "--target", str(target),
            "--method", "plain", "--max-new-tokens", "2", "--no-progress"]


@pytest.mark.parametrize("files", [["pytorch_model.bin"], ["pytorch_model-00001-of-00002.bin",
                                                           "pytorch_model-00002-of-00002.bin"], ["model.pt"]])
def test_weights_only_as_pickles_are_refused_in_the_preflight_in_one_line(tiny_models, tmp_path, capsys, files,
                                                                          monkeypatch):
    """Before Ray starts (exit 2, one line naming the key and the file), not inside the actor."""
    import shutil

    import torch

    import pipeline.run

    def no_ray(cfg):
        raise AssertionError("Ray started: the pickle-only model was not refused in the preflight")

    monkeypatch.setattr(pipeline.run, "init_ray", no_ray)

    model = tmp_path / "pickled"
    shutil.copytree(tiny_models["target"], model)
    (model / "model.safetensors").unlink()
    for name in files:
        torch.save({"w": torch.zeros(1)}, model / name)
    assert main("summarize", _job_args(tmp_path, model)) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and " specbatch INFO " not in ln]
    assert len(err) == 1 and err[0].startswith("error: models.target: ") and files[0] in err[0] \
        and "a pickle" in err[0] and "safetensors" in err[0], err
    # the same folder with safetensors weights beside the pickle is fine (they are what loads)
    shutil.copy(os.path.join(tiny_models["target"], "model.safetensors"), model)
    from pipeline.models import check_weight_files

    check_weight_files(str(model), "models.target")


@pytest.mark.parametrize("template, bound", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x", "did not render"),
    ("{% for i in range(100000) %}{{ 'xxxxxxxxxxxxxxxxxxxx' }}{% endfor %}", "characters"),
])
def test_a_chat_template_that_loops_without_bound_is_refused_in_the_preflight(tiny_models, tmp_path, capsys,
                                                                            monkeypatch, template, bound):
    import shutil

    import pipeline.prompts as prompts
    from tiny import make_tokenizer

    monkeypatch.setattr(prompts, "RENDER_TIMEOUT_S", 1.0)
    model = tmp_path / "looping"
    shutil.copytree(tiny_models["target"], model)
    make_tokenizer(chat_template=template).save_pretrained(model)
    assert main("summarize", _job_args(tmp_path, model)) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and " specbatch INFO " not in ln]
    assert len(err) == 1 and "task.chat_template" in err[0] and bound in err[0], err


# ---------------------------------------------------------------------------- Ray's published errors
RAYLET_DIED = ("Raylet is terminated. Termination is unexpected. Possible reasons include: (1) SIGKILL by the user "
               "or system OOM killer, (2) Invalid memory access from Raylet causing SIGSEGV or SIGBUS, (3) Other "
               "termination signals. Last 20 lines of the Raylet logs:\n"
               + "".join(f"    [state-dump] NodeManager line {i}\n" for i in range(20)))


RETRIED = ("Task MapWorker(MapBatches(GenerateActor)).get_location failed. There are 3 retries remaining, so the task "
           "will be retried. Error: Traceback (most recent call last):\n  File \"x.py\", line 1\nRuntimeError: boom")


def test_an_error_ray_publishes_to_the_driver_is_one_info_line_not_its_whole_log(monkeypatch, capsys, caplog):
    """A dead raylet's error comes with ~50 lines of its C++ log and state dumps, printed on
    the job's stdout (where its JSON summary goes): the job says it once, in one line of its
    log; worker output forwarded by ``log_to_driver`` still prints as Ray prints it."""
    import logging

    import ray._private.worker as ray_worker

    from pipeline.ray_setup import _ray_errors_in_one_line

    printed = []
    monkeypatch.setattr(ray_worker, "print_to_stdstream", lambda data, ignore_prefix: printed.append(data))
    _ray_errors_in_one_line()
    _ray_errors_in_one_line()  # (a second Ray start in the process does not wrap it twice)
    with caplog.at_level(logging.INFO, logger="specbatch"):
        for _ in range(2):  # published once per subscriber
            ray_worker.print_to_stdstream({"lines": [RAYLET_DIED], "pid": "raylet", "is_err": False},
                                          ignore_prefix=False)
        ray_worker.print_to_stdstream({"lines": ["an actor's print"], "pid": 1234, "is_err": False},
                                      ignore_prefix=False)
        ray_worker.print_to_stdstream({"lines": [RETRIED], "pid": "raylet", "is_err": False}, ignore_prefix=False)
    assert capsys.readouterr().out == ""
    warned = [r.getMessage() for r in caplog.records if r.name == "specbatch" and r.levelno == logging.INFO]
    assert len(warned) == 2 and not any("\n" in w for w in warned), warned
    assert warned[0].startswith("Ray: Raylet is terminated. Termination is unexpected.") and "state-dump" not in warned[0]
    assert "Ray's logs" in warned[0]
    assert warned[1].startswith("Ray: Task MapWorker(MapBatches(GenerateActor)).get_location failed. There are 3 "
                                "retries remaining, so the task will be retried. (the rest") and "Traceback" not in warned[1]
    assert printed == [{"lines": ["an actor's print"], "pid": 1234, "is_err": False}]
