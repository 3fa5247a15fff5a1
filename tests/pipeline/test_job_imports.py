"""A job started by a Python that lacks specbatch's packages stops with one line naming them and
that Python, exit status 2 (pipeline.imports), instead of a traceback from inside an import."""

import os
import re
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest
import yaml

from pipeline.imports import REQUIRED, missing_packages
from pipeline_testkit import REPO

JOBS = ["summarize", "translate", "serve", "tune", "report"]


def _venv(root: Path, site_packages_without: tuple[str, ...] | None) -> Path:
    """A venv of this interpreter without pip; with ``site_packages_without``, it sees this
    environment's packages (through a .pth file of symlinks) except those named."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, capture_output=True)
    python = root / "bin" / "python"
    if site_packages_without is not None:
        mirror = root / "mirror"
        mirror.mkdir()
        ours = Path(sysconfig.get_paths()["purelib"])
        for entry in ours.iterdir():
            if entry.name.split("-")[0].split(".")[0].lower() in site_packages_without:
                continue
            (mirror / entry.name).symlink_to(entry)
        theirs = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                capture_output=True, text=True, check=True).stdout.strip()
        Path(theirs, "mirror.pth").write_text(str(mirror) + "\n")
    return python


def _dependency_names(specs) -> list[str]:
    return [re.split(r"[<>=!~\[;\s]", s, maxsplit=1)[0].lower() for s in specs]


def test_required_is_pyprojects_dependency_list():
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert sorted(_dependency_names(deps)) == sorted(REQUIRED)


def test_runtime_env_example_installs_the_dependencies():
    """configs/runtime_env.yaml (docs/running-jobs.md: On a Ray cluster) is a valid Ray runtime_env whose pip list
    is pyproject's dependencies but Ray, with the same version bounds and torch pinned."""
    from ray.runtime_env import RuntimeEnv

    env = yaml.safe_load((REPO / "configs" / "runtime_env.yaml").read_text())
    RuntimeEnv(**env)  # raises on an unknown field or a bad value
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    wanted = {n: s for n, s in zip(_dependency_names(deps), deps) if n != "ray"}
    pip = env["pip"]["packages"]
    assert sorted(_dependency_names(pip)) == sorted(wanted)
    for spec in pip:
        name = _dependency_names([spec])[0]
        assert spec == ("torch==2.13.0" if name == "torch" else wanted[name].split("#")[0].strip())
    assert env["working_dir"] == "." and "/models/cache/" in env["excludes"]


def test_missing_packages_finds_nothing_missing_here():
    assert missing_packages() == []
    assert missing_packages({"nope": "specbatch_no_such_module", "yaml": "yaml"}) == ["nope"]


@pytest.mark.parametrize("job", JOBS)
def test_a_python_without_anything_gets_one_line(tmp_path, job):
    python = _venv(tmp_path / "bare", None)
    r = subprocess.run([str(python), str(REPO / "jobs" / f"{job}.py"), "--help"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr and r.stdout == "", r.stderr
    assert lines[0].startswith(f"error: jobs/{job}.py needs packages")
    for dist in REQUIRED:
        assert dist in lines[0]
    assert str(python) in lines[0]  # sys.executable: which Python ran it


def test_a_python_without_torch_names_torch_only(tmp_path):
    python = _venv(tmp_path / "notorch", ("torch",))
    ok = subprocess.run([str(python), "-c", "import transformers.utils, yaml, ray; print('ok')"],
                        capture_output=True, text=True, timeout=120)
    assert ok.stdout.strip() == "ok", ok.stderr[-2000:]  # everything else is importable there
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    r = subprocess.run([str(python), str(REPO / "jobs" / "summarize.py"), "--config",
                        str(REPO / "configs" / "demo-summarize.yaml")], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr[-2000:]
    assert re.search(r"cannot import: torch \(Python [\d.]+ at " + re.escape(str(python)) + r"\)", lines[0]), lines[0]
    assert not (tmp_path / "out").exists()
