"""Where a relative path in a job config points.

A relative local path **written in a config file** resolves against that file's folder, so
a config works from any working directory (``configs/summarize.yaml`` says
``../data/demo_prompts.jsonl``); a path given **on the command line** (``--input``,
``--output``, ``--target``, ``--set input.uri=...``, ``--config``) resolves against the
current directory, as every command-line tool does.  The keys that hold paths are
:data:`PATH_KEYS`.

URLs (``s3://...``, ``file://...``, ``memory://...``) and absolute paths are left as they
are, and so is a model value that is a hub id (``org/name`` where ``org`` is not a folder
beside the config file): transformers resolves those.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

#: (section, key) -> kind: ``uri`` (a local path or glob, or an fsspec URL), ``model`` (a
#: local folder or a hub id), ``file`` (a local file, unless the value is inline text),
#: ``previous`` (a ``uri``, unless the value is ``auto``: ``./auto`` names a folder of that name)
PATH_KEYS: dict[tuple[str, str], str] = {
    ("input", "uri"): "uri",
    ("output", "uri"): "uri",
    ("output", "previous"): "previous",
    ("models", "target"): "model",
    ("models", "drafter"): "model",
    ("serve", "chat_template"): "file",
    ("method", "draft_vocab"): "file",
    ("cpu", "compile_cache"): "uri",
}

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")


def is_url(value: str) -> bool:
    """``s3://bucket/x``, ``file:///x``, ``memory://x``: a URL with a scheme (not a local path)."""
    return bool(_URL.match(value))


def looks_local(path: str, base: str | Path | None = None) -> bool:
    """Whether a model value can only mean a local folder: absolute, ``./``/``../``, ``~``, a
    path with other than exactly one ``/``, or ``org/name`` where ``org`` is a folder in
    ``base`` (default: the working directory).  Otherwise it is an ``org/name`` hub id."""
    if path.startswith((".", "/", "~")) or path.count("/") != 1:
        return True
    return (Path(base or ".") / path.split("/", 1)[0]).is_dir()


def _join(base: Path, value: str) -> str:
    joined = os.path.normpath(os.path.join(base, value))
    return joined + "/" if value.endswith("/") and not joined.endswith("/") else joined


def resolve_path(value: Any, kind: str, base: Path) -> Any:
    """``value`` (of a :data:`PATH_KEYS` kind) made absolute against ``base`` when it is a
    relative local path; anything else is returned as it is."""
    if not isinstance(value, str) or not value.strip() or is_url(value):
        return value
    expanded = os.path.expanduser(value)
    if os.path.isabs(expanded):
        return expanded
    if kind == "model" and not looks_local(value, base):
        return value  # a hub id
    if kind == "file" and ("{{" in value or "{%" in value):
        return value  # an inline Jinja template
    if kind == "previous" and value == "auto":
        return value  # output.previous: auto
    return _join(base, value)


def resolve_config_paths(data: dict[str, Any], base: str | Path) -> dict[str, Any]:
    """Make the relative local paths of a config file's data (:data:`PATH_KEYS`) absolute
    against ``base``, the file's folder.  Changes and returns ``data``."""
    base = Path(base).resolve()
    for (section, key), kind in PATH_KEYS.items():
        node = data.get(section)
        if isinstance(node, dict) and key in node:
            node[key] = resolve_path(node[key], kind, base)
    return data
