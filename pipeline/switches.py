"""The environment switches (``SPECBATCH_*``): one table, checked by the driver before Ray starts.

Each variable the project reads is listed in :data:`SWITCHES` with what it does and how its
value is checked; the modules that read them keep their own parsing (the CPU options:
:mod:`pipeline.engine.cpu.options`, listed from there).  :func:`check_environment` runs in the
job's preflight (:func:`pipeline.run.preflight`), before any model loads and before Ray
starts: a bad value is refused with exit status 2 naming the variable (rather than an
actor dying at load), and an unknown ``SPECBATCH_*`` name, a misspelt switch that would be
ignored, gets a warning naming the closest known one (:mod:`difflib`).
"""

from __future__ import annotations

import datetime as _dt
import difflib
import logging
import os
from dataclasses import dataclass
from typing import Callable, Mapping

from pipeline.config.sections import ConfigError
from pipeline.engine.cpu.options import check_env_value, env_variables

log = logging.getLogger(__name__)

PREFIX = "SPECBATCH_"


@dataclass(frozen=True)
class Switch:
    """One environment variable: its ``name``, what it does, and ``check(name, value)``
    (raises ``ValueError`` naming the variable; ``None``: any value)."""

    name: str
    meaning: str
    check: Callable[[str, str], None] | None = None


def _date(name: str, value: str) -> None:
    if value.strip():
        try:
            _dt.date.fromisoformat(value.strip())
        except ValueError:
            raise ValueError(f"environment variable {name}={value!r}: expected a date YYYY-MM-DD or nothing") from None


def _zero_one(name: str, value: str) -> None:
    if value.strip() not in ("", "0", "1"):
        raise ValueError(f"environment variable {name}={value!r}: expected 0 or 1")


#: every SPECBATCH_* variable the project reads, by name
SWITCHES: dict[str, Switch] = {
    **{name: Switch(name, f"the CPU acceleration's {what} (cpu: section)", check_env_value)
       for name, what in env_variables().items()},
    "SPECBATCH_API_KEY": Switch("SPECBATCH_API_KEY", "the server's API key when serve.api_key is unset"),
    "SPECBATCH_RUN_DATE": Switch("SPECBATCH_RUN_DATE", "the night's --run-date in deploy/kuberay", _date),
    "SPECBATCH_SKIP_REAL_MODELS": Switch("SPECBATCH_SKIP_REAL_MODELS", "scripts/setup.sh: do not fetch the real "
                                         "models (the real-model tests skip)", _zero_one),
    "SPECBATCH_TORCH_INDEX": Switch("SPECBATCH_TORCH_INDEX", "scripts/setup.sh: the index torch installs from"),
    "SPECBATCH_KUBERAY_CRD": Switch("SPECBATCH_KUBERAY_CRD", "tests/test_deploy.py: KubeRay's RayJob schema"),
}


def check_environment(environ: Mapping[str, str] | None = None) -> list[str]:
    """Check every ``SPECBATCH_*`` variable of ``environ`` (default: ``os.environ``).

    Returns:
        The warnings, also logged: one per unknown ``SPECBATCH_*`` name, with the closest
        known name when one is close.

    Raises:
        ConfigError: a known variable with a bad value (the message names it and says what
            it takes); exit status 2 on the command line.
    """
    environ = os.environ if environ is None else environ
    warnings = []
    for name in sorted(n for n in environ if n.startswith(PREFIX)):
        switch = SWITCHES.get(name)
        if switch is None:
            known = {n[len(PREFIX):]: n for n in SWITCHES}
            close = difflib.get_close_matches(name[len(PREFIX):], known, n=1, cutoff=0.6)
            hint = f"; did you mean {known[close[0]]}?" if close else f"; known: {', '.join(sorted(SWITCHES))}"
            warnings.append(f"unknown environment variable {name} (ignored){hint}")
            log.warning("%s", warnings[-1])
        elif switch.check is not None:
            try:
                switch.check(name, environ[name])
            except ValueError as e:
                raise ConfigError(f"{e} (refused before work starts)") from None
    return warnings
