"""Command line of the job entry points (``jobs/summarize.py``, ``jobs/translate.py``, ``jobs/generate.py``).

    python jobs/summarize.py [--config configs/summarize.yaml] [--set section.key=value ...]
                             [--input URI] [--output URI] [--method NAME] [--overwrite]
                             [--run-date YYYY-MM-DD] [--audit-fraction F] ...

Rerunning a job with the same output resumes it: shards committed by an earlier run are
skipped; ``--overwrite`` starts afresh.  ``--run-date`` (default: today in UTC) names the
``date=YYYY-MM-DD`` partition of the output (and turns ``output.partition_by_date`` on).

Exit status (every failure is reported in one line on stderr):

- 0: the run succeeded (or everything was already committed: nothing to do);
- 1: the run failed: a storage error that outlasted its retries and deadline, a stalled
  run (``compute.stall_timeout_s``), actors that kept dying (the line says whether the
  restarts or the batch retries ran out), an actor lost with a batch in flight (its node
  died), a lost output lease, an input shard that broke
  while the run read it, or every row failed (the output is committed with each row's
  error); an unexpected error also prints the path of a log file with its traceback (in
  :func:`log_dir`).  Committed shards are kept: rerunning resumes;
- 2: the job was refused before any work (:class:`pipeline.config.JobRefused`): a bad
  config, input, model (path, architecture, vocabulary), prompt or chat template, output
  location (foreign files, another config or input committed there, another run holding
  its lease), or a resource plan the cluster cannot hold;
- 130 / 143: interrupted by SIGINT (Ctrl-C) / SIGTERM (``ray job stop``, Kubernetes, a
  cron timeout): committed shards are kept, a rerun resumes.  From the first interrupt
  on, a second one ends the process at once and quietly (no traceback of Ray's shutdown);
  the lease was released already.
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
from pipeline.errors import raised_from
from pipeline.flags import build_parser as build_job_parser
from pipeline.flags import config_overrides

REPO_ROOT = Path(__file__).resolve().parents[1]

def build_parser(task: str, default_config: str) -> argparse.ArgumentParser:
    """The parser of ``jobs/<task>.py`` (flags: :mod:`pipeline.flags`)."""
    return build_job_parser(task, f"Speculative-decoding {task} job on Ray Data: shards in, Parquet out.",
                            defaults={"config": default_config}, notes={"output": "output.uri"})


def main(task: str, argv: list[str] | None = None, default_config: str | None = None) -> int:
    """Parse arguments, load and check the config, run the job, print the summary's headline.

    ``task`` (``summarize``/``translate``/``generate``) must match the config's ``task.name``.
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
        from pipeline.output.lease import LeaseLost
        from pipeline.run import ActorPoolError, StallError, run_job

        summary = run_job(cfg, progress=not args.no_progress)
    except KeyboardInterrupt:  # SIGINT, or SIGTERM through _on_sigterm_raise_interrupt
        return _interrupted()
    except JobRefused as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - every failure is one line (plus a log file when unexpected)
        if _signal_received is not None:  # SIGTERM's KeyboardInterrupt, re-raised as another error by
            return _interrupted()         # the code it landed in (a C call under Ray Data)
        storage = raised_from(e, StorageError)
        if storage is not None:
            print(f"error: storage: {_one_line(storage)}; shards committed before the error are kept: "
                  "rerun the same command to do only the missing ones", file=sys.stderr)
            return 1
        known = raised_from(e, StallError) or raised_from(e, LeaseLost)
        if known is not None:
            print(f"error: {_one_line(known)}", file=sys.stderr)
            return 1
        path = _write_log(e)
        pool = raised_from(e, ActorPoolError)
        if pool is not None:
            print(f"error: {_one_line(pool)} (traceback in {path}); shards committed before the error are kept",
                  file=sys.stderr)
            return 1
        remote = _remote_error(e)
        if remote is not None:  # our own error, raised in a Ray task (Ray keeps only its text)
            print(f"error: {remote} (traceback in {path}); shards committed before the error are kept: rerun the "
                  "same command to resume", file=sys.stderr)
            return 1
        print(f"error: {type(e).__name__}: {_one_line(e)}{_root_cause(e)} (traceback in {path}); shards committed "
              "before the error are kept: rerun the same command to resume", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not signal.SIG_DFL else _after_the_run)
    headline = {k: summary.get(k) for k in ("run_id", "output", "rows", "errors", "new_tokens", "acceptance_rate",
                                            "mean_accepted_length", "tokens_per_step", "tokens_per_s", "elapsed_s",
                                            "audit_rows", "audit_mismatches", "audit_speedup", "reused_rows")}
    this = summary.get("this_run") or {}
    headline["this_run"] = {"units_run": len(this.get("units_run", [])),
                            "units_skipped": len(this.get("units_skipped", [])),
                            "nothing_to_do": this.get("nothing_to_do", False)}
    cpu = summary.get("cpu") or {}
    if cpu.get("headline"):  # the CPU kernels the actors' models run, and the slowest actor's compile time
        headline["cpu"] = f"{cpu['headline']}; slowest actor compiled {cpu['compile_s_max']:.1f} s at load"
    print(json.dumps(headline, indent=2))
    reuse_line(summary)
    speedup_line(summary)
    rows, errors = summary.get("rows") or 0, summary.get("errors") or 0
    if rows and errors == rows:
        kinds = ", ".join(f"{k} ({n})" for k, n in sorted((summary.get("error_kinds") or {}).items()))
        print(f"error: every row failed ({rows} rows; {kinds}); the output holds each row's error", file=sys.stderr)
        return 1
    return 0


