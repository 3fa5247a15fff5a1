"""``ray job submit`` for real, on a local 2-node cluster of one CPU per node started on
127.0.0.1 (``ray start --head --num-cpus=1`` and a worker ``ray start --address=...
--num-cpus=1``): the summarize job submitted with ``--working-dir .`` with 1 and 2 actors
(2 actors take every CPU of the cluster: the job used to hang there with ``Pending Demands:
{'CPU': 0.25}``), SUCCEEDED, output checked, cluster stopped.

Slow (~2 min on 2 cores: a second Ray cluster starts and uploads the working dir).  Runs by
default; deselect with ``-m "not slow"``.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from pipeline_testkit import REPO, TEXTS, free_port, write_jsonl

pytestmark = pytest.mark.slow

EXCLUDES = ["/.venv", "/.git", "/models", "/out", "/runs", "/data", "/shared", "**/__pycache__", "/.pytest_cache"]


NODE_PORTS = ("dashboard-agent-listen-port", "dashboard-agent-grpc-port", "runtime-env-agent-port",
              "metrics-export-port", "node-manager-port", "object-manager-port")


def _stop(proc):
    """Stop a ``ray start --block`` we started: SIGTERM stops its processes."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # leftovers of our process group, if any
    except ProcessLookupError:
        pass


@pytest.fixture(scope="module")
def ray_head():
    """A 2-node cluster: ``ray start --head --block`` and a worker ``ray start --block``, one
    CPU each, each in its own process group; yields the dashboard URL."""
    ports = {k: free_port() for k in ("port", "dashboard-port", "ray-client-server-port", *NODE_PORTS)}
    worker_ports = {k: free_port() for k in NODE_PORTS}
    temp_dir = tempfile.mkdtemp(prefix="rj", dir="/tmp")
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.pop("RAY_ADDRESS", None)
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    # Ray >= 2.5x starts clusters with token authentication; the CLI sends the token
    # (~/.ray/auth_token) only in token mode.
    env["RAY_AUTH_MODE"] = "token"
    ray_bin = str(Path(sys.executable).parent / "ray")
    cmd = [ray_bin, "start", "--head", "--block", "--node-ip-address=127.0.0.1",
           "--dashboard-host=127.0.0.1", "--include-dashboard=true", "--num-cpus=1",
           f"--object-store-memory={200 * 2**20}", f"--temp-dir={temp_dir}", "--disable-usage-stats",
           *[f"--{k}={v}" for k, v in ports.items()]]
    log = open(Path(temp_dir) / "ray-start.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    worker = None
    url = f"http://127.0.0.1:{ports['dashboard-port']}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(url + "/api/version", timeout=2):
                    break
            except urllib.error.HTTPError:  # 401: up, with token authentication on
                break
            except Exception:
                pass
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("ray start --head failed:\n" + (Path(temp_dir) / "ray-start.log").read_text()[-3000:])
            time.sleep(1)
        worker = subprocess.Popen(
            [ray_bin, "start", "--block", f"--address=127.0.0.1:{ports['port']}", "--node-ip-address=127.0.0.1",
             "--num-cpus=1", f"--object-store-memory={200 * 2**20}", "--disable-usage-stats",
             *[f"--{k}={v}" for k, v in worker_ports.items()]],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        while "2 node" not in _nodes(ray_bin, ports["port"], env):
            if worker.poll() is not None or time.time() > deadline + 60:
                raise RuntimeError("the worker node did not join:\n" + (Path(temp_dir) / "ray-start.log").read_text()[-3000:])
            time.sleep(1)
        yield {"url": url, "env": env}
    finally:
        for p in (worker, proc):  # the worker first, then the head
            if p is not None:
                _stop(p)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _nodes(ray_bin, port, env) -> str:
    """``"<n> node(s) alive"`` as the GCS sees it."""
    code = ("import ray; ray.init(address='127.0.0.1:%d', logging_level='ERROR'); "
            "print(sum(n['Alive'] for n in ray.nodes()), 'node(s) alive')" % port)
    r = subprocess.run([str(Path(ray_bin).parent / "python"), "-c", code], env=env, capture_output=True, text=True,
                       timeout=60)
    return r.stdout


def test_ray_job_submit_summarize(ray_head, tiny_models, tmp_path):
    """With 2 actors, the actor pool holds both CPUs of the cluster, one per node (one actor
    was a second run of the same path, about a minute of the suite: the cluster tests of
    tests/cluster run one-actor jobs on a cluster)."""
    actors = 2
    write_jsonl(tmp_path / "in" / "prompts.jsonl", [{"id": i, "text": t} for i, t in enumerate(TEXTS[:5])])
    out = tmp_path / "out"
    config = {
        "input": {"uri": str(tmp_path / "in" / "prompts.jsonl")},
        "models": {"target": tiny_models["target"], "drafter": tiny_models["drafter"]},
        "method": {"name": "draft_model", "num_assistant_tokens": 3},
        "generation": {"max_new_tokens": 8},
        "compute": {"num_actors": actors, "rows_per_batch": 2, "stall_timeout_s": 150},
        "output": {"uri": str(out)},
    }
    cfg_path = tmp_path / "tiny.yaml"
    cfg_path.write_text(yaml.safe_dump(config))

    submit = subprocess.run(
        [str(Path(sys.executable).parent / "ray"), "job", "submit", "--address", ray_head["url"],
         "--working-dir", ".", "--runtime-env-json", json.dumps({"excludes": EXCLUDES}), "--no-wait",
         "--", "python", "jobs/summarize.py", "--config", str(cfg_path), "--no-progress"],
        cwd=REPO, env=ray_head["env"], capture_output=True, text=True, timeout=180,
    )
    assert submit.returncode == 0, submit.stdout + submit.stderr
    job_id = next(w.strip("'") for line in submit.stdout.splitlines() for w in line.split() if w.strip("'").startswith("raysubmit_"))

    def ray_job(*args):
        r = subprocess.run([str(Path(sys.executable).parent / "ray"), "job", *args, "--address", ray_head["url"]],
                           env=ray_head["env"], capture_output=True, text=True, timeout=60)
        return r.stdout + r.stderr

    deadline = time.time() + 240
    while True:
        status = ray_job("status", job_id).upper()  # "... succeeded" / "Status ...: SUCCEEDED"
        if any(s in status for s in ("SUCCEEDED", "FAILED", "STOPPED")):
            break
        assert time.time() < deadline, "job did not finish in 240 s:\n" + status + ray_job("logs", job_id)[-5000:]
        time.sleep(2)
    logs = ray_job("logs", job_id)
    assert "SUCCEEDED" in status, status + logs[-5000:]

    table = pq.read_table(out)
    assert table.num_rows == 5 and table.column("error").null_count == 5
    assert (out / "_SUCCESS").exists()
    summary = json.loads((out / "_summary.json").read_text())
    assert summary["rows"] == 5 and summary["new_tokens"] == sum(table.column("new_tokens").to_pylist())
    assert '"rows": 5' in logs  # the job printed its summary headline
