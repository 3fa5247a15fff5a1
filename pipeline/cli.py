"""Command line of the job entry points (``jobs/summarize.py``, ``jobs/translate.py``).

    python jobs/summarize.py [--config configs/summarize.yaml] [--set section.key=value ...]
                             [--input URI] [--output URI] [--method NAME] [--overwrite]
                             [--run-date YYYY-MM-DD] [--audit-fraction F] ...

Rerunning a job with the same output resumes it: shards committed by an earlier run are
skipped; ``--overwrite`` starts afresh.  ``--run-date`` (default: today in UTC) names the
``date=YYYY-MM-DD`` partition of the output (and turns ``output.partition_by_date`` on).

Exit status (every failure is reported in one line on stderr):

- 0: the run succeeded (or everything was already committed: nothing to do);
- 1: the run failed: a storage error that outlasted its retries and deadline, a stalled
  run (``compute.stall_timeout_s``), actors that kept dying, or every row failed (the
  output is committed with each row's error); an unexpected error also prints the path
  of a log file with its traceback.  Committed shards are kept: rerunning resumes;
- 2: the job was refused before any work (:class:`pipeline.config.JobRefused`): a bad
  config, input, model (path, architecture, vocabulary), prompt or chat template, output
  location (foreign files, another config or input committed there), or a resource plan
  the cluster cannot hold;
- 130 / 143: interrupted by SIGINT (Ctrl-C) / SIGTERM (``ray job stop``, Kubernetes, a
  cron timeout): committed shards are kept, a rerun resumes.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import os
import re
import signal
import sys
import tempfile
import traceback
from pathlib import Path

from pipeline.config import ConfigError, JobRefused, load_config
from pipeline.flags import build_parser as build_job_parser
from pipeline.flags import config_overrides

REPO_ROOT = Path(__file__).resolve().parents[1]

def build_parser(task: str, default_config: str) -> argparse.ArgumentParser:
    """The parser of ``jobs/<task>.py`` (flags: :mod:`pipeline.flags`)."""
    return build_job_parser(task, f"Speculative-decoding {task} job on Ray Data: shards in, Parquet out.",
                            defaults={"config": default_config}, notes={"output": "output.uri"})


def main(task: str, argv: list[str] | None = None, default_config: str | None = None) -> int:
    """Parse arguments, load and check the config, run the job, print the summary's headline.

    ``task`` (``summarize``/``translate``) must match the config's ``task.name``.
    """
    default_config = default_config or str(REPO_ROOT / "configs" / f"{task}.yaml")
    args = build_parser(task, default_config).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    overrides = config_overrides(task, args)

    from pipeline.retry import StorageError

    previous = _on_sigterm_raise_interrupt()
    try:
        cfg = load_config(args.config, overrides)
        if cfg.task.name != task:
            raise ConfigError(f"jobs/{task}.py runs task.name: {task}, but the config has task.name: {cfg.task.name}")
        if args.print_config:
            print(json.dumps(cfg.resolved(), indent=2))
            return 0
        from pipeline.run import StallError, run_job

        summary = run_job(cfg, progress=not args.no_progress)
    except KeyboardInterrupt:  # SIGINT, or SIGTERM through _on_sigterm_raise_interrupt
        signum = _signal_received or signal.SIGINT
        print(f"\ninterrupted ({signal.Signals(signum).name}): shards committed before the interrupt are kept; "
              "rerun the same command to resume", file=sys.stderr)
        return 128 + signum
    except JobRefused as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - every failure is one line (plus a log file when unexpected)
        storage = _cause(e, StorageError)
        if storage is not None:
            print(f"error: storage: {_one_line(storage)}; shards committed before the error are kept: "
                  "rerun the same command to do only the missing ones", file=sys.stderr)
            return 1
        stall = _cause(e, StallError)
        if stall is not None:
            print(f"error: {_one_line(stall)}", file=sys.stderr)
            return 1
        path = _write_log(e)
        print(f"error: {type(e).__name__}: {_one_line(e)}{_root_cause(e)} (traceback in {path}); shards committed "
              "before the error are kept: rerun the same command to resume", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    headline = {k: summary.get(k) for k in ("run_id", "output", "rows", "errors", "new_tokens", "acceptance_rate",
                                            "mean_accepted_length", "tokens_per_step", "tokens_per_s", "elapsed_s",
                                            "audit_rows", "audit_mismatches")}
    this = summary.get("this_run") or {}
    headline["this_run"] = {"shards_run": len(this.get("shards_run", [])),
                            "shards_skipped": len(this.get("shards_skipped", [])),
                            "nothing_to_do": this.get("nothing_to_do", False)}
    print(json.dumps(headline, indent=2))
    rows, errors = summary.get("rows") or 0, summary.get("errors") or 0
    if rows and errors == rows:
        kinds = ", ".join(f"{k} ({n})" for k, n in sorted((summary.get("error_kinds") or {}).items()))
        print(f"error: every row failed ({rows} rows; {kinds}); the output holds each row's error", file=sys.stderr)
        return 1
    return 0


_signal_received: int | None = None


def _on_sigterm_raise_interrupt():
    """SIGTERM raises KeyboardInterrupt in the main thread (as Ctrl-C does), so the run
    stops the same way: staging dropped, committed shards kept, one line, exit 143.
    Returns the previous handler."""
    def handler(signum, frame):
        global _signal_received
        _signal_received = signum
        raise KeyboardInterrupt

    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, handler)
    return previous if previous is not None else signal.SIG_DFL


def _cause(e: BaseException, kind: type) -> BaseException | None:
    """``e`` or the first exception of kind ``kind`` it was raised from (Ray wraps errors
    of its tasks and actors)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, kind):
            return e
        e = e.__cause__ or e.__context__
    return None


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b.*")


def _lines(e: BaseException) -> list[str]:
    return [ln.strip() for ln in _ANSI.sub("", str(e)).splitlines() if ln.strip()]


def _one_line(e: BaseException) -> str:
    lines = _lines(e)
    return lines[0] if lines else type(e).__name__


def _root_cause(e: BaseException) -> str:
    """``"; cause: RuntimeError: ..."``: the last line of a message that carries a remote
    traceback (Ray's errors of tasks and actors), when it names an exception; else ``""``."""
    lines = _lines(e)
    if len(lines) > 1 and _EXCEPTION_LINE.match(lines[-1]):
        return f"; cause: {lines[-1]}"
    return ""


def _write_log(e: BaseException) -> str:
    """Write ``e``'s full traceback to a new log file; returns its path."""
    d = Path(tempfile.gettempdir()) / "specbatch-logs"
    d.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = d / f"error-{stamp}-{os.getpid()}.log"
    path.write_text("".join(traceback.format_exception(type(e), e, e.__traceback__)))
    return str(path)
