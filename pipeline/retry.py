"""Storage calls with bounded waits: retries with exponential backoff, request timeouts and
a deadline per call (reads of shards, writes of parts, the manifest).

A *transient* error is one a later attempt can cure: the connection was refused, reset or
timed out, the server answered 5xx or throttled (``SlowDown``, 503).  A missing file, a
denied access or a bad argument is not transient and fails at once.  This loop wraps whole
operations (open + write + close), so a part is rewritten from the start after an outage.

Bounded waits (``retry:`` in the job config, :class:`pipeline.config.RetryConfig`):

- :func:`open_fs` opens every filesystem the job uses.  For S3 it passes
  ``connect_timeout_s`` / ``read_timeout_s`` to botocore and turns botocore's and s3fs's
  own retry loops off (they multiply: 5 s3fs tries x 5 botocore attempts x a 60 s read
  timeout is 25 minutes per call), so each attempt here is one request with bounded waits.
- :func:`with_retries` starts no attempt after ``deadline_s`` from the call's start.

A call to an endpoint that accepts connections but never answers therefore fails after at
most ``deadline_s + connect_timeout_s + read_timeout_s``, with a :class:`StorageError`
naming the call and the endpoint, and a warning is logged at every failed attempt.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, TypeVar

log = logging.getLogger("specbatch")
T = TypeVar("T")

_NOT_TRANSIENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)
_TRANSIENT_NAMES = {
    # botocore / aiobotocore / aiohttp / urllib3 connection-level errors, matched by name so
    # that this module needs none of those packages
    "EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError", "ConnectTimeoutError",
    "ConnectionError", "ProxyConnectionError", "ClientConnectorError", "ServerDisconnectedError",
    "ClientOSError", "ClientPayloadError", "ServerTimeoutError", "IncompleteReadError",
    "ResponseStreamingError",
}
_TRANSIENT_CODES = {"500", "502", "503", "504", "SlowDown", "Throttling", "ThrottlingException",
                    "RequestTimeout", "RequestTimeTooSkewed", "InternalError", "ServiceUnavailable"}


class StorageError(OSError):
    """A storage operation still failed after every retry (or failed with a non-transient error).

    Attributes:
        transient: the last error was transient (the attempts or the deadline ran out), so
            a rerun later may succeed; False: retrying cannot help (missing, denied).
    """

    def __init__(self, message: str, transient: bool = False):
        super().__init__(message)
        self.transient = transient

    def __str__(self) -> str:  # OSError's would prefix errno-style tuples
        return self.args[0] if self.args else ""


def is_transient(e: BaseException) -> bool:
    """Whether ``e`` (or an exception it was raised from) looks like a passing storage fault."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, _NOT_TRANSIENT + (StorageError,)):
            return False
        if isinstance(e, (ConnectionError, TimeoutError)):
            return True
        for cls in type(e).__mro__:
            if cls.__name__ in _TRANSIENT_NAMES:
                return True
        code = getattr(e, "response", None)
        if isinstance(code, dict):
            err = code.get("Error", {}) or {}
            status = str((code.get("ResponseMetadata") or {}).get("HTTPStatusCode", ""))
            if str(err.get("Code", "")) in _TRANSIENT_CODES or status in _TRANSIENT_CODES:
                return True
        if isinstance(e, OSError) and not isinstance(e, _NOT_TRANSIENT):
            # s3fs turns botocore errors into OSError(errno, message); EIO/ETIMEDOUT etc.
            msg = str(e).lower()
            if any(s in msg for s in ("connect", "timed out", "timeout", "reset", "refused",
                                       "slow down", "service unavailable", "internal error", "broken pipe")):
                return True
        e = e.__cause__ or e.__context__
    return False


def with_retries(fn: Callable[[], T], *, what: str, attempts: int = 6, initial_backoff_s: float = 0.5,
                 max_backoff_s: float = 30.0, deadline_s: float | None = None, endpoint: str | None = None,
                 sleep: Callable[[float], Any] = time.sleep, clock: Callable[[], float] = time.monotonic) -> T:
    """Call ``fn()``; on a transient error wait and call it again, up to ``attempts`` calls,
    starting none later than ``deadline_s`` seconds after the first (None: no deadline).

    Raises:
        StorageError: the last error, when it is not transient or the attempts or the
            deadline ran out; the message names ``what``, ``endpoint`` (when given), the
            number of attempts and the seconds spent.
    """
    where = f" (endpoint {endpoint})" if endpoint else ""
    start = clock()
    delay = initial_backoff_s
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001
            transient = is_transient(e)
            spent = clock() - start
            out_of_time = deadline_s is not None and spent + delay > deadline_s
            if not transient or attempt == attempts or out_of_time:
                if not transient:
                    tries = "(not retried)"
                else:
                    tries = f"after {attempt} attempt{'s' if attempt > 1 else ''} in {spent:.0f} s"
                    if out_of_time and attempt < attempts:
                        tries += f" (retry.deadline_s={deadline_s:g} reached)"
                raise StorageError(f"{what}{where} failed {tries}: {type(e).__name__}: {_one_line(e)}",
                                   transient=transient) from e
            log.warning("%s%s: transient error (attempt %d/%d, %.0f s), retrying in %.1fs: %s: %s",
                        what, where, attempt, attempts, spent, delay, type(e).__name__, _one_line(e))
            sleep(delay)
            delay = min(max_backoff_s, delay * 2 if delay else 0)
    raise AssertionError("unreachable")


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


