"""The job entry points as a user runs them: ``python jobs/summarize.py --config ...`` with an
embedded Ray, a progress bar of rows done; bad configs refused with exit status 2."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from pipeline_testkit import REPO, TEXTS, write_jsonl


def _run(args, cwd=REPO, timeout=300, extra_env=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECBATCH_")}
    env.update(extra_env or {})
    env.pop("RAY_ADDRESS", None)
    # as a user runs it: not the PYTHONPATH that the ray_local fixture put in this process's
    # environment (it would hide a missing init_ray in the job)
    env.pop("PYTHONPATH", None)
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_local_translate_job_with_embedded_ray(tiny_models, tmp_path):
    write_jsonl(tmp_path / "in.jsonl", [{"id": i, "text": t} for i, t in enumerate(TEXTS[:3])])
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump({
        "input": {"uri": str(tmp_path / "in.jsonl")},
        "task": {"name": "translate", "source_lang": "English", "target_lang": "French"},
        "models": tiny_models,
        "method": {"name": "prompt_lookup", "prompt_lookup_num_tokens": 4},
        "generation": {"max_new_tokens": 6},
        "compute": {"rows_per_batch": 2},
        "output": {"uri": str(tmp_path / "out")},
    }))
    # run from another directory: the entry point finds pipeline/ and actors/ itself
    r = _run([str(REPO / "jobs" / "translate.py"), "--config", str(cfg), "--set", "compute.num_actors=1"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "rows done" in r.stderr and "3/3" in r.stderr  # the progress bar
    headline = json.loads(r.stdout[r.stdout.index("{"):])
    assert headline["rows"] == 3 and headline["errors"] == 0
    t = pq.read_table(tmp_path / "out")
    assert t.num_rows == 3 and set(t.column("method").to_pylist()) == {"prompt_lookup"}
    assert t.column("prompt")[0].as_py().startswith("Translate the following text from English to French")


@pytest.mark.parametrize("args, message", [
    (["--set", "method.name=nope"], "unknown method 'nope'"),
    (["--set", "compute.bogus=1"], "unknown key compute.bogus"),
    (["--input", "/nonexistent/prompts/*.jsonl"], "input not found"),
    (["--target", "/nonexistent/model"], "models.target: model path '/nonexistent/model' does not exist"),
    # a real model the set-up did not fetch (Gemma 3: on first use): the command that fetches it
    (["--target", "/nonexistent/models/cache/gemma-3-270m"],
     "fetched and converted on first use by: python scripts/fetch_models.py --only gemma-3-270m"),
    (["--config", "/nonexistent.yaml"], "config file not found"),
])
def test_bad_job_is_refused_before_any_model_loads(tmp_path, args, message):
    write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "text": "x"}])
    base = ["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out")]
    r = _run([str(REPO / "jobs" / "summarize.py"), *base, *args], timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "out").exists()


def test_a_tree_setting_the_method_cannot_draft_is_refused_before_ray_starts(tmp_path):
    """Issue 49: the method's capabilities are its spec's (``MethodSpec.tree_refusal``), checked
    with the config, so the job exits 2 naming the key before Ray or any weights load."""
    out = tmp_path / "out"
    r = _run([str(REPO / "jobs" / "summarize.py"), "--config", str(REPO / "configs" / "demo-summarize.yaml"),
              "--method", "early_exit", "--set", "method.assistant_early_exit=1", "--set", "method.num_candidates=4",
              "--output", str(out)], timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "num_candidates=4" in r.stderr and "early_exit" in r.stderr and "drafts no token trees" in r.stderr
    assert "Traceback" not in r.stderr and "Ray" not in r.stderr and not out.exists()


def test_a_bad_environment_switch_is_refused_before_ray_starts_and_a_misspelt_one_is_named(tmp_path):
    """Issue 56 item 5: ``SPECBATCH_CPU_LEAN_PASS=maybe`` used to kill the actors 47 s into
    the run (exit 1, an epoch left in the output); ``SPECBATCH_CPU_LEANPASS`` was ignored."""
    out = tmp_path / "out"
    r = _run([str(REPO / "jobs" / "summarize.py"), "--config", str(REPO / "configs" / "demo-summarize.yaml"),
              "--output", str(out)], timeout=120,
             extra_env={"SPECBATCH_CPU_LEAN_PASS": "maybe", "SPECBATCH_CPU_LEANPASS": "0"})
    assert r.returncode == 2, r.stdout + r.stderr
    assert "SPECBATCH_CPU_LEAN_PASS='maybe'" in r.stderr and "refused before work starts" in r.stderr
    assert "unknown environment variable SPECBATCH_CPU_LEANPASS" in r.stderr
    assert "did you mean SPECBATCH_CPU_LEAN_PASS?" in r.stderr
    assert "Traceback" not in r.stderr and "Ray" not in r.stderr and not out.exists()


def test_every_switch_the_code_reads_is_in_the_one_table():
    """The table (pipeline/switches.py) lists every ``SPECBATCH_*`` name the repository reads
    (source, scripts, deploy files), so no real switch is ever warned of as unknown; a
    misspelt one is, with the closest known name, and a bad value of each kind is refused."""
    import re

    from pipeline.config import ConfigError
    from pipeline.switches import SWITCHES, check_environment

    names = set()
    for pattern in ("pipeline/**/*.py", "actors/**/*.py", "jobs/*.py", "scripts/*", "deploy/**/*.yaml", "tests/**/*.py"):
        for path in REPO.glob(pattern):
            if path.is_file() and path.resolve() != Path(__file__).resolve():  # this file misspells some
                names.update(re.findall(r"SPECBATCH_[A-Z_]*[A-Z]", path.read_text(errors="replace")))
    names -= {"SPECBATCH_CPU"}  # the prefix of the CPU options' names (SPECBATCH_CPU_<FIELD>)
    assert names and names <= set(SWITCHES), sorted(names - set(SWITCHES))
    assert check_environment({"SPECBATCH_CPU_KERNELS": "off", "SPECBATCH_API_KEY": "x", "SPECBATCH_RUN_DATE": "",
                              "PATH": "/bin"}) == []
    warned = check_environment({"SPECBATCH_INDUCTR": "1", "SPECBATCH_ZZZZZZZZZZ": "1"})
    assert warned[0].endswith("did you mean SPECBATCH_INDUCTOR?") and "SPECBATCH_ZZZZZZZZZZ" in warned[1]
    for name, value in [("SPECBATCH_FUSED", "2"), ("SPECBATCH_RUN_DATE", "tonight"), ("SPECBATCH_SKIP_REAL_MODELS", "y")]:
        with pytest.raises(ConfigError, match=name):
            check_environment({name: value})


def test_translate_entry_point_refuses_a_summarize_config():
    r = _run([str(REPO / "jobs" / "translate.py"), "--config", str(REPO / "configs" / "summarize.yaml"), "--print-config"])
    assert r.returncode == 2 and "task.name: translate" in r.stderr


def test_unreadable_shard_is_refused_before_any_model_loads(tmp_path):
    (tmp_path / "in").mkdir()
    write_jsonl(tmp_path / "in" / "a.jsonl", [{"id": 1, "text": "x"}])
    (tmp_path / "in" / "b.parquet").write_bytes(b"PAR1 but not really parquet")
    r = _run([str(REPO / "jobs" / "summarize.py"), "--input", str(tmp_path / "in"), "--output", str(tmp_path / "out")],
             timeout=120)
    assert r.returncode == 2 and "b.parquet" in r.stderr and "unreadable as parquet" in r.stderr


def _job_parsers():
    """Every job's parser, as its entry point builds it."""
    import importlib.util

    from pipeline import cli
    from pipeline.serve import app

    parsers = {"summarize": cli.build_parser("summarize", "c.yaml"), "translate": cli.build_parser("translate", "c.yaml"),
               "generate": cli.build_parser("generate", "c.yaml"), "serve": app.build_parser()}
    for job in ("tune", "report", "prepare_inputs", "train_drafter"):
        spec = importlib.util.spec_from_file_location(f"job_{job}", REPO / "jobs" / f"{job}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        parsers[job] = module.build_parser()
    return parsers


def test_every_job_parser_is_built_from_the_one_flag_table():
    """A flag a job adds by hand, or a copy whose name, type or shape drifts from the table,
    fails here; so does a table entry no job uses, or one name used for two flags."""
    from pipeline.flags import FLAGS, JOB_FLAGS, flag_names

    parsers = _job_parsers()
    assert set(parsers) == set(JOB_FLAGS)
    for job, parser in parsers.items():
        options = [a for a in parser._actions if a.option_strings and a.dest != "help"]
        assert sorted(s for a in options for s in a.option_strings) == sorted(flag_names(job)), job
        for action in options:
            flag = FLAGS[action.dest]
            assert action.option_strings == [flag.name, *flag.aliases], (job, action.dest)
            switch = flag.action in ("store_true", "store_false")
            assert action.type is flag.type and action.nargs == (0 if switch else flag.nargs), (job, flag.name)
            assert (action.const if switch else None) == (flag.action == "store_true" if switch else None)
            assert action.metavar == flag.metavar, (job, flag.name)
    used = {dest for flags in JOB_FLAGS.values() for dest in flags}
    assert used == set(FLAGS), f"flags no job takes: {sorted(set(FLAGS) - used)}"
    names = [s for f in FLAGS.values() for s in (f.name, *f.aliases)]
    assert len(names) == len(set(names))


def test_every_flag_key_is_a_config_key():
    from pipeline.config import JobConfig
    from pipeline.flags import CONFIG_JOBS, FLAGS, JOB_FLAGS

    for job in CONFIG_JOBS:
        for dest in JOB_FLAGS[job]:
            key = FLAGS[dest].key_for(job)
            if key is None:
                continue
            section, name = key.split(".")
            assert name in JobConfig.model_fields[section].annotation.model_fields, (job, FLAGS[dest].name, key)


def test_output_is_the_output_folder_everywhere_and_out_an_alias(capsys):
    from pipeline.flags import JOB_FLAGS, config_overrides

    for job, parser in _job_parsers().items():
        if "output" not in JOB_FLAGS[job]:
            continue
        runs = ["r"] if job == "report" else []
        assert parser.parse_args([*runs, "--output", "o1"]).output == "o1"
        assert "deprecated" not in capsys.readouterr().err
        assert parser.parse_args([*runs, "--out", "o2"]).output == "o2"
        assert "--out is a deprecated alias of --output" in capsys.readouterr().err
    parser = _job_parsers()["summarize"]
    args = parser.parse_args(["--set", "a.b=1", "--out", "x", "--overwrite", "--run-date", "2026-01-02",
                              "--max-batch-size", "3"])
    assert config_overrides("summarize", args) == [
        "a.b=1", 'output.uri="x"', "compute.max_batch_size=3", "output.overwrite=true",
        'output.run_date="2026-01-02"', "output.partition_by_date=true"]
    serve = _job_parsers()["serve"].parse_args(["--max-batch-size", "5", "--port", "9"])
    assert config_overrides("serve", serve) == ["serve.port=9", "serve.max_batch_size=5"]
    tune = _job_parsers()["tune"].parse_args(["--output", "t"])
    assert config_overrides("tune", tune) == []  # the tuner's --output is its report folder, not output.uri


@pytest.mark.parametrize("rewrapped", [False, True])
def test_a_sigterm_is_an_interrupt_even_when_the_code_it_landed_in_raises_another_error(tmp_path, monkeypatch,
                                                                                      capsys, rewrapped):
    """SIGTERM raises KeyboardInterrupt in the main thread; inside a C call under Ray Data it can come
    back as another error (SystemError, its cause replaced): the job still says it was interrupted,
    exit 143, and the next run in the process starts with no signal on record."""
    import signal

    import pipeline.run
    from pipeline import cli

    def run_job(cfg, progress=True):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(100):
                import time
                time.sleep(0.01)
        except KeyboardInterrupt:
            if rewrapped:
                raise SystemError("returned a result with an exception set") from RuntimeError("SystemException")
            raise
        raise AssertionError("no interrupt")

    monkeypatch.setattr(pipeline.run, "run_job", run_job)
    monkeypatch.setattr(cli, "_exit_at_next_interrupt", lambda: None)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        argv = ["--input", str(tmp_path), "--output", str(tmp_path / "out"), "--no-progress"]
        assert cli.main("summarize", argv) == 128 + signal.SIGTERM
        assert "interrupted (SIGTERM)" in capsys.readouterr().err

        def failing(cfg, progress=True):
            raise RuntimeError("boom")

        monkeypatch.setattr(pipeline.run, "run_job", failing)
        assert cli.main("summarize", argv) == 1  # a later failure is a failure, not the old signal
        assert "interrupted" not in capsys.readouterr().err
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_two_failures_in_one_second_write_two_log_files(tmp_path, monkeypatch):
    from pipeline import cli

    monkeypatch.setattr(cli, "log_dir", lambda: tmp_path)
    paths = [cli._write_log(RuntimeError(f"failure {i}")) for i in range(3)]
    assert len(set(paths)) == 3 and all(os.stat(p).st_mode & 0o777 == 0o600 for p in paths)
    assert [open(p).read().strip().splitlines()[-1] for p in paths] == [f"RuntimeError: failure {i}" for i in range(3)]
