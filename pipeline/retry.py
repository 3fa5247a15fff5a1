"""Retries with exponential backoff for object-storage calls (reads of shards, writes of parts).

A *transient* error is one a later attempt can cure: the connection was refused, reset or
timed out, the server answered 5xx or throttled (``SlowDown``, 503).  A missing file, a
denied access or a bad argument is not transient and fails at once.  s3fs/botocore have
their own short retry loops; this one wraps whole operations (open + write + close), so a
part is rewritten from the start after an outage of up to ``sum(backoffs)`` seconds.
"""

from __future__ import annotations

import logging
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
    """A storage operation still failed after every retry (or failed with a non-transient error)."""


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
                 max_backoff_s: float = 30.0, sleep: Callable[[float], Any] = time.sleep) -> T:
    """Call ``fn()``; on a transient error wait and call it again, up to ``attempts`` calls.

    Raises:
        StorageError: the last error, when it is not transient or the attempts ran out;
            the message names ``what`` and the number of attempts.
    """
    delay = initial_backoff_s
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001
            transient = is_transient(e)
            if not transient or attempt == attempts:
                tries = f"after {attempt} attempts" if transient else "(not retried)"
                raise StorageError(f"{what} failed {tries}: {type(e).__name__}: {e}") from e
            log.warning("%s: transient error (attempt %d/%d), retrying in %.1fs: %s: %s",
                        what, attempt, attempts, delay, type(e).__name__, e)
            sleep(delay)
            delay = min(max_backoff_s, delay * 2 if delay else 0)
    raise AssertionError("unreachable")


def retrying(retry_cfg: Any | None) -> Callable[..., Any]:
    """``with_retries`` bound to a :class:`pipeline.config.RetryConfig` (or its dict; None = defaults)."""
    if retry_cfg is None:
        opts: dict[str, Any] = {}
    elif isinstance(retry_cfg, dict):
        opts = dict(retry_cfg)
    else:
        opts = retry_cfg.model_dump()

    def call(fn: Callable[[], T], what: str) -> T:
        return with_retries(fn, what=what, **opts)

    return call
