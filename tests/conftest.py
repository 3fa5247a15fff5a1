"""Suite-wide settings.

- The test models are tiny, so one intra-op thread is fastest and keeps tests from
  oversubscribing the (2-core) machine.
- The suite runs on pytest-xdist workers (``-n auto --dist loadfile --no-loadscope-reorder`` in
  pyproject.toml): one worker per core, at most two, since each worker's tests start a 2-CPU Ray
  and hold the real models; ``-p no:xdist`` runs it in one process.  A test file runs whole on one worker, so its
  module fixtures are built once.
- Files run in this order: those marked ``machine_wide`` first, then those with ``slow`` tests (so
  the long ones do not end the run on one worker while the other idles), then the rest, each in
  its collected order.  xdist keeps that order only without its own reordering (by number of
  tests per file), hence ``--no-loadscope-reorder``.
- A ``machine_wide`` test acts on every process of the machine (the cluster page's ``ray stop``):
  while it runs, the other workers wait before their first test, so no other Ray exists.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

MACHINE_WIDE = "machine_wide"
#: how long a worker waits for the machine-wide tests of another worker before it goes on anyway
MACHINE_WIDE_WAIT_S = 300


def pytest_configure(config):
    config.addinivalue_line("markers", f"{MACHINE_WIDE}: acts on every process of the machine (`ray stop`); "
                                       "runs before the other tests, alone")


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, absent under -p no:xdist
def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: one worker per core, at most two (each runs a 2-CPU Ray and the real models)."""
    return max(1, min(2, os.cpu_count() or 1))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    files: dict[Path, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.path, []).append(item)

    def rank(entry):
        index, tests = entry
        marked = lambda name: any(t.get_closest_marker(name) for t in tests)  # noqa: E731
        return (not marked(MACHINE_WIDE), not marked("slow"), index)

    items[:] = [t for _, tests in sorted(enumerate(files.values()), key=rank) for t in tests]


def _done_flag(config) -> Path:
    """The file a worker creates once its machine-wide tests have finished: in the run's
    temporary folder, which pytest-xdist shares out to the workers as ``<run>/<worker>``."""
    return Path(config.option.basetemp).parent / "machine-wide-tests-done"


_first_test_seen = False


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """On a worker whose first test is not machine-wide, wait before any fixture starts a
    process until the worker that runs the machine-wide tests has finished them."""
    global _first_test_seen
    if _first_test_seen or not hasattr(item.config, "workerinput"):
        return  # one process: the machine-wide files simply run first
    _first_test_seen = True
    if item.get_closest_marker(MACHINE_WIDE) or not any(
            i.get_closest_marker(MACHINE_WIDE) for i in item.session.items):
        return
    flag, deadline = _done_flag(item.config), time.monotonic() + MACHINE_WIDE_WAIT_S
    while not flag.exists() and time.monotonic() < deadline:
        time.sleep(0.5)


@pytest.hookimpl(trylast=True)  # after the test's own fixtures are torn down
def pytest_runtest_teardown(item, nextitem):
    if not hasattr(item.config, "workerinput") or not item.get_closest_marker(MACHINE_WIDE):
        return
    if nextitem is None or not nextitem.get_closest_marker(MACHINE_WIDE):
        _done_flag(item.config).touch()
