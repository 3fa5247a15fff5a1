"""The jobs' first check: the Python running a job can import what specbatch needs.

A job started by the wrong Python (the system's instead of the set-up's ``.venv``, as
``ray job submit -- python ...`` does when Ray was started outside the venv) would
otherwise die in a 30-line ``ModuleNotFoundError`` traceback from deep inside an import.
:func:`require_packages` runs before anything else is imported and turns that into one
line naming every missing package and the interpreter (``sys.executable``), exit status 2.

Standard library only, so it runs under any Python 3.
"""

from __future__ import annotations

import importlib.util
import sys

#: pyproject.toml's ``[project] dependencies`` (distribution name -> import name); a test
#: keeps the two lists equal
REQUIRED = {
    "torch": "torch",
    "transformers": "transformers",
    "accelerate": "accelerate",
    "ray": "ray",
    "pyarrow": "pyarrow",
    "fsspec": "fsspec",
    "s3fs": "s3fs",
    "zstandard": "zstandard",
    "pydantic": "pydantic",
    "pyyaml": "yaml",
    "tqdm": "tqdm",
    "tokenizers": "tokenizers",
    "safetensors": "safetensors",
    "gguf": "gguf",
    "matplotlib": "matplotlib",
    "jsonschema": "jsonschema",
    "llguidance": "llguidance",
}


def missing_packages(required: dict | None = None) -> list:
    """Distribution names of ``required`` (default :data:`REQUIRED`) whose module this
    Python cannot find (``importlib.util.find_spec``: nothing is imported)."""
    missing = []
    for dist, module in (required or REQUIRED).items():
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(dist)
    return missing


def missing_message(job: str, missing: list) -> str:
    """The one-line refusal for ``missing`` packages (see :func:`require_packages`)."""
    version = ".".join(str(v) for v in sys.version_info[:3])
    return (f"error: {job} needs packages that the Python running it cannot import: {', '.join(missing)} "
            f"(Python {version} at {sys.executable}); run it with the Python that specbatch is installed in "
            "(after bash scripts/setup.sh: .venv/bin/python, or activate it with: source .venv/bin/activate); "
            "under ray job submit, start Ray from that environment or give the job a runtime_env "
            "(docs/running-jobs.md: On a Ray cluster)")


def require_packages(job: str, required: dict | None = None) -> None:
    """Exit with status 2 and one line on stderr when this Python lacks a package specbatch
    needs; return silently otherwise.

    Args:
        job: how the job is named in the message (``jobs/summarize.py``).
        required: distribution name -> import name (default :data:`REQUIRED`).

    Raises:
        SystemExit: status 2, when a package is missing.
    """
    missing = missing_packages(required)
    if missing:
        print(missing_message(job, missing), file=sys.stderr)
        raise SystemExit(2)
