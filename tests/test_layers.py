"""The layers' one rule the import graph can check: the entry points (``jobs/``) are the
top; no module under ``pipeline/``, ``actors/``, ``train/``, ``bench/`` or ``scripts/``
imports from them, at module level or inside a function, by package name or through a
``sys.path`` entry pointing into ``jobs/`` (what they share lives in ``pipeline/``, e.g.
:mod:`pipeline.corpora`)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BELOW_JOBS = ("pipeline", "actors", "train", "bench", "scripts")
JOB_MODULES = {p.stem for p in (REPO / "jobs").glob("*.py")}


def _imports_of_jobs(path: Path) -> list[str]:
    """``line: what`` of every import of ``jobs`` in the Python file ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("sys.path.insert", "sys.path.append"):
            if any(isinstance(c, ast.Constant) and c.value == "jobs" for c in ast.walk(node)):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        for name in names:
            top = name.split(".")[0]
            if top == "jobs" or top in JOB_MODULES:
                found.append(f"{node.lineno}: import {name}")
    return found


def test_nothing_below_the_entry_points_imports_from_them():
    bad = {str(p.relative_to(REPO)): hits for top in BELOW_JOBS for p in sorted((REPO / top).rglob("*.py"))
           if (hits := _imports_of_jobs(p))}
    assert bad == {}


def test_the_check_sees_each_way_of_importing_a_job(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("import jobs.report\n"
                 "def f():\n    from jobs.prepare_inputs import _strip\n"
                 "def g():\n    import sys\n    sys.path.insert(0, str(REPO / 'jobs'))\n    from prepare_inputs import x\n"
                 "from pipeline.tune import report\n")  # a module named like a job, inside a package: fine
    assert sorted(int(h.split(":")[0]) for h in _imports_of_jobs(p)) == [1, 3, 6, 7]