_LOOP_KEYS = ("attempts", "initial_backoff_s", "max_backoff_s", "deadline_s")


def retry_settings(retry_cfg: Any | None) -> dict[str, Any]:
    """A :class:`pipeline.config.RetryConfig`, its dict, or None (the defaults) as a dict."""
    from pipeline.config import RetryConfig

    if retry_cfg is None:
        return RetryConfig().model_dump()
    if isinstance(retry_cfg, dict):
        return RetryConfig.model_validate(retry_cfg).model_dump()
    return retry_cfg.model_dump()


def retrying(retry_cfg: Any | None, endpoint: str | None = None) -> Callable[..., Any]:
    """``with_retries`` bound to a :class:`pipeline.config.RetryConfig` (or its dict; None =
    defaults) and to the endpoint named in its errors (see :func:`endpoint_of`)."""
    settings = retry_settings(retry_cfg)
    opts = {k: settings[k] for k in _LOOP_KEYS}

    def call(fn: Callable[[], T], what: str) -> T:
        return with_retries(fn, what=what, endpoint=endpoint, **opts)

    return call


_S3_PROTOCOLS = ("s3", "s3a")


def open_fs(url: str, storage_options: dict[str, Any] | None = None, retry_cfg: Any | None = None):
    """``fsspec.core.url_to_fs(url, **storage_options)`` with the job's request timeouts.

    For ``s3://`` URLs, ``config_kwargs`` gets botocore's ``connect_timeout`` and
    ``read_timeout`` (``retry.connect_timeout_s`` / ``read_timeout_s``) and
    ``retries: {total_max_attempts: 1}``, and the filesystem's own retry loop is set to one
    try: :func:`with_retries` is the only retry loop; uploads send no ``Expect:
    100-continue`` (see :func:`_s3_session`).  Keys the user set in
    ``storage_options.config_kwargs`` (or a ``session`` of their own) win.

    Returns:
        ``(filesystem, path)`` as ``url_to_fs``.
    """
    from fsspec.core import split_protocol, url_to_fs

    opts = dict(storage_options or {})
    s3 = (split_protocol(url)[0] or "file") in _S3_PROTOCOLS
    if s3:
        settings = retry_settings(retry_cfg)
        ck = dict(opts.get("config_kwargs") or {})
        ck.setdefault("connect_timeout", settings["connect_timeout_s"])
        ck.setdefault("read_timeout", settings["read_timeout_s"])
        ck.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})  # no retry inside a call
        opts["config_kwargs"] = ck
        if "session" not in opts:
            opts["session"] = _s3_session(opts.get("profile"))
    fs, path = url_to_fs(url, **opts)
    if s3 and hasattr(fs, "retries"):
        fs.retries = 1  # s3fs's own loop (5 tries by default) around every request
    return fs, path


_SESSIONS: dict[Any, Any] = {}


def _s3_session(profile: str | None):
    """One aiobotocore session per profile and process, without botocore's ``Expect:
    100-continue`` header on uploads: aiohttp waits for the server's "100 Continue" with no
    timeout, so an upload to an endpoint that stopped answering hung forever whatever
    ``read_timeout`` said (the body is now sent at once; the server's answer is still
    awaited under the read timeout)."""
    if profile not in _SESSIONS:
        from aiobotocore.session import AioSession
        from botocore.handlers import add_expect_header

        session = AioSession(profile=profile) if profile else AioSession()
        session.unregister("before-call.s3", add_expect_header)
        _SESSIONS[profile] = session
    return _SESSIONS[profile]


def endpoint_of(fs: Any) -> str | None:
    """The server a filesystem talks to, for error messages: an S3 endpoint URL (or
    ``AWS S3`` for the default), None for local files."""
    protos = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    if not any(p in _S3_PROTOCOLS for p in protos):
        return None
    url = (getattr(fs, "endpoint_url", None) or (getattr(fs, "client_kwargs", None) or {}).get("endpoint_url")
           or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"))
    return url or "AWS S3"
