"""Node loss in the middle of a job, on a local multi-node cluster on 127.0.0.1: a head and two
worker nodes of one CPU each (``ray start --head --block`` and two ``ray start --block
--address ...``, each node in its own session, every port its own).  The demo summarize job
(``configs/demo-summarize.yaml``: the tiny demo pair, plain, 2 actors of 1 CPU) runs against it
as ``jobs/summarize.py`` with ``RAY_ADDRESS``, and once a shard has committed, a worker node
that hosts an actor is lost: its raylet and every process of the node (the node's session)
are SIGKILLed at once, as when a machine goes away.

Then either the job finishes with every row exactly once, or it fails with exit 1 in one line
that says the actor pool gave up (docs/reliability.md, exit codes) and the same command, run
again on the surviving nodes, completes with every row exactly once.  The ids of the output
Parquet are checked: none missing, none twice.

Only processes this test started are signalled (the nodes' sessions and the job); no
``ray stop``.  Slow: 7 min measured on the shared 2-core machine at a load average near 20 (the
cluster's start and stop, the job, and the rerun on two nodes).

Ray 2.60, measured here: the batch in flight on the lost node fails with
``ActorUnavailableError`` (the actor could not be reached before the GCS declared its node
dead), which Ray Data does not resubmit, so the job takes the second branch: ``error: the
actor pool lost an actor with a batch in flight ...`` and the rerun completes.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "demo-summarize.yaml"
SHARDS, ROWS = 6, 8
NODE_PORTS = ("dashboard-agent-listen-port", "dashboard-agent-grpc-port", "runtime-env-agent-port",
              "metrics-export-port", "node-manager-port", "object-manager-port")
WORDS = ("the council voted on monday to build a new school near the river after a long debate about "
         "fuel prices storms farmers crops museum ships team season frog forest coast homes power").split()

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _session(proc: subprocess.Popen) -> list[psutil.Process]:
    """Every live process of a node we started: the ``ray start`` process, its descendants,
    and whatever else runs in its session (a node's processes do not leave it)."""
    found: dict[int, psutil.Process] = {}
    try:
        root = psutil.Process(proc.pid)
        for p in [root, *root.children(recursive=True)]:
            found[p.pid] = p
    except psutil.NoSuchProcess:
        pass
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == proc.pid:
                found[p.pid] = p
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return list(found.values())


def _kill_node(proc: subprocess.Popen) -> list[str]:
    """SIGKILL every process of the node at once; returns their names."""
    procs = _session(proc)
    names = []
    for p in procs:
        try:
            names.append(p.name())
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=30)
    proc.wait(timeout=30)
    return names


def _hosts_actor(proc: subprocess.Popen) -> bool:
    for p in _session(proc):
        try:
            if "MapWorker" in " ".join(p.cmdline()):
                return True
        except psutil.Error:
            continue
    return False