def reuse_line(summary: dict) -> None:
    """One line on stderr: how many rows this run copied from the previous output, not
    decoded (``output.previous``), or why it copied none; nothing when it was not asked."""
    previous, this = summary.get("previous") or {}, summary.get("this_run") or {}
    if not previous or this.get("nothing_to_do"):
        return
    rows = this.get("reused_rows") or 0
    pool = previous.get("pool_seeded_rows") or 0
    seeded = f"; {pool:,} previous rows seeded the draft pool" if pool else ""
    rejected = previous.get("rejected_rows") or 0
    if rejected:
        why = "; ".join(f"{n:,} {reason}" for reason, n in (previous.get("rejected") or {}).items())
        seeded += f"; {rejected:,} previous rows rejected and decoded afresh ({why})"
    if rows:
        print(f"reuse: {rows:,} rows reused from {previous.get('output')} (copied, not decoded: tokens/s counts "
              f"the decoded rows only){seeded}", file=sys.stderr)
    else:
        print(f"reuse: no row reused: {previous.get('note')}{seeded}", file=sys.stderr)


def speedup_line(summary: dict) -> None:
    """One line on stderr: the speedup over plain decoding this run measured on its audited
    rows (``audit_speedup``), or why there is none."""
    speedup, rows = summary.get("audit_speedup"), summary.get("audit_rows") or 0
    method = ((summary.get("config") or {}).get("method") or {}).get("name")
    if speedup is None or not rows:
        return
    same = rows - (summary.get("audit_mismatches") or 0)
    if method == "plain":
        text = "method plain: nothing to compare"
    elif speedup >= 1.0:
        text = f"{method} decoded {speedup:.2f}x as fast as plain decoding"
    else:
        text = f"plain decoding was faster: {method} ran at {speedup:.2f}x plain"
    print(f"speculation: {text}, measured on the {rows} audited rows (each decoded again with plain decoding; "
          f"{same}/{rows} outputs identical)", file=sys.stderr)


_signal_received: int | None = None


def _after_the_run(signum, frame) -> None:
    """SIGTERM after the run returned (printing its summary, Ray shutting down at exit):
    the signal contract holds to the last line, one line and exit 143, and nothing is
    waited on (the output is as the run left it: committed units are kept)."""
    sys.stdout.flush()
    print(f"\ninterrupted ({signal.Signals(signum).name}) after the run ended: its committed units are kept",
          file=sys.stderr, flush=True)
    os._exit(128 + signum)


def _interrupted() -> int:
    """The interrupted run's one line; its exit code (128 + the signal)."""
    _exit_at_next_interrupt()
    signum = _signal_received or signal.SIGINT
    print(f"\ninterrupted ({signal.Signals(signum).name}): shards committed before the interrupt are kept; "
          "rerun the same command to resume", file=sys.stderr)
    return 128 + signum


def _on_sigterm_raise_interrupt():
    """SIGTERM raises KeyboardInterrupt in the main thread (as Ctrl-C does), so the run
    stops the same way: staging dropped, committed shards kept, one line, exit 143.
    Returns the previous handler."""
    global _signal_received
    _signal_received = None  # this run's: none yet

    def handler(signum, frame):
        global _signal_received
        _signal_received = signum
        raise KeyboardInterrupt

    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, handler)
    return previous if previous is not None else signal.SIG_DFL


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


_OWN_ERROR_LINE = re.compile(r"^pipeline\.[\w.]*\.(\w+(?:Error|Refused|Lost|Held)): (.+)$")


def _remote_error(e: BaseException) -> str | None:
    """The message of the last of this package's own errors in the remote traceback ``e``
    carries (``pipeline.retry.StorageError: read input shard 'b.parquet' failed ...``: a
    shard that broke while a read task read it), else None."""
    found = None
    for ln in _lines(e):
        m = _OWN_ERROR_LINE.match(ln)
        if m:
            found = m.group(2)
    return found


def _exit_at_next_interrupt() -> None:
    """From now on SIGINT / SIGTERM end the process at once, quietly (exit 128 + signal):
    a second Ctrl-C while Ray shuts down would otherwise print a traceback of its atexit hook."""
    def now(signum, frame):
        try:
            sys.stderr.flush()
        finally:
            os._exit(128 + signum)

    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, now)
        signal.signal(signal.SIGTERM, now)


def log_dir() -> Path:
    """The folder of this user's error logs, created with mode 700 (and tightened to it
    when it exists): ``$XDG_STATE_HOME/specbatch/logs`` when ``XDG_STATE_HOME`` is set, else
    ``~/.cache/specbatch/logs``; when neither can be created (no writable home), a new
    private temporary folder."""
    state = os.environ.get("XDG_STATE_HOME")
    d = Path(state) / "specbatch" / "logs" if state else Path.home() / ".cache" / "specbatch" / "logs"
    try:
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        if not d.is_dir() or d.is_symlink() or d.stat().st_uid != os.getuid():
            raise PermissionError(f"{d} is not a folder of this user")
        os.chmod(d, 0o700)
        return d
    except OSError:
        return Path(tempfile.mkdtemp(prefix="specbatch-logs-"))  # mode 700, a fresh name


def _write_log(e: BaseException) -> str:
    """Write ``e``'s full traceback to a new log file (mode 600) in :func:`log_dir`; returns its path."""
    d = log_dir()
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    # a fresh name (O_EXCL, mode 600) even for two failures of one process in one second
    fd, path = tempfile.mkstemp(prefix=f"error-{stamp}-{os.getpid()}-", suffix=".log", dir=d)
    with os.fdopen(fd, "w") as f:
        f.write("".join(traceback.format_exception(type(e), e, e.__traceback__)))
    return str(path)
