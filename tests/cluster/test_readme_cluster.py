"""The "On a Ray cluster" commands of docs/running-jobs.md, run as a new user meets them: the first
``bash`` block of that section, taken from the page and run by ``bash`` in a fresh shell whose PATH does
not hold the venv (as after ``bash scripts/setup.sh``, which does not activate it), started in
another directory that holds the clone as ``specbatch``.  The block starts a real Ray head on
127.0.0.1, submits the default summarize job with ``ray job submit``, and stops Ray.

Changed from the page, and only this: the output goes to the test's folder instead of
``$PWD/out/cluster/``, and ``--max-new-tokens 8`` keeps the job short (with the demo model pair's
config when the real models were not fetched).

``ray stop`` stops every Ray process of the machine, so the test runs only when no other Ray
is running here and the default ports (6379, 8265) are free; otherwise it skips, saying so.
The file is marked ``machine_wide``: the suite runs it first, while its other workers wait
(tests/conftest.py).  Slow (~1 min).
"""

import os
import re
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[2]
#: the page that holds the cluster commands (the README's front page links to it)
PAGE = REPO / "docs" / "running-jobs.md"
SECTION = "## On a Ray cluster"
OUTPUT_IN_README = '--output "$PWD/out/cluster/"'
RAY_PROCESSES = ("gcs_server", "raylet", "dashboard.py", "ray::", "default_worker.py", "ray_client_server")

pytestmark = [pytest.mark.slow, pytest.mark.machine_wide]


def readme_cluster_block() -> str:
    """The first ``bash`` block of the page's "On a Ray cluster" section."""
    section = PAGE.read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]
    m = re.search(r"```bash\n(.*?)```", section, re.S)
    assert m, f"{PAGE.name}'s 'On a Ray cluster' section has no bash block"
    return m.group(1)


def _other_ray() -> str | None:
    for p in psutil.process_iter(["pid", "name", "cmdline"]):
        try:
            text = " ".join([p.info["name"] or "", *(p.info["cmdline"] or [])])
        except (psutil.Error, TypeError):
            continue
        if any(s in text for s in RAY_PROCESSES) and p.info["pid"] != os.getpid():
            return f"pid {p.info['pid']}: {text[:120]}"
    for port in (6379, 8265):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return f"port {port} is in use"
    return None


def _shell_env() -> dict:
    """The environment of a new shell: no venv on PATH, no Ray address."""
    venv_bin = str(REPO / ".venv" / "bin")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "RAY_ADDRESS", "RAY_AUTH_MODE")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if p and Path(p).resolve() != Path(venv_bin).resolve())
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    return env


def test_readme_block_is_what_a_new_user_types():
    block = readme_cluster_block()
    lines = [ln.split("#")[0].strip() for ln in block.splitlines()]
    assert lines[0].startswith("cd ") and "source .venv/bin/activate" in lines[1]
    assert any(ln.startswith("ray start --head") for ln in lines) and lines[-1 if lines[-1] else -2] == "ray stop"
    assert OUTPUT_IN_README in block and "ray job submit" in block


def test_readme_cluster_commands_run_literally(tmp_path):
    if not (REPO / ".venv" / "bin" / "activate").is_file():
        pytest.skip("no .venv in the clone: the page's commands follow bash scripts/setup.sh")
    busy = _other_ray()
    if busy:
        pytest.skip(f"another Ray runs on this machine ({busy}): the page's `ray stop` would stop it")
    block = readme_cluster_block()
    out = tmp_path / "out"
    extra = f'--output "{out}/" --max-new-tokens 8 --no-progress'
    if not (REPO / "models" / "cache" / "SmolLM2-135M-Instruct" / "config.json").is_file():
        extra += " --config configs/demo-summarize.yaml"  # the real models were not fetched
    script = block.replace(OUTPUT_IN_README, extra)
    home = tmp_path / "home"
    home.mkdir()
    (home / "specbatch").symlink_to(REPO)  # "cd specbatch" from another working directory
    try:
        r = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=home, env=_shell_env(),
                           capture_output=True, text=True, timeout=600)
    finally:
        if _other_ray() is not None:  # ours: none ran before the block; stop what it left
            subprocess.run([str(REPO / ".venv" / "bin" / "ray"), "stop", "--force"], capture_output=True, timeout=120)
    log = (r.stdout + r.stderr)[-6000:]
    assert r.returncode == 0, log
    assert re.search(r"Job 'raysubmit_\w+' succeeded", r.stdout), log
    table = pq.read_table(out)
    assert table.num_rows == 20 and table.column("error").null_count == 20, log
    assert all(0 < n <= 8 for n in table.column("new_tokens").to_pylist())
    assert '"rows": 20' in r.stdout  # the job's summary headline, streamed by ray job submit
    deadline = time.time() + 30
    while _other_ray() is not None and time.time() < deadline:
        time.sleep(1)
    assert _other_ray() is None, "the page's ray stop left Ray processes behind"