class LocalCluster:
    """A head and ``workers`` worker nodes started with ``ray start --block``, one CPU each."""

    def __init__(self, workers: int):
        self.temp_dir = tempfile.mkdtemp(prefix="nl", dir="/tmp")
        self.env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTHONPATH", "VIRTUAL_ENV")}
        self.env.update(PATH=str(Path(sys.executable).parent) + os.pathsep + self.env.get("PATH", ""),
                        RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="token",
                        RAY_AUTH_TOKEN=secrets.token_hex(32),  # this cluster's own token (not ~/.ray's)
                        PYTHONPATH=str(REPO))  # the actors import pipeline/ and actors/ from the clone
        self.ray = str(Path(sys.executable).parent / "ray")
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.nodes: list[subprocess.Popen] = []
        common = ["--block", "--node-ip-address=127.0.0.1", "--num-cpus=1", f"--object-store-memory={100 * 2**20}",
                  "--disable-usage-stats"]
        head_ports = {"port": self.port, "ray-client-server-port": _free_port(), "dashboard-port": _free_port(),
                      **{k: _free_port() for k in NODE_PORTS}}
        self.workers = workers
        self.head_args = ["--head", "--include-dashboard=false", f"--temp-dir={self.temp_dir}", *common,
                          *[f"--{k}={v}" for k, v in head_ports.items()]]
        self.worker_args = [f"--address={self.address}", *common]

    def start(self) -> None:
        self._start(self.head_args)
        for _ in range(self.workers):  # one at a time: raylets starting at once time out on 2 loaded cores
            self._start(self.worker_args, node_ports=True)

    def _start(self, args: list[str], node_ports: bool = False, attempts: int = 3) -> None:
        """Start a node and wait until ``ray start`` says it runs.  Ray gives a new node 30 s
        to register with the GCS; on a loaded machine that can pass, so a node that failed to
        start (its process exited, nothing of it left running) is started again."""
        for attempt in range(attempts):
            log = Path(self.temp_dir) / f"node-{len(self.nodes)}.log"
            with open(log, "w") as f:
                proc = subprocess.Popen(
                    [self.ray, "start", *args, *([f"--{k}={_free_port()}" for k in NODE_PORTS] if node_ports else [])],
                    env=self.env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
            self.nodes.append(proc)  # the head first, then the workers
            deadline = time.time() + 180
            while "Ray runtime started" not in log.read_text() and proc.poll() is None and time.time() < deadline:
                time.sleep(0.5)
            if proc.poll() is None and "Ray runtime started" in log.read_text():
                return
            self._stop(proc)
            self.nodes.pop()
            if attempt == attempts - 1:
                raise RuntimeError(f"a node did not start ({attempts} tries):\n" + log.read_text()[-3000:])

    @staticmethod
    def _stop(proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # `ray start --block` stops its node's processes
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        left = _session(proc)  # leftovers of the node's session, if any
        for q in left:
            try:
                q.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(left, timeout=30)

    def close(self) -> None:
        for p in self.nodes:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.nodes:
            self._stop(p)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster():
    c = LocalCluster(workers=2)
    try:
        c.start()
        yield c
    finally:
        c.close()


def _write_inputs(folder: Path) -> list[str]:
    folder.mkdir(parents=True)
    ids = []
    for s in range(SHARDS):
        with open(folder / f"s{s}.jsonl", "w") as f:
            for i in range(ROWS):
                ids.append(f"{s}-{i}")
                text = " ".join(WORDS[(7 * s + 3 * i + k) % len(WORDS)] for k in range(24))
                f.write(json.dumps({"id": ids[-1], "text": text}) + "\n")
    return ids


def _units_committed(out: Path) -> int:
    """The ``unit`` records of the output's commit log (``_manifest/log/``; each is created whole)."""
    return sum(json.loads(p.read_text()).get("kind") == "unit" for p in (out / "_manifest" / "log").glob("*.json"))


def _said(err: str) -> list[str]:
    """stderr without the job's INFO log lines and Ray's own lines (``worker.py`` / C++ core logs)."""
    return [ln for ln in err.splitlines() if ln.strip() and " INFO " not in ln and " WARNING " not in ln
            and not ln.startswith(("(", "[")) and ".cc:" not in ln and "worker.py" not in ln]


def test_a_job_that_loses_a_worker_node_ends_with_every_row_exactly_once(cluster, tmp_path):
    ids = _write_inputs(tmp_path / "in")
    out = tmp_path / "out"
    cmd = [sys.executable, str(REPO / "jobs" / "summarize.py"), "--config", str(DEMO), "--input", str(tmp_path / "in"),
           "--output", str(out), "--method", "plain", "--max-new-tokens", "4", "--num-actors", "2",
           "--rows-per-batch", "2", "--no-progress", "--set", "output.partition_by_date=false",
           "--set", "compute.stall_timeout_s=300"]
    env = dict(cluster.env, RAY_ADDRESS=cluster.address)
    errfile = tmp_path / "stderr.txt"
    with open(errfile, "w") as errf:
        job = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=errf,
                               start_new_session=True)
    try:
        deadline = time.time() + 300
        victim = None
        while victim is None:
            assert job.poll() is None and time.time() < deadline, \
                "the job ended before a node was lost:\n" + errfile.read_text()[-3000:]
            if _units_committed(out):  # a unit committed
                victim = next((p for p in cluster.nodes[1:] if _hosts_actor(p)), None)
            time.sleep(0.2)
        committed_before = _units_committed(out)
        assert committed_before < SHARDS, "the job was nearly done before the node was lost: give it more rows"
        t_kill = time.time()
        killed = _kill_node(victim)
        assert "raylet" in killed, killed
        job.wait(timeout=600)
        err = errfile.read_text()
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    print(f"node lost after {committed_before} of {SHARDS} shards; killed {sorted(set(killed))}; "
          f"job exit {job.returncode} {time.time() - t_kill:.0f} s later\n{err[-4000:]}")
    if job.returncode != 0:
        assert job.returncode == 1, err[-4000:]
        said = _said(err)
        assert len(said) == 1 and said[0].startswith("error: the actor pool lost an actor with a batch in flight"), \
            err[-4000:]
        assert "rerun the same command" in said[0]
        assert not (out / "_SUCCESS").exists()
        t_rerun = time.time()
        rerun = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert rerun.returncode == 0, rerun.stderr[-4000:]
        this_run = json.loads(rerun.stdout[rerun.stdout.index("{"):])["this_run"]
        assert next(v for k, v in this_run.items() if k.endswith("_skipped")) >= committed_before  # resumed
        print(f"rerun: {time.time() - t_rerun:.0f} s\n{rerun.stderr[-2000:]}")
    assert (out / "_SUCCESS").exists()
    got = pq.read_table(out).column("id").to_pylist()
    assert len(got) == len(set(got)), "rows written twice"
    assert sorted(got) == sorted(ids), "rows missing"
    summary = json.loads((out / "_summary.json").read_text())
    assert summary["rows"] == len(ids) and summary["errors"] == 0
