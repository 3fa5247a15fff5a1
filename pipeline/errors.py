"""Exceptions' chains: Ray raises our errors and its own wrapped in others (a task's
``RayTaskError``, Ray Data's ``UserCodeException``), so the job finds what failed by walking
the chain of causes."""

from __future__ import annotations


def raised_from(e: BaseException | None, kind: type | tuple[type, ...]) -> BaseException | None:
    """``e`` itself or the first exception of ``kind`` it was raised from (following
    ``__cause__``, else ``__context__``); None when there is none.  A chain that loops is
    walked once."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, kind):
            return e
        e = e.__cause__ or e.__context__
    return None
